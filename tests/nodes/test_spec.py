"""NodeSpec, the registry and the classic adapter: registration checks and /object_info."""
from __future__ import annotations

import json

import pytest

from nodes.classic import spec_from_class, specs_from_mappings
from nodes.registry import NodeRegistry, builtin_registry
from nodes.spec import Input, InputSpec, NodeDefinitionError, NodeSpec, Output
from web.object_info import node_info, object_info

OBJECT_INFO_FIELDS = {
    "input", "input_order", "is_input_list", "output", "output_is_list", "output_name", "output_tooltips",
    "output_matchtypes", "name", "display_name", "description", "python_module", "category", "output_node",
    "deprecated", "experimental", "dev_only", "api_node", "price_badge", "search_aliases", "essentials_category",
    "has_intermediate_output",
}


def test_duplicate_id_is_refused_naming_both():
    registry = NodeRegistry()
    registry.register(NodeSpec("Dup", lambda: ()))
    with pytest.raises(NodeDefinitionError, match="'Dup'.*already registered by built-in"):
        registry.register(NodeSpec("Dup", lambda: ()), origin="pack_b")


def test_default_outside_bounds_is_refused():
    with pytest.raises(NodeDefinitionError, match="node 'Bad': input 'steps': default 0 is below its min 1"):
        NodeSpec("Bad", lambda steps: (steps,), inputs=[Input.int("steps", 0, min=1, max=10)], outputs=[Output("INT")])
    with pytest.raises(NodeDefinitionError, match="above its max"):
        NodeSpec("Bad", lambda x: (x,), inputs=[Input.float("x", 2.0, min=0.0, max=1.0)], outputs=[Output("FLOAT")])


def test_default_outside_choices_is_refused():
    with pytest.raises(NodeDefinitionError, match="node 'Bad': input 'mode': default 'c' is not among its choices"):
        NodeSpec("Bad", lambda mode: (mode,), inputs=[Input.combo("mode", ["a", "b"], "c")], outputs=[Output("STRING")])


def test_unknown_flag_and_unknown_option_are_refused():
    with pytest.raises(TypeError):
        NodeSpec("Bad", lambda: (), output_nodee=True)  # a misspelt flag
    with pytest.raises(NodeDefinitionError, match="node 'Bad': input 'x': unknown option"):
        NodeSpec("Bad", lambda x: (x,), inputs=[InputSpec("x", "INT", "required", {"defualt": 1})],
                 outputs=[Output("INT")])
    with pytest.raises(NodeDefinitionError, match="unknown hidden value"):
        NodeSpec("Bad", lambda x: (), inputs=[Input.hidden("x", "NOT_A_HIDDEN_VALUE")])


def test_classic_adapter_reads_every_field():
    class Classic:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"image": ("IMAGE",), "mode": (["fast", "slow"], {"default": "slow"})},
                    "optional": {"strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 2.0})},
                    "hidden": {"unique_id": "UNIQUE_ID", "prompt": ("PROMPT",)}}

        RETURN_TYPES = ("IMAGE", "INT")
        RETURN_NAMES = ("picture", "count")
        OUTPUT_TOOLTIPS = ("the image", "how many")
        OUTPUT_IS_LIST = (False, True)
        FUNCTION = "go"
        CATEGORY = "tests/classic"
        DESCRIPTION = "A classic node."
        OUTPUT_NODE = True
        INPUT_IS_LIST = False
        NOT_IDEMPOTENT = True

        def go(self, image, mode, strength=1.0, unique_id=None):
            return (image, [1, 2])

    spec = spec_from_class("Classic", Classic, python_module="custom_nodes.pack")
    info = node_info(spec)
    assert OBJECT_INFO_FIELDS <= set(info)
    assert info["input"]["required"]["mode"] == [["fast", "slow"], {"default": "slow"}]
    # Shown as declared, as ComfyUI shows a classic node's: a bare string, or a one-element list.
    assert info["input"]["hidden"] == {"unique_id": "UNIQUE_ID", "prompt": ["PROMPT"]}
    assert info["input_order"] == {"required": ["image", "mode"], "optional": ["strength"],
                                   "hidden": ["unique_id", "prompt"]}
    assert info["output"] == ["IMAGE", "INT"] and info["output_name"] == ["picture", "count"]
    assert info["output_is_list"] == [False, True] and info["output_tooltips"] == ["the image", "how many"]
    assert info["python_module"] == "custom_nodes.pack" and info["output_node"] is True
    assert spec.not_idempotent and spec.category == "tests/classic" and spec.description == "A classic node."


def test_classic_adapter_refusals_name_node_and_field():
    class NoFunction:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {}}

        RETURN_TYPES = ()
        FUNCTION = "missing"

    with pytest.raises(NodeDefinitionError, match="node 'NoFunction': FUNCTION"):
        spec_from_class("NoFunction", NoFunction)

    class Raises:
        @classmethod
        def INPUT_TYPES(cls):
            raise RuntimeError("broken pack")

    with pytest.raises(NodeDefinitionError, match="node 'Raises': INPUT_TYPES raised RuntimeError: broken pack"):
        spec_from_class("Raises", Raises)

    class BadSection:
        @classmethod
        def INPUT_TYPES(cls):
            return {"requird": {}}

        FUNCTION = "f"

        def f(self):
            return ()

    with pytest.raises(NodeDefinitionError, match="unknown section"):
        spec_from_class("BadSection", BadSection)


def test_dynamic_inputs_in_object_info():
    spec = NodeSpec("Dyn", lambda mode, group: (), inputs=[
        Input.dynamic_combo("mode", {"simple": [Input.int("n", 4, min=0)], "For": [Input.int("step", 1, min=1)]}),
        Input.autogrow("group", Input.link("item", "*"), prefix="item_", max=3),
    ])
    info = node_info(spec)
    mode = info["input"]["required"]["mode"]
    assert mode[0] == "COMFY_DYNAMICCOMBO_V3"
    assert [o["key"] for o in mode[1]["options"]] == ["simple", "For"]
    assert mode[1]["options"][0]["inputs"]["required"]["n"][0] == "INT"
    group = info["input"]["optional"]["group"]
    assert group[0] == "COMFY_AUTOGROW_V3" and group[1]["template"]["prefix"] == "item_" and group[1]["template"]["max"] == 3
    flat = spec.instance_inputs({"mode": "For"})
    assert "mode.step" in flat and "mode.n" not in flat and "group.item_2" in flat
    args = spec.group_arguments({"mode": "For", "mode.step": 2, "group.item_1": "b", "group.item_0": "a"})
    assert args == {"mode": {"mode": "For", "step": 2}, "group": {"item_0": "a", "item_1": "b"}}
    assert spec.normalize_input_names({"item_0": 1}) == {"group.item_0": 1}


def test_builtin_object_info_is_json_with_big_integers():
    info = object_info(builtin_registry())
    text = json.dumps(info)
    assert "9223372036854775807" in text
    for name, entry in info.items():
        assert OBJECT_INFO_FIELDS <= set(entry), name


def test_specs_from_mappings_uses_display_names():
    import tests.nodes_pack as pack

    specs = specs_from_mappings(pack.NODE_CLASS_MAPPINGS, pack.NODE_DISPLAY_NAME_MAPPINGS, python_module="p")
    names = {s.node_id: s.display_name for s in specs}
    assert names["TestOutput"] == "Test Output" and names["TestAdd"] == "TestAdd"
