"""Constant coercion in validation (the per-type coercer table in execution/validation.py)."""
from __future__ import annotations

import math

import pytest

from execution.errors import PromptError
from execution.validation import validate_prompt
from nodes.registry import NodeRegistry
from nodes.spec import Input, NodeSpec, Output


def _registry() -> NodeRegistry:
    registry = NodeRegistry()
    registry.register(NodeSpec(
        "Takes", lambda i, f, s, b: None, output_node=True,
        inputs=[Input.int("i"), Input.float("f"), Input.string("s"), Input.boolean("b")]))
    return registry


def _check(**inputs):
    values = {"i": 1, "f": 1.0, "s": "x", "b": False, **inputs}
    return validate_prompt({"1": {"class_type": "Takes", "inputs": values}}, _registry()).prompt.nodes["1"].inputs


@pytest.mark.parametrize("name, given, expected", [
    ("i", 3.0, 3), ("i", " 12 ", 12), ("f", 2, 2.0), ("f", "0.25", 0.25),
    ("b", "TRUE", True), ("b", "false", False), ("s", "", ""),
])
def test_accepted_values_are_coerced(name, given, expected):
    value = _check(**{name: given})[name]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("name, given", [
    ("i", True), ("i", 2.5), ("i", "two"), ("i", [1]),
    ("f", False), ("f", "nan"), ("f", math.inf), ("f", "x"),
    ("s", 5), ("b", 1), ("b", "yes"),
])
def test_refused_values_name_node_input_and_type(name, given):
    with pytest.raises(PromptError) as caught:
        _check(**{name: given})
    error = caught.value.to_json()["node_errors"]["1"]["errors"][0]
    assert error["type"] == "invalid_input_type"
    assert f"input '{name}' expects" in error["message"] and error["extra_info"]["input_name"] == name
