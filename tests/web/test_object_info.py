"""/object_info rendering (web/object_info.py): the wire format, byte for byte.

`object_info_expected.json` was written by the renderer as it stood before /object_info moved from
NodeSpec into web/, over specs that use every shape the format has; a change of field, order or
value here changes what the editor and clients read. One field has changed since, on purpose: a hidden
input declared as a bare string (as classic nodes declare it) is shown as that string, as ComfyUI shows it.
"""
from __future__ import annotations

import json
from pathlib import Path

from nodes.registry import NodeRegistry
from nodes.spec import Input, InputSpec, NodeSpec, Output
from web.object_info import node_info, object_info

EXPECTED = Path(__file__).with_name("object_info_expected.json")


def _run(**kwargs):
    return None


def catalogue() -> list[NodeSpec]:
    """Specs covering every input and output shape /object_info renders."""
    return [
        NodeSpec("Widgets", _run, inputs=[
            Input.int("seed", 0, min=0, max=2**64 - 1, control_after_generate=True, tooltip="Noise seed."),
            Input.float("strength", 0.5, min=0.0, max=1.0, step=0.05, round=0.01),
            Input.string("text", "hi", multiline=True, dynamic_prompts=True, placeholder="type"),
            Input.boolean("flag", True, label_on="yes", label_off="no", optional=True),
            Input.combo("mode", ["a", "b"], "b", image_upload=True, optional=True),
            Input.combo("file", lambda: ["x.png"], folder="input"),
            Input.link("image", "IMAGE", tooltip="Pixels.", lazy=True),
            Input.match_type("any", "T", allowed="IMAGE,MASK", optional=True),
            Input.hidden("uid", "UNIQUE_ID"),
            Input.hidden("prompt", "PROMPT", as_string=True),
        ], outputs=[Output("IMAGE", "picture", tooltip="The result."), Output("INT", is_list=True),
                    Output("*", "same", match_type="T")],
            display_name="All widgets", category="tests/info", description="Every widget kind.",
            output_node=True, input_is_list=True, python_module="custom_nodes.pack", deprecated=True,
            experimental=True, search_aliases=("every", "all"), has_intermediate_output=True, dev_only=True),
        NodeSpec("Dynamic", _run, inputs=[
            Input.dynamic_combo("mode", {
                "simple": [Input.int("count", 1, min=1, max=9)],
                "full": [Input.float("scale", 1.0), Input.link("mask", "MASK", optional=True)],
            }, tooltip="How."),
            Input.autogrow("values", InputSpec("value", "FLOAT,INT"), prefix="value", min=1, max=4),
            Input.autogrow("letters", Input.string("letter"), names=("a", "b", "c")),
        ], outputs=[Output("FLOAT")]),
        NodeSpec("Bare", _run),
    ]


def test_object_info_bytes_are_unchanged():
    registry = NodeRegistry()
    registry.register_all(catalogue(), origin="tests")
    assert json.dumps(object_info(registry), indent=1) + "\n" == EXPECTED.read_text()


def test_one_node_and_an_unknown_node():
    registry = NodeRegistry()
    registry.register_all(catalogue(), origin="tests")
    expected = json.loads(EXPECTED.read_text())
    assert object_info(registry, "Dynamic") == {"Dynamic": expected["Dynamic"]}
    assert object_info(registry, "Nope") == {}
    assert node_info(registry.get("Bare")) == expected["Bare"]


def test_hidden_inputs_of_comfyuis_classic_built_ins_are_bare_strings():
    from nodes.registry import builtin_registry

    registry = builtin_registry()
    for node_id in ("SaveImage", "PreviewImage", "SaveLatent"):
        assert node_info(registry.get(node_id))["input"]["hidden"] == {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}
    assert node_info(registry.get("GetImageSize"))["input"]["hidden"] == {"unique_id": ["UNIQUE_ID"]}  # newer schema
