"""Services (execution/context.py): what the node calls of one runtime share."""
from __future__ import annotations

import pytest

from execution.context import DEFAULT_MAX_LOOP_ITERATIONS, RunContext, Services
from execution.paths import Paths


def test_shared_objects_are_made_once_per_runtime():
    services = Services(max_loop_iterations=5)
    made = []

    def make():
        made.append(object())
        return made[-1]

    first = services.shared("model_cache", make)
    assert services.shared("model_cache", make) is first and len(made) == 1
    assert Services().shared("model_cache", make) is not first  # another runtime, another object
    assert services.max_loop_iterations == 5 and Services().max_loop_iterations == DEFAULT_MAX_LOOP_ITERATIONS


def test_mapping_reads_of_node_code_see_the_same_values():
    services = Services(max_loop_iterations=3)
    assert services.get("max_loop_iterations") == 3
    cache = services.setdefault("model_cache", {"kept": 1})
    assert services.setdefault("model_cache", {}) is cache and services["model_cache"] is cache
    assert services.shared("model_cache", dict) is cache
    assert services.get("missing", "fallback") == "fallback"
    with pytest.raises(KeyError):
        services["missing"]
    with pytest.raises(AttributeError):
        services.anything_else = 1  # settings are declared, not added on the fly


def test_a_node_call_without_services_gets_its_own(tmp_path):
    context = RunContext(prompt_id="p", node_id="1", display_node_id="1", paths=Paths(tmp_path))
    assert isinstance(context.runtime, Services)
