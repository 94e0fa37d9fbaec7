"""ComfyUI's V3 node API (nodes/v3.py, nodes/compat/comfy_api): V3 classes become NodeSpecs that run
through the executor like any node, the example V3 pack runs in a workflow, the same node declared
classic and V3 shows the same /object_info entry, and unsupported V3 features are refused by name."""
from __future__ import annotations

import asyncio
from enum import Enum
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from execution.cache import make_cache
from execution.errors import PromptError
from execution.events import EventBus
from execution.scheduler import Executor
from execution.spec import NodeDefinitionError
from execution.validation import validate_prompt
from nodes import plugins
from nodes.classic import spec_from_class
from nodes.registry import builtin_registry
from nodes.spec import Input, NodeSpec, Output
from nodes.v3 import spec_from_v3_class
from web.object_info import node_info

plugins.enable_compat()
from comfy_api.latest import ComfyExtension, io, ui  # noqa: E402  (on sys.path once compat is enabled)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_V3_PACK = ROOT / "examples" / "custom_nodes" / "example_v3_pack"
EXAMPLE_PACK = ROOT / "examples" / "custom_nodes" / "example_pack"


def registry_with(*classes: type):
    """The built-in nodes plus the given V3 classes."""
    registry = builtin_registry()
    registry.register_all([spec_from_v3_class(cls, python_module="custom_nodes.tests") for cls in classes],
                          origin="tests")
    return registry


def run(registry, paths, prompt, events=None, executor=None):
    executor = executor or Executor(registry, cache=make_cache("classic"), paths=paths, events=events)
    validated = validate_prompt(prompt, registry)
    assert validated.node_errors == {}, validated.node_errors
    return executor.run(validated, prompt_id=str(uuid.uuid4()))


def int_node(node_id: str, value: int) -> dict:
    return {"class_type": "PrimitiveInt", "inputs": {"value": value}}


# ---------------------------------------------------------------------- the example V3 pack
def test_example_v3_pack_is_found_through_its_comfy_entrypoint():
    registry = builtin_registry()
    report = plugins.load_plugin(registry, EXAMPLE_V3_PACK)
    assert report.status == "loaded", report.reason
    assert report.node_ids == ("ExampleV3InvertImage", "ExampleV3LazySwitch", "ExampleV3PreviewImage",
                               "ExampleV3AdjustImage", "ExampleV3SumValues")
    for node_id in report.node_ids:
        assert node_info(registry.get(node_id))["python_module"] == "custom_nodes.example_v3_pack"
    assert registry.get("ExampleV3PreviewImage").output_node


def test_example_v3_pack_runs_in_a_workflow(paths):
    registry = builtin_registry()
    assert plugins.load_plugin(registry, EXAMPLE_V3_PACK).status == "loaded"
    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 4, "batch_size": 1, "color": 0x204060}},
        "2": {"class_type": "ExampleV3InvertImage", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "EmptyImage", "inputs": {"width": 16, "height": 16, "batch_size": 1, "color": 0}},
        "4": {"class_type": "ExampleV3LazySwitch", "inputs": {"use_first": True, "first": ["2", 0], "second": ["3", 0]}},
        "5": {"class_type": "ExampleV3AdjustImage", "inputs": {"image": ["4", 0], "mode": "threshold",
                                                             "mode.level": 0.5}},
        "6": {"class_type": "ExampleV3PreviewImage", "inputs": {"images": ["5", 0]}},
        "7": {"class_type": "PrimitiveFloat", "inputs": {"value": 1.5}},
        "8": {"class_type": "PrimitiveFloat", "inputs": {"value": 2.25}},
        "9": {"class_type": "ExampleV3SumValues", "inputs": {"values.value0": ["7", 0], "values.value1": ["8", 0]}},
        "10": {"class_type": "PreviewAny", "inputs": {"source": ["9", 0]}},
    }
    events = EventBus()
    seen = []
    events.subscribe(lambda event, data: seen.append((event, data)))
    result = run(registry, paths, prompt, events)
    assert result.status == "success", result.error
    assert "3" not in result.executed  # the lazy switch never asked for its second branch
    assert result.outputs["10"]["text"] == ["3.75"]  # the auto-grow group reached execute whole
    images = result.outputs["6"]["images"]
    assert len(images) == 1 and images[0]["type"] == "temp" and list(result.outputs["6"]["animated"]) == [False]
    written = np.asarray(Image.open(paths.temp / images[0]["subfolder"] / images[0]["filename"]))
    # 0x204060 inverted is (0xDF, 0xBF, 0x9F): every channel above the 0.5 threshold, so white
    assert written.shape == (4, 8, 3) and (written == 255).all()
    executed = [data for event, data in seen if event == "executed" and data["node"] == "6"]
    assert executed and executed[0]["output"]["images"] == images  # ui.PreviewImage reached the event


def test_example_v3_pack_brightness_mode_takes_its_own_input(paths):
    registry = builtin_registry()
    assert plugins.load_plugin(registry, EXAMPLE_V3_PACK).status == "loaded"
    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 2, "height": 2, "batch_size": 1, "color": 0x808080}},
        "2": {"class_type": "ExampleV3AdjustImage", "inputs": {"image": ["1", 0], "mode": "brightness",
                                                             "mode.factor": 0.5}},
        "3": {"class_type": "ExampleV3PreviewImage", "inputs": {"images": ["2", 0]}},
    }
    result = run(registry, paths, prompt)
    assert result.status == "success", result.error
    image = result.outputs["3"]["images"][0]
    written = np.asarray(Image.open(paths.temp / image["subfolder"] / image["filename"]))
    assert written[0, 0].tolist() == [64, 64, 64]  # 128/255 halved, written as 8 bits


def test_example_packs_declare_the_same_nodes_both_ways():
    registry = builtin_registry()
    assert plugins.load_plugin(registry, EXAMPLE_PACK).status == "loaded"
    assert plugins.load_plugin(registry, EXAMPLE_V3_PACK).status == "loaded"
    identity = ("name", "display_name", "python_module")
    for classic, v3 in (("ExampleInvertImage", "ExampleV3InvertImage"), ("ExampleLazySwitch", "ExampleV3LazySwitch")):
        classic_info = {k: v for k, v in node_info(registry.get(classic)).items() if k not in identity}
        v3_info = {k: v for k, v in node_info(registry.get(v3)).items() if k not in identity}
        assert classic_info == v3_info


# ---------------------------------------------------------------------- one node, two declarations
class TwinClassic:
    DESCRIPTION = "Every widget kind, declared the classic way."
    CATEGORY = "tests/twins"
    RETURN_TYPES = ("IMAGE", "INT")
    RETURN_NAMES = ("picture", "INT")
    OUTPUT_TOOLTIPS = ("The result.", None)
    OUTPUT_IS_LIST = (False, True)
    OUTPUT_NODE = True
    DEPRECATED = True
    SEARCH_ALIASES = ("every", "all")
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**64 - 1, "control_after_generate": True,
                                 "tooltip": "Noise seed."}),
                "strength": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 1.0, "step": 0.05, "round": 0.01,
                                       "display": "slider"}),
                "text": ("STRING", {"default": "hi", "multiline": True, "dynamicPrompts": True,
                                    "placeholder": "type"}),
                "mode": (["a", "b"], {"default": "b", "image_upload": True}),
                "image": ("IMAGE", {"tooltip": "Pixels.", "lazy": True, "display_name": "Picture"}),
                "number": ("INT,FLOAT", {}),
            },
            "optional": {
                "flag": ("BOOLEAN", {"default": True, "label_on": "yes", "label_off": "no"}),
                "any": ("COMFY_MATCHTYPE_V3", {"template": {"template_id": "T", "allowed_types": "IMAGE,MASK"}}),
            },
            "hidden": {"unique_id": ("UNIQUE_ID",), "prompt": ("PROMPT",), "extra_pnginfo": ("EXTRA_PNGINFO",)},
        }

    def run(self, **kwargs):
        return None


class TwinV3(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        template = io.MatchType.Template("T", allowed_types=[io.Image, io.Mask])
        return io.Schema(
            node_id="Twin", display_name="Twin", category="tests/twins",
            description="Every widget kind, declared the classic way.",
            inputs=[
                io.Int.Input("seed", default=0, min=0, max=2**64 - 1, control_after_generate=True,
                             tooltip="Noise seed."),
                io.Float.Input("strength", default=0.5, min=0.0, max=1.0, step=0.05, round=0.01,
                               display_mode=io.NumberDisplay.slider),
                io.String.Input("text", default="hi", multiline=True, dynamic_prompts=True, placeholder="type"),
                io.Combo.Input("mode", options=["a", "b"], default="b", upload=io.UploadType.image),
                io.Image.Input("image", tooltip="Pixels.", lazy=True, display_name="Picture"),
                io.MultiType.Input("number", types=[io.Int, io.Float]),
                io.Boolean.Input("flag", default=True, label_on="yes", label_off="no", optional=True),
                io.MatchType.Input("any", template=template, optional=True),
            ],
            outputs=[io.Image.Output(display_name="picture", tooltip="The result."),
                     io.Int.Output(is_output_list=True)],
            hidden=[io.Hidden.unique_id], is_output_node=True, is_deprecated=True, search_aliases=["every", "all"],
        )

    @classmethod
    def execute(cls, **kwargs):
        return None


def test_a_node_declared_classic_and_v3_has_one_object_info_entry():
    classic = node_info(spec_from_class("Twin", TwinClassic, python_module="custom_nodes.twins"))
    v3 = node_info(spec_from_v3_class(TwinV3, python_module="custom_nodes.twins"))
    assert v3 == classic
    assert v3["input"]["hidden"]["unique_id"] == ["UNIQUE_ID"] and v3["input"]["required"]["number"][0] == "INT,FLOAT"


class MatchV3(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        template = io.MatchType.Template("T", allowed_types=[io.Image, io.Mask])
        return io.Schema(node_id="Match", inputs=[io.MatchType.Input("any", template=template)],
                         outputs=[io.MatchType.Output(template, id="same")])

    @classmethod
    def execute(cls, any):
        return io.NodeOutput(any)


def test_match_type_outputs_name_their_template():
    info = node_info(spec_from_v3_class(MatchV3))
    assert info["output"] == ["COMFY_MATCHTYPE_V3"] and info["output_matchtypes"] == ["T"]
    assert info["input"]["required"]["any"][1]["template"] == {"template_id": "T", "allowed_types": "IMAGE,MASK"}


class DynamicV3(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="Dynamic", category="tests", inputs=[
            io.DynamicCombo.Input("mode", tooltip="How.", options=[
                io.DynamicCombo.Option("simple", [io.Int.Input("count", default=1, min=1, max=9, step=1)]),
                io.DynamicCombo.Option("full", [io.Float.Input("scale", default=1.0, min=-1e18, max=1e18, step=0.01),
                                                io.Mask.Input("mask", optional=True)]),
            ]),
            io.Autogrow.Input("images", template=io.Autogrow.TemplatePrefix(io.Image.Input("image"), "image",
                                                                             min=1, max=4)),
            io.Autogrow.Input("letters", optional=True, template=io.Autogrow.TemplateNames(
                io.String.Input("letter"), names=["a", "b", "c"], min=0)),
        ], outputs=[io.Float.Output()])

    @classmethod
    def execute(cls, **kwargs):
        return None


def test_dynamic_inputs_declared_v3_match_weft_s_own_declaration():
    weft = NodeSpec("Dynamic", lambda **kwargs: None, category="tests", python_module="custom_nodes.twins", inputs=[
        Input.dynamic_combo("mode", {
            "simple": [Input.int("count", 1, min=1, max=9)],
            "full": [Input.float("scale", 1.0), Input.link("mask", "MASK", optional=True)],
        }, tooltip="How."),
        Input.autogrow("images", Input.link("image", "IMAGE"), prefix="image", min=1, max=4),
        Input.autogrow("letters", Input.string("letter", force_input=True, default=None), names=("a", "b", "c")),
    ], outputs=[Output("FLOAT")])
    assert node_info(spec_from_v3_class(DynamicV3, python_module="custom_nodes.twins")) == node_info(weft)


# ---------------------------------------------------------------------- run-time features
CALLS: list[str] = []


class LazyPick(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3LazyPick", inputs=[
            io.Int.Input("first", lazy=True), io.Int.Input("second", lazy=True), io.Int.Input("third", lazy=True)],
            outputs=[io.Int.Output()])

    @classmethod
    def check_lazy_status(cls, first=None, second=None, third=None):
        CALLS.append(f"check first={first} second={second}")
        if first is None:
            return ["first"]  # one at a time: the next request depends on this value
        if first > 0 and second is None:
            return ["second"]
        return []

    @classmethod
    def execute(cls, first, second=None, third=None):
        return io.NodeOutput(first + (second or 0))


class Record(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Record", inputs=[io.Int.Input("value"), io.String.Input("tag")],
                         outputs=[io.Int.Output()], not_idempotent=True)

    @classmethod
    def execute(cls, value, tag):
        CALLS.append(f"run {tag}")
        return io.NodeOutput(value)


def lazy_prompt(first: int) -> dict:
    return {
        "1": {"class_type": "V3Record", "inputs": {"value": first, "tag": "first"}},
        "2": {"class_type": "V3Record", "inputs": {"value": 10, "tag": "second"}},
        "3": {"class_type": "V3Record", "inputs": {"value": 100, "tag": "third"}},
        "4": {"class_type": "V3LazyPick", "inputs": {"first": ["1", 0], "second": ["2", 0], "third": ["3", 0]}},
        "5": {"class_type": "PreviewAny", "inputs": {"source": ["4", 0]}},
    }


def test_lazy_inputs_are_evaluated_in_the_order_check_lazy_status_asks(paths):
    registry = registry_with(LazyPick, Record)
    CALLS.clear()
    result = run(registry, paths, lazy_prompt(1))
    assert result.status == "success", result.error
    assert result.outputs["5"]["text"] == ["11"]
    assert CALLS == ["check first=None second=None", "run first", "check first=1 second=None", "run second",
                     "check first=1 second=10"]
    CALLS.clear()
    result = run(registry, paths, lazy_prompt(0))
    assert result.outputs["5"]["text"] == ["0"] and "run second" not in CALLS and "run third" not in CALLS


class LazyDefault(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3LazyDefault", inputs=[io.Int.Input("a", lazy=True), io.Int.Input("b", lazy=True)],
                         outputs=[io.Int.Output()])

    @classmethod
    def execute(cls, a, b):
        return io.NodeOutput(a * b)


def test_lazy_inputs_without_check_lazy_status_are_all_evaluated(paths):
    registry = registry_with(LazyDefault)
    prompt = {"1": int_node("1", 6), "2": int_node("2", 7),
              "3": {"class_type": "V3LazyDefault", "inputs": {"a": ["1", 0], "b": ["2", 0]}},
              "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}}}
    assert run(registry, paths, prompt).outputs["4"]["text"] == ["42"]


STAMP = {"value": "one"}


class Stamped(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Stamped", inputs=[io.Int.Input("value")], outputs=[io.Int.Output()])

    @classmethod
    def fingerprint_inputs(cls, value):
        return f"{STAMP['value']}:{value}"

    @classmethod
    def execute(cls, value):
        CALLS.append("stamped")
        return io.NodeOutput(value)


def test_fingerprint_inputs_decides_when_a_cached_node_runs_again(paths):
    registry = registry_with(Stamped)
    executor = Executor(registry, cache=make_cache("classic"), paths=paths)
    prompt = {"1": {"class_type": "V3Stamped", "inputs": {"value": 3}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    CALLS.clear()
    STAMP["value"] = "one"
    run(registry, paths, prompt, executor=executor)
    run(registry, paths, prompt, executor=executor)
    assert CALLS == ["stamped"]  # same fingerprint: the cached output served
    STAMP["value"] = "two"
    assert "1" in run(registry, paths, prompt, executor=executor).executed and CALLS == ["stamped", "stamped"]


class Even(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Even", inputs=[io.Int.Input("value"), io.Int.Input("other", default=0)],
                         outputs=[io.Int.Output()])

    @classmethod
    def validate_inputs(cls, value):
        return True if value % 2 == 0 else "must be even"

    @classmethod
    def execute(cls, value, other=0):
        return io.NodeOutput(value)


class Raising(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Raising", inputs=[io.Int.Input("value")], outputs=[io.Int.Output()])

    @classmethod
    def validate_inputs(cls, **kwargs):
        raise ValueError("no value is good")

    @classmethod
    def execute(cls, value):
        return io.NodeOutput(value)


def test_validate_inputs_failures_have_comfyui_s_custom_validation_shape():
    registry = registry_with(Even, Raising)
    ok = validate_prompt({"1": {"class_type": "V3Even", "inputs": {"value": 4, "other": 5}},
                          "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}, registry)
    assert ok.node_errors == {}
    bad = node_errors(registry, {"1": {"class_type": "V3Even", "inputs": {"value": 3, "other": 5}},
                                 "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert [(e["type"], e["message"], e["details"], e["extra_info"]["input_name"]) for e in bad["1"]["errors"]] == [
        ("custom_validation_failed", "The node's own input check refused this prompt", "value - must be even", "value")]
    raised = node_errors(registry, {"1": {"class_type": "V3Raising", "inputs": {"value": 3}},
                                    "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    error = raised["1"]["errors"][0]
    assert error["type"] == "exception_during_validation" and "no value is good" in error["details"]


def node_errors(registry, prompt) -> dict:
    """The node_errors a prompt is refused with."""
    with pytest.raises(PromptError) as refused:
        validate_prompt(prompt, registry)
    return refused.value.node_errors


class HiddenReader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Hidden", inputs=[io.String.Input("label")], outputs=[io.String.Output()],
                         hidden=[io.Hidden.unique_id, io.Hidden.prompt, io.Hidden.extra_pnginfo])

    @classmethod
    def execute(cls, label):  # hidden values are not arguments: they are on cls.hidden
        hidden = cls.hidden
        return io.NodeOutput(f"{label} {hidden.unique_id} {sorted(hidden.prompt)} {hidden.extra_pnginfo['workflow']} "
                             f"{hidden.dynprompt}")


def test_hidden_inputs_reach_the_node_on_cls_hidden(paths):
    registry = registry_with(HiddenReader)
    prompt = {"7": {"class_type": "V3Hidden", "inputs": {"label": "x"}},
              "8": {"class_type": "PreviewAny", "inputs": {"source": ["7", 0]}}}
    executor = Executor(registry, cache=make_cache("classic"), paths=paths)
    validated = validate_prompt(prompt, registry)
    result = executor.run(validated, prompt_id="p", extra_data={"extra_pnginfo": {"workflow": "W"}})
    assert result.status == "success", result.error
    assert result.outputs["8"]["text"] == ["x 7 ['7', '8'] W None"]  # dynprompt was not asked for
    assert HiddenReader.hidden is None  # each call runs on its own subclass; the node's class is left alone


class TakesEverything(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3TakesAll", inputs=[io.Int.Input("x")], outputs=[io.String.Output()],
                         accept_all_inputs=True)

    @classmethod
    def execute(cls, x, **rest):
        return io.NodeOutput(f"{x} {sorted(rest.items())}")


def test_accept_all_inputs_gives_the_node_every_input_of_its_prompt_entry(paths):
    registry = registry_with(TakesEverything)
    prompt = {"1": int_node("1", 4),
              "7": {"class_type": "V3TakesAll", "inputs": {"x": 2, "crf": 30, "linked": ["1", 0]}},
              "8": {"class_type": "PreviewAny", "inputs": {"source": ["7", 0]}}}
    result = run(registry, paths, prompt)
    assert result.status == "success", result.error
    assert result.outputs["8"]["text"] == ["2 [('crf', 30), ('linked', 4)]"]


class Shows(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Shows", inputs=[io.String.Input("text")], is_output_node=True)

    @classmethod
    async def execute(cls, text):  # async execute is awaited like any async node
        await asyncio.sleep(0)
        return io.NodeOutput(ui=ui.PreviewText(text.upper()))


def test_node_output_ui_reaches_the_executed_event(paths):
    registry = registry_with(Shows)
    events = EventBus()
    seen = []
    events.subscribe(lambda event, data: seen.append((event, data)))
    result = run(registry, paths, {"1": {"class_type": "V3Shows", "inputs": {"text": "hello"}}}, events)
    assert list(result.outputs["1"]["text"]) == ["HELLO"]
    assert [list(data["output"]["text"]) for event, data in seen if event == "executed"] == [["HELLO"]]


class Expands(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Expands", inputs=[io.Int.Input("value")], outputs=[io.Int.Output()],
                         enable_expand=True)

    @classmethod
    def execute(cls, value):
        graph = {"double": {"class_type": "ComfyMathExpression",
                            "inputs": {"expression": "a * 2", "values.a": value}}}
        return io.NodeOutput(["double", 1], expand=graph)


class ExpandsUndeclared(Expands):
    @classmethod
    def define_schema(cls):
        schema = super().define_schema()
        schema.node_id, schema.enable_expand = "V3ExpandsUndeclared", False
        return schema


def test_node_output_expand_runs_the_returned_graph(paths):
    registry = registry_with(Expands, ExpandsUndeclared)
    result = run(registry, paths, {"1": {"class_type": "V3Expands", "inputs": {"value": 21}},
                                   "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert result.status == "success", result.error
    assert result.outputs["2"]["text"] == ["42"]
    refused = run(registry, paths, {"1": {"class_type": "V3ExpandsUndeclared", "inputs": {"value": 21}},
                                    "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert refused.status == "error" and "enable_expand=True" in refused.error["exception_message"]


class BuildsGraph(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3BuildsGraph", inputs=[io.Int.Input("value")], outputs=[io.Int.Output()],
                         enable_expand=True)

    @classmethod
    def execute(cls, value):
        from comfy_execution.graph_utils import GraphBuilder

        graph = GraphBuilder()
        plus_one = graph.node("ComfyMathExpression", expression="a + 1", **{"values.a": value})
        times_ten = graph.node("ComfyMathExpression", expression="a * 10", **{"values.a": plus_one.out(1)})
        return io.NodeOutput(times_ten.out(1), expand=graph.finalize())


def test_a_graph_builder_expansion_runs_its_chain(paths):
    registry = registry_with(BuildsGraph)
    result = run(registry, paths, {"1": {"class_type": "V3BuildsGraph", "inputs": {"value": 21}},
                                   "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert result.status == "success", result.error
    assert result.outputs["2"]["text"] == ["220"]


class Blocks(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Blocks", inputs=[io.Int.Input("value")], outputs=[io.Int.Output()])

    @classmethod
    def execute(cls, value):
        return io.NodeOutput(block_execution="value is blocked")


class BlocksSilently(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3BlocksSilently", inputs=[io.Int.Input("value")], outputs=[io.Int.Output()])

    @classmethod
    def execute(cls, value):
        from comfy_execution.graph_utils import ExecutionBlocker

        return ExecutionBlocker(None)


def test_block_execution_stops_the_branch(paths):
    registry = registry_with(Blocks, BlocksSilently)
    result = run(registry, paths, {"1": {"class_type": "V3Blocks", "inputs": {"value": 1}},
                                   "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert result.status == "error" and "value is blocked" in result.error["exception_message"]
    silent = run(registry, paths, {"1": {"class_type": "V3BlocksSilently", "inputs": {"value": 1}},
                                   "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert silent.status == "success" and "2" not in silent.outputs  # the branch is skipped without an error


# ---------------------------------------------------------------------- discovery and refusals
def write_pack(folder: Path, name: str, source: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(source)
    return path


PACK_HEAD = '''
from comfy_api.{version} import ComfyExtension, io

class Node(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="{node_id}", inputs=[io.Int.Input("x")], outputs=[io.Int.Output()]{flags})

    @classmethod
    def execute(cls, x):
        return io.NodeOutput(x)
'''


def test_comfy_extension_discovery_sync_and_async_and_versioned(tmp_path):
    registry = builtin_registry()
    async_pack = PACK_HEAD.format(version="latest", node_id="V3Async", flags="") + '''
LOADED = []

class Extension(ComfyExtension):
    async def on_load(self):
        LOADED.append("on_load")

    async def get_node_list(self):
        LOADED.append("get_node_list")
        return [Node]

async def comfy_entrypoint():
    return Extension()
'''
    sync_pack = PACK_HEAD.format(version="v0_0_2", node_id="V3Sync", flags="") + '''
class Extension(ComfyExtension):
    async def get_node_list(self):
        return [Node]

def comfy_entrypoint():
    return Extension()
'''
    mapped_pack = PACK_HEAD.format(version="v0_0_3", node_id="IgnoredId", flags="") + '''
NODE_CLASS_MAPPINGS = {"V3Mapped": Node}
NODE_DISPLAY_NAME_MAPPINGS = {"V3Mapped": "Mapped (V3)"}

def comfy_entrypoint():  # ComfyUI reads the mappings first and never calls this
    raise RuntimeError("not called")
'''
    reports = {name: plugins.load_plugin(registry, write_pack(tmp_path, name, source))
               for name, source in (("v3_async", async_pack), ("v3_sync", sync_pack), ("v3_mapped", mapped_pack))}
    assert {name: (r.status, r.reason, r.node_ids) for name, r in reports.items()} == {
        "v3_async": ("loaded", "", ("V3Async",)), "v3_sync": ("loaded", "", ("V3Sync",)),
        "v3_mapped": ("loaded", "", ("V3Mapped",))}
    import custom_nodes.v3_async as loaded  # noqa: E402  (registered by the loader)
    assert loaded.LOADED == ["on_load", "get_node_list"]
    assert node_info(registry.get("V3Mapped"))["display_name"] == "Mapped (V3)"


BROKEN_V3 = {
    "api_node": (PACK_HEAD.format(version="latest", node_id="V3Api", flags=", is_api_node=True")
                 + "NODE_CLASS_MAPPINGS = {'V3Api': Node}\n",
                 "node 'V3Api': Schema.is_api_node: not supported: API nodes call a remote service"),
    "dynamic_slot": ('''
from comfy_api.latest import io

class Node(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Slot", inputs=[io.DynamicSlot.Input(io.Image.Input("a"), [])])

    @classmethod
    def execute(cls, **kwargs):
        return None

NODE_CLASS_MAPPINGS = {"V3Slot": Node}
''', "node 'V3Slot': define_schema() raised AttributeError: comfy_api io.DynamicSlot is not provided by Weft"),
    "async_validate": (PACK_HEAD.format(version="latest", node_id="V3AsyncCheck", flags="") + '''
    @classmethod
    async def validate_inputs(cls, x):
        return True

NODE_CLASS_MAPPINGS = {"V3AsyncCheck": Node}
''', "node 'V3AsyncCheck': validate_inputs: is async"),
    "not_extension": ("async def comfy_entrypoint():\n    return [1]\n",
                      "comfy_entrypoint() returned list, not a comfy_api ComfyExtension"),
    "bad_node_list": (PACK_HEAD.format(version="latest", node_id="V3List", flags="") + '''
class Extension(ComfyExtension):
    async def get_node_list(self):
        return [Node, object]

async def comfy_entrypoint():
    return Extension()
''', "get_node_list() item 1 is <class 'object'>, not a comfy_api io.ComfyNode class"),
}


def test_unsupported_v3_features_are_refused_naming_the_node_and_feature(tmp_path):
    registry = builtin_registry()
    for name, (source, fragment) in BROKEN_V3.items():
        report = plugins.load_plugin(registry, write_pack(tmp_path, name, source))
        assert report.status == "failed" and fragment in report.reason, (name, report.reason)


def test_an_option_key_weft_does_not_know_passes_through_as_in_comfyui(tmp_path):
    source = '''
from comfy_api.latest import io

class Node(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3ExtraOption", inputs=[io.Int.Input("x", extra_dict={"frobnicate": 1})])

    @classmethod
    def execute(cls, x):
        return None

NODE_CLASS_MAPPINGS = {"V3ExtraOption": Node}
'''
    registry = builtin_registry()
    report = plugins.load_plugin(registry, write_pack(tmp_path, "extra_option", source))
    assert report.status == "loaded", report.reason
    assert registry.get("V3ExtraOption").input("x").options["frobnicate"] == 1


def test_schema_declaration_errors_name_the_node():
    class Twice(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id="V3Twice", inputs=[io.Int.Input("x"), io.Float.Input("x")])

        @classmethod
        def execute(cls, x):
            return None

    class NoSchema(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return {"node_id": "V3Dict"}

        @classmethod
        def execute(cls):
            return None

    with pytest.raises(NodeDefinitionError, match=r"node 'V3Twice': schema: input ids must be unique, repeated: \['x'\]"):
        spec_from_v3_class(Twice)
    with pytest.raises(NodeDefinitionError, match="node 'NoSchema': define_schema\\(\\): must return an io.Schema"):
        spec_from_v3_class(NoSchema)


# ---------------------------------------------------------------------- results and ui helpers
class Saves(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Saves", inputs=[io.Image.Input("images"), io.Mask.Input("mask"),
                                                     io.Audio.Input("audio")], is_output_node=True)

    @classmethod
    def execute(cls, images, mask, audio):
        saved = ui.ImageSaveHelper.get_save_images_ui(images, "v3/saved", cls=cls).as_dict()
        shown = {**saved, **{f"mask_{k}": v for k, v in ui.PreviewMask(mask, cls=cls).as_dict().items()},
                 **ui.PreviewAudio(audio, cls=cls).as_dict()}
        return {"ui": shown, "result": ()}  # a classic result dict is accepted too


def test_ui_helpers_write_previews_and_saves_with_the_run_s_metadata(paths, ctx):
    spec = spec_from_v3_class(Saves)
    images = torch.full((2, 3, 4, 3), 0.25)
    mask = torch.ones(1, 3, 4)
    audio = {"waveform": torch.zeros(1, 1, 800), "sample_rate": 8000}
    out = spec.execute(images=images, mask=mask, audio=audio, prompt={"1": {"class_type": "V3Saves"}},
                       extra_pnginfo={"workflow": {"nodes": []}})
    assert [entry["type"] for entry in out.ui["images"]] == ["output", "output"]
    first = out.ui["images"][0]
    assert first["subfolder"] == "v3" and first["filename"].startswith("saved_")
    with Image.open(ctx.paths.output / "v3" / first["filename"]) as saved:
        assert saved.size == (4, 3) and saved.text["prompt"] == '{"1": {"class_type": "V3Saves"}}'
        assert saved.text["workflow"] == '{"nodes": []}'
    mask_file = out.ui["mask_images"][0]
    with Image.open(ctx.paths.temp / mask_file["subfolder"] / mask_file["filename"]) as preview:
        assert np.asarray(preview).min() == 255  # a full mask shows white
    assert out.ui["audio"][0]["type"] == "temp" and out.ui["audio"][0]["filename"].endswith(".flac")
    # The sound check runs on sound a pack writes too: this all-zero clip is silent.
    (health,) = out.ui["audio_health"]
    assert health["file"].endswith(out.ui["audio"][0]["filename"]) and health["silent"] and not health["healthy"]


class Returns(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Returns", inputs=[io.Combo.Input("shape", options=["tuple", "output", "dict"])],
                         outputs=[io.Int.Output(), io.String.Output()])

    @classmethod
    def execute(cls, shape):
        if shape == "tuple":
            return 1, "a"
        if shape == "output":
            return io.NodeOutput(1, "a")
        return {"result": (1, "a"), "ui": ui.PreviewText("shown")}


def test_every_v3_result_shape_gives_the_same_values():
    spec = spec_from_v3_class(Returns)
    assert spec.execute(shape="tuple") == (1, "a")
    assert spec.execute(shape="output").values == (1, "a")
    from_dict = spec.execute(shape="dict")
    assert from_dict.values == (1, "a") and from_dict.ui == {"text": ("shown",)}


class Colour(Enum):
    red = "red"
    green = "green"


class Choices(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Choices", inputs=[
            io.Combo.Input("colour", options=Colour, default=Colour.green),
            io.MultiCombo.Input("tags", options=["x", "y", "z"], default=["x"]),
        ], outputs=[io.String.Output()])

    @classmethod
    def execute(cls, colour, tags):
        return io.NodeOutput(f"{colour}:{'+'.join(tags)}")


def test_enum_and_multiselect_combos(paths):
    info = node_info(spec_from_v3_class(Choices))["input"]["required"]
    assert info["colour"] == [["red", "green"], {"default": "green"}]
    assert info["tags"] == [["x", "y", "z"], {"default": ["x"], "multiselect": True}]
    registry = registry_with(Choices)
    result = run(registry, paths, {"1": {"class_type": "V3Choices", "inputs": {"colour": "red", "tags": {"__value__": ["y", "z"]}}},
                                   "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert result.outputs["2"]["text"] == ["red:y+z"]
    with pytest.raises(PromptError):
        validate_prompt({"1": {"class_type": "V3Choices", "inputs": {"colour": "blue", "tags": ["x"]}},
                         "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}, registry)


def test_unsupported_io_names_say_so():
    with pytest.raises(AttributeError, match="io.DynamicSlot is not provided by Weft"):
        io.DynamicSlot
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchType'"):
        io.NoSuchType


class Progresses(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="V3Progresses", inputs=[io.Int.Input("steps")], outputs=[io.Int.Output()],
                         hidden=[io.Hidden.unique_id])

    @classmethod
    async def execute(cls, steps):
        from comfy_api.latest import ComfyAPI, ComfyAPISync

        api, sync = ComfyAPI(), ComfyAPISync()
        for step in range(1, steps):
            await api.execution.set_progress(step, steps)
        sync.execution.set_progress(steps, steps, node_id=cls.hidden.unique_id,
                                    preview_image=torch.zeros(1, 4, 4, 3), ignore_size_limit=True)
        with pytest.raises(ValueError, match="not the running node"):
            sync.execution.set_progress(1, 1, node_id="elsewhere")
        return io.NodeOutput(steps)


def test_comfy_api_set_progress_reports_the_running_node(paths):
    registry = registry_with(Progresses)
    events = EventBus()
    seen = []
    events.subscribe(lambda event, data: seen.append((event, data)))
    result = run(registry, paths, {"5": {"class_type": "V3Progresses", "inputs": {"steps": 3}},
                                   "6": {"class_type": "PreviewAny", "inputs": {"source": ["5", 0]}}}, events)
    assert result.status == "success", result.error
    steps = [(data["value"], data["max"]) for event, data in seen if event == "progress" and data["node"] == "5"]
    assert steps[:3] == [(1, 3), (2, 3), (3, 3)]
    previews = [data for event, data in seen if event == "preview" and data["node"] == "5"]
    assert len(previews) == 1 and previews[0]["image"][0] == "JPEG" and previews[0]["image"][2] == 4
