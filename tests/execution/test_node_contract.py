"""The node contract (execution/spec.py): the registration check that ties execute to the inputs,
and the editor's widget order."""
from __future__ import annotations

import pytest

from execution.spec import InputSpec, NodeDefinitionError, NodeSpec, OutputSpec, widget_inputs
from nodes.classic import spec_from_class
from nodes.spec import Input, Output


def test_default_stated_twice_and_differently_is_refused_naming_node_and_input():
    def execute(steps=20):
        return (steps,)

    with pytest.raises(NodeDefinitionError,
                       match=r"node 'Steps': input 'steps': declared default 30 differs from execute's default 20"):
        NodeSpec("Steps", execute, inputs=[Input.int("steps", 30, min=1, max=100)], outputs=[Output("INT")])


def test_equal_defaults_and_defaults_on_one_side_register():
    def same(steps=30, scale=1):
        return (steps,)

    NodeSpec("Same", same, inputs=[Input.int("steps", 30), Input.float("scale", 1.0)], outputs=[Output("INT")])

    def bool_vs_int(flag=1):
        return (flag,)

    with pytest.raises(NodeDefinitionError, match="input 'flag': declared default True differs"):
        NodeSpec("Flag", bool_vs_int, inputs=[Input.boolean("flag", True)], outputs=[Output("BOOLEAN")])


def test_parameter_without_input_or_default_is_refused():
    with pytest.raises(NodeDefinitionError, match="node 'Extra': execute: parameter 'size' has no default"):
        NodeSpec("Extra", lambda image, size: (image,), inputs=[Input.link("image", "IMAGE")],
                 outputs=[Output("IMAGE")])
    # A parameter with a default that no input declares is the node's own business.
    NodeSpec("Extra", lambda image, size=4: (image,), inputs=[Input.link("image", "IMAGE")], outputs=[Output("IMAGE")])


def test_input_execute_cannot_take_is_refused():
    with pytest.raises(NodeDefinitionError, match="node 'Deaf': input 'mask': execute has no parameter"):
        NodeSpec("Deaf", lambda image: (image,), inputs=[Input.link("image", "IMAGE"), Input.link("mask", "MASK")],
                 outputs=[Output("IMAGE")])
    NodeSpec("Open", lambda image, **rest: (image,), inputs=[Input.link("image", "IMAGE"), Input.link("mask", "MASK")],
             outputs=[Output("IMAGE")])


def test_optional_input_needs_a_default_in_execute():
    with pytest.raises(NodeDefinitionError, match="node 'Opt': input 'mask': is optional"):
        NodeSpec("Opt", lambda image, mask: (image,),
                 inputs=[Input.link("image", "IMAGE"), Input.link("mask", "MASK", optional=True)],
                 outputs=[Output("IMAGE")])
    # Auto-grow groups always arrive (as a dict of the connected slots).
    NodeSpec("Grow", lambda values: (0.0,),
             inputs=[Input.autogrow("values", InputSpec("value", "FLOAT"), prefix="v", max=3)],
             outputs=[Output("FLOAT")])


def test_positional_only_input_is_refused():
    def execute(image, /):
        return (image,)

    with pytest.raises(NodeDefinitionError, match="parameter 'image' is positional-only"):
        NodeSpec("Pos", execute, inputs=[Input.link("image", "IMAGE")], outputs=[Output("IMAGE")])


def test_classic_class_whose_method_default_differs_is_adapted():
    class Classic:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"strength": ("FLOAT", {"default": 1.0})},
                    "optional": {"scale": ("INT", {"default": 2})}}

        RETURN_TYPES = ("FLOAT",)
        FUNCTION = "go"

        def go(self, strength=0.5, scale=7):
            return (strength * scale,)

    spec = spec_from_class("Classic", Classic)
    assert spec.execute(strength=2.0) == (14.0,)


def test_widget_inputs_follow_the_editor_order():
    inputs = [
        Input.link("image", "IMAGE"),
        Input.int("width", 8, optional=True),
        Input.string("text"),
        Input.int("forced", 1, force_input=True),
        Input.dynamic_combo("mode", {"a": [Input.int("n", 1)]}),
        Input.autogrow("widgets", Input.float("w"), prefix="w", max=2),
        Input.autogrow("links", InputSpec("l", "IMAGE"), prefix="l", max=2),
        Input.hidden("uid", "UNIQUE_ID"),
    ]
    assert [i.name for i in widget_inputs(inputs)] == ["text", "mode", "width", "widgets"]
    spec = NodeSpec("W", lambda **kw: None, inputs=inputs, outputs=[OutputSpec("IMAGE")])
    assert spec.widget_inputs() == widget_inputs(inputs)


def test_searched_folder_reads_a_name_or_a_function():
    assert Input.combo("f", ["a"], folder="input").searched_folder() == "input"
    assert Input.combo("f", ["a"], folder=lambda: "models/vae").searched_folder() == "models/vae"
    assert Input.combo("f", ["a"]).searched_folder() is None


def test_builtin_nodes_state_a_required_input_default_once():
    """A required input always arrives with a value, so its default lives in the declaration alone; only an
    optional input, which a prompt may leave out, also needs one in execute."""
    import inspect

    from nodes.registry import builtin_registry

    twice = []
    for spec in builtin_registry():
        for param in inspect.signature(spec.execute).parameters.values():
            declared = spec.input(param.name)
            if (declared is not None and declared.kind == "required" and "default" in declared.options
                    and param.default is not param.empty):
                twice.append(f"{spec.node_id}.{param.name}")
    assert twice == []
