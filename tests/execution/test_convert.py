"""UI workflow -> API prompt conversion (execution/convert.py), on hand-written UI files for core-style
nodes and on the two official MiniMax-H3 templates."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from execution.convert import is_ui_workflow, ui_to_api
from execution.errors import PromptError
from nodes.registry import NodeRegistry
from nodes.spec import Input, InputSpec, NodeSpec, Output
from tests.official_templates import official_template

HERE = Path(__file__).parent / "ui_workflows"
REPO = Path(__file__).resolve().parents[2]


def _noop(**kwargs):
    return None


def _spec(node_id: str, inputs, outputs, **kw) -> NodeSpec:
    return NodeSpec(node_id, _noop, inputs=inputs, outputs=outputs, **kw)


UPSCALE = ["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]
MAX_RES = 16384


def core_specs() -> list[NodeSpec]:
    """Stand-ins declaring the real ComfyUI inputs of the core nodes (the real packs live in nodes/)."""
    return [
        _spec("PrimitiveInt", [Input.int("value", 0, control_after_generate=True)], [Output("INT")]),
        _spec("PrimitiveFloat", [Input.float("value", 0.0)], [Output("FLOAT")]),
        _spec("PrimitiveString", [Input.string("value")], [Output("STRING")]),
        _spec("PrimitiveStringMultiline", [Input.string("value", multiline=True)], [Output("STRING")]),
        _spec("PrimitiveBoolean", [Input.boolean("value")], [Output("BOOLEAN")]),
        _spec("PreviewAny", [Input.link("source", "*")], [], output_node=True),
        _spec("ComfyMathExpression", [
            Input.string("expression", "a", multiline=True),
            # ComfyUI names these slots a, b, c...; the stand-in only needs the group to exist.
            Input.autogrow("values", InputSpec("value", "FLOAT,INT,BOOLEAN"), prefix="", min=0, max=26),
        ], [Output("FLOAT"), Output("INT"), Output("BOOLEAN", "BOOL")]),
        _spec("ComfySwitchNode", [
            Input.boolean("switch"),
            Input.match_type("on_false", "switch", optional=True, lazy=True),
            Input.match_type("on_true", "switch", optional=True, lazy=True),
        ], [Output("*", "output", match_type="switch")]),
        _spec("LoadImage", [Input.combo("image", ["cat.png", "red_superboy_on_city_roof.png",
                                                  "mecha_dragon_lightning.png"], image_upload=True)],
              [Output("IMAGE"), Output("MASK")]),
        _spec("SaveImage", [Input.link("images", "IMAGE"), Input.string("filename_prefix", "ComfyUI")], [],
              output_node=True),
        _spec("PreviewImage", [Input.link("images", "IMAGE")], [], output_node=True),
        _spec("EmptyImage", [
            Input.int("width", 512, min=1, max=MAX_RES), Input.int("height", 512, min=1, max=MAX_RES),
            Input.int("batch_size", 1, min=1, max=4096), Input.int("color", 0, min=0, max=0xFFFFFF, display="color"),
        ], [Output("IMAGE")]),
        _spec("ImageScale", [
            Input.link("image", "IMAGE"), Input.combo("upscale_method", UPSCALE, "nearest-exact"),
            Input.int("width", 512, min=0, max=MAX_RES), Input.int("height", 512, min=0, max=MAX_RES),
            Input.combo("crop", ["disabled", "center"], "disabled"),
        ], [Output("IMAGE")]),
        _spec("ImageScaleToTotalPixels", [
            Input.link("image", "IMAGE"), Input.combo("upscale_method", UPSCALE, "nearest-exact"),
            Input.float("megapixels", 1.0, min=0.01, max=16.0),
        ], [Output("IMAGE")]),
        _spec("GetImageSize", [Input.link("image", "IMAGE")],
              [Output("INT", "width"), Output("INT", "height"), Output("INT", "batch_size")]),
    ]


def probe_specs() -> list[NodeSpec]:
    """Test-only nodes for the widget-order rules the core nodes do not exercise."""
    return [
        # An INT named seed gets the editor's control value even without control_after_generate.
        _spec("SeedProbe", [Input.int("seed", 0), Input.string("text")], [Output("INT")]),
        # An optional widget declared first still comes after the required ones in the editor.
        _spec("OrderProbe", [Input.string("note", optional=True), Input.int("count", 1)], [Output("INT")]),
        _spec("LoopProbe", [
            Input.dynamic_combo("mode", {
                "fixed": [Input.int("num_iterations", 3)],
                "until": [Input.float("threshold", 0.5), Input.int("max_iterations", 10)],
            }),
            Input.string("label"),
        ], [Output("INT")]),
        # An upload combo is followed by the upload button's saved value.
        _spec("UploadProbe", [Input.combo("image", ["cat.png"], image_upload=True), Input.float("strength", 1.0)],
              [Output("IMAGE")]),
        # Two inputs of one type: a bypass prefers the input at the output's own slot index.
        _spec("PairProbe", [Input.link("a", "IMAGE"), Input.link("b", "IMAGE")],
              [Output("IMAGE"), Output("IMAGE")]),
        _spec("TagProbe", [InputSpec("tags", "COMBO", options={"multiselect": True}, choices=["a", "b", "c"])],
              [Output("STRING")]),
    ]


def h3_specs() -> list[NodeSpec]:
    """Stand-ins for the other nodes of the MiniMax-H3 templates, with ComfyUI's inputs."""
    aspect = ["1:1 (Square)", "3:2 (Photo)", "4:3 (Standard)", "16:9 (Widescreen)", "21:9 (Ultrawide)",
              "2:3 (Portrait Photo)", "3:4 (Portrait Standard)", "9:16 (Portrait Widescreen)"]
    length_tip = "Frame count at 24 fps"
    return [
        _spec("SaveVideo", [
            Input.link("video", "VIDEO"), Input.string("filename_prefix", "video/ComfyUI"),
            Input.combo("format", ["auto", "mp4"], "auto"), Input.combo("codec", ["auto", "h264"], "auto"),
        ], [], output_node=True),
        _spec("ResolutionSelector", [
            Input.combo("aspect_ratio", aspect, "1:1 (Square)"),
            Input.float("megapixels", 1.0, min=0.1, max=16.0, step=0.1),
            Input.int("multiple", 8, min=8, max=128, step=4),
        ], [Output("INT", "width"), Output("INT", "height")]),
        _spec("VAELoader", [Input.combo("vae_name", ["minimax_h3_video_vae_int8_convrot.safetensors",
                                                     "minimax_h3_audio_vae_fp32.safetensors"])], [Output("VAE")]),
        _spec("VAEDecodeAudio", [Input.link("samples", "LATENT"), Input.link("vae", "VAE")], [Output("AUDIO")]),
        _spec("VAEDecode", [Input.link("samples", "LATENT"), Input.link("vae", "VAE")], [Output("IMAGE")]),
        _spec("KSamplerSelect", [Input.combo("sampler_name", ["euler", "res_multistep"])], [Output("SAMPLER")]),
        _spec("BasicScheduler", [
            Input.link("model", "MODEL"), Input.combo("scheduler", ["simple", "normal", "beta"], "simple"),
            Input.int("steps", 20, min=1, max=10000), Input.float("denoise", 1.0, min=0.0, max=1.0),
        ], [Output("SIGMAS")]),
        _spec("SamplerCustomAdvanced", [
            Input.link("noise", "NOISE"), Input.link("guider", "GUIDER"), Input.link("sampler", "SAMPLER"),
            Input.link("sigmas", "SIGMAS"), Input.link("latent_image", "LATENT"),
        ], [Output("LATENT", "output"), Output("LATENT", "denoised_output")]),
        _spec("BasicGuider", [Input.link("model", "MODEL"), Input.link("conditioning", "CONDITIONING")],
              [Output("GUIDER")]),
        _spec("UNETLoader", [
            Input.combo("unet_name", ["minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                                      "minimax_h3_ref2va_pruned_int8_convrot.safetensors"]),
            Input.combo("weight_dtype", ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"], "default"),
        ], [Output("MODEL")]),
        _spec("CLIPLoader", [
            Input.combo("clip_name", ["qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"]),
            Input.combo("type", ["stable_diffusion", "minimax"], "stable_diffusion"),
            Input.combo("device", ["default", "cpu"], "default", optional=True),
        ], [Output("CLIP")]),
        _spec("RandomNoise", [Input.int("noise_seed", 0, min=0, max=2**64 - 1, control_after_generate=True)],
              [Output("NOISE")]),
        _spec("CreateVideo", [
            Input.link("images", "IMAGE"), Input.float("fps", 30.0, min=1.0, max=120.0, step=1.0),
            Input.link("audio", "AUDIO", optional=True),
            Input.int("bit_depth", 8, min=8, max=10, step=2, optional=True),
        ], [Output("VIDEO")]),
        _spec("LoraLoaderModelOnly", [
            Input.link("model", "MODEL"),
            Input.combo("lora_name", ["minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors",
                                      "minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors"]),
            Input.float("strength_model", 1.0, min=-100.0, max=100.0),
        ], [Output("MODEL")]),
        _spec("MiniMaxH3ImageToVideo", [
            Input.link("clip", "CLIP"), Input.link("vae", "VAE"), Input.string("prompt", multiline=True),
            Input.int("width", 1344, min=32, max=MAX_RES, step=32),
            Input.int("height", 768, min=32, max=MAX_RES, step=32),
            Input.int("length", 124, min=5, max=3600, step=17, tooltip=length_tip),
            Input.link("first_frame", "IMAGE", optional=True), Input.link("last_frame", "IMAGE", optional=True),
        ], [Output("CONDITIONING", "positive"), Output("LATENT")]),
        _spec("MiniMaxH3ReferenceToVideo", [
            Input.link("clip", "CLIP"), Input.link("vae", "VAE", optional=True),
            Input.link("audio_vae", "VAE", optional=True), Input.string("prompt", multiline=True),
            Input.int("width", 1344, min=32, max=MAX_RES, step=32),
            Input.int("height", 768, min=32, max=MAX_RES, step=32),
            Input.int("length", 124, min=5, max=3600, step=17, tooltip=length_tip),
            Input.combo("ref_image_size", ["match", "max"], "match"),
            Input.autogrow("ref_images", Input.link("ref_image", "IMAGE"), prefix="ref_image_", max=9),
            Input.autogrow("ref_videos", Input.link("ref_video", "IMAGE"), prefix="ref_video_", max=3),
            Input.autogrow("ref_video_audios", Input.link("ref_video_audio", "AUDIO"),
                           prefix="ref_video_audio_", max=3),
            Input.autogrow("ref_audios", Input.link("ref_audio", "AUDIO"), prefix="ref_audio_", max=3),
        ], [Output("CONDITIONING", "positive"), Output("LATENT")]),
    ]


def make_registry(*packs: list[NodeSpec]) -> NodeRegistry:
    registry = NodeRegistry()
    for pack in packs:
        registry.register_all(pack, origin="tests")
    return registry


@pytest.fixture(scope="module")
def registry() -> NodeRegistry:
    return make_registry(core_specs(), probe_specs(), h3_specs())


def load(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def load_template(name: str) -> dict:
    return official_template(name)


def inputs_by_id(api: dict) -> dict:
    """{id: (class_type, inputs)} for whole-prompt comparisons."""
    return {node_id: (entry["class_type"], entry["inputs"]) for node_id, entry in api.items()}


# ------------------------------------------------------------------------------------ core-style UI files
def test_core_graph_primitive_reroute_bypass_mute_and_notes(registry):
    api = ui_to_api(load("core_graph.json"), registry)
    assert inputs_by_id(api) == {
        # The PrimitiveNode's 320 replaces the stale 512 the target saved.
        "2": ("EmptyImage", {"width": 320, "height": 256, "batch_size": 1, "color": 0}),
        # Bypassed ImageScale hands its IMAGE input to SaveImage.
        "5": ("SaveImage", {"filename_prefix": "weft_test", "images": ["2", 0]}),
        # Two chained reroutes resolve to the real source.
        "6": ("PreviewImage", {"images": ["2", 0]}),
        # The input fed by the muted node is removed, as the editor does.
        "8": ("PreviewImage", {}),
        "9": ("GetImageSize", {"image": ["2", 0]}),
        "11": ("PreviewAny", {"source": ["9", 0]}),
        # `seed` is followed by the editor's control value, which is skipped.
        "14": ("SeedProbe", {"seed": 42, "text": "hello"}),
        # A bypassed node with no INT input gives nothing: the widget keeps its own value.
        "17": ("SeedProbe", {"seed": 7, "text": "kept"}),
        "16": ("EmptyImage", {"width": 8, "height": 8, "batch_size": 1, "color": 0}),
        # The bypassed pair's second output takes its second input, not the first IMAGE input.
        "19": ("PreviewImage", {"images": ["16", 0]}),
    }
    assert api["2"]["_meta"] == {"title": "Canvas"}
    assert api["5"]["_meta"] == {"title": "SaveImage"}  # untitled: the node's display name


def test_core_subgraph_flattened_with_boundary_links_and_widgets(registry):
    api = ui_to_api(load("core_subgraph.json"), registry)
    assert inputs_by_id(api) == {
        "1": ("EmptyImage", {"width": 64, "height": 48, "batch_size": 1, "color": 0}),
        "3": ("PrimitiveString", {"value": "linked-prefix"}),
        # Instance 10: the image comes in through -10 from node 1, width/height are the instance's
        # widget values (height is not even listed among its inputs), the prefix is a link from
        # outside the subgraph.
        "10:21": ("ImageScale", {"upscale_method": "bilinear", "width": 200, "height": 100, "crop": "center",
                                 "image": ["1", 0]}),
        "10:22": ("SaveImage", {"filename_prefix": ["3", 0], "images": ["10:21", 0]}),
        # Nested instance 23 inside instance 10; its muted PreviewImage is dropped.
        "10:23:31": ("GetImageSize", {"image": ["10:21", 0]}),
        # A second instance of the same definition gets its own ids and values.
        "11:21": ("ImageScale", {"upscale_method": "bilinear", "width": 300, "height": 120, "crop": "center",
                                 "image": ["1", 0]}),
        "11:22": ("SaveImage", {"filename_prefix": "second", "images": ["11:21", 0]}),
        "11:23:31": ("GetImageSize", {"image": ["11:21", 0]}),
        # Outputs leave through -20, across two levels for the width.
        "2": ("PreviewImage", {"images": ["10:21", 0]}),
        "4": ("PreviewAny", {"source": ["10:23:31", 0]}),
        # The bypassed instance passes its IMAGE input through; none of its inner nodes run.
        "5": ("PreviewImage", {"images": ["1", 0]}),
    }


def test_dynamic_combos_autogrow_controls_uploads_named_and_list_values(registry):
    api = ui_to_api(load("dynamic_widgets.json"), registry)
    assert inputs_by_id(api) == {
        "1": ("LoopProbe", {"mode": "until", "mode.threshold": 0.25, "mode.max_iterations": 7, "label": "loop-a"}),
        "2": ("LoopProbe", {"mode": "fixed", "mode.num_iterations": 5, "label": "loop-b"}),
        "3": ("OrderProbe", {"count": 4, "note": "opt"}),
        "4": ("ComfyMathExpression", {"expression": "a + b", "values.a": ["5", 0], "values.b": ["6", 0]}),
        "5": ("PrimitiveInt", {"value": 7}),
        "6": ("PrimitiveFloat", {"value": 1.5}),
        "7": ("LoadImage", {"image": "cat.png"}),
        "8": ("PrimitiveInt", {"value": 11}),
        "9": ("TagProbe", {"tags": {"__value__": ["a", "c"]}}),
        "10": ("SeedProbe", {"seed": 5, "text": "dict-form"}),
        "11": ("LoopProbe", {"mode": "fixed", "mode.num_iterations": 9, "label": "named"}),
        "12": ("LoopProbe", {"mode": "fixed", "mode.num_iterations": ["8", 0], "label": "linked-sub"}),
        "13": ("OrderProbe", {"count": 6, "note": ""}),
        "14": ("UploadProbe", {"image": "cat.png", "strength": 0.5}),
    }


def test_missing_node_type_names_type_id_and_title(registry):
    workflow = load("core_subgraph.json")
    workflow["definitions"]["subgraphs"][1]["nodes"][0]["type"] = "FancySizer"
    workflow["definitions"]["subgraphs"][1]["nodes"][0]["title"] = "My sizer"
    with pytest.raises(PromptError) as info:
        ui_to_api(workflow, registry)
    err = info.value
    assert err.type == "missing_node_type"
    assert "FancySizer" in err.message and "10:23:31" in err.message and "My sizer" in err.message
    # Both instances are reported, so the user sees every place to fix.
    assert [m["node_id"] for m in err.extra_info["missing"]] == ["10:23:31", "11:23:31"]
    body = err.to_json()
    assert body["error"]["type"] == "missing_node_type"
    assert body["error"]["extra_info"]["class_type"] == "FancySizer"


def test_unregistered_node_that_is_muted_or_bypassed_is_not_needed(registry):
    workflow = load("core_graph.json")
    by_id = {n["id"]: n for n in workflow["nodes"]}
    by_id[7]["type"] = "UninstalledPlugin"  # muted
    by_id[4]["type"] = "AnotherPlugin"  # bypassed: resolved from the UI inputs alone
    api = ui_to_api(workflow, registry)
    assert api["5"]["inputs"]["images"] == ["2", 0]
    assert "7" not in api and "4" not in api


def test_legacy_group_node_gets_a_hint(registry):
    workflow = load("core_graph.json")
    workflow["nodes"][4]["type"] = "workflow>MyGroup"
    workflow["nodes"][4]["mode"] = 0
    workflow["extra"]["groupNodes"] = {"workflow>MyGroup": {"nodes": []}}
    with pytest.raises(PromptError, match="group node"):
        ui_to_api(workflow, registry)


def test_reroute_loop_is_refused(registry):
    workflow = {
        "nodes": [
            {"id": 1, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 2}],
             "outputs": [{"name": "", "type": "IMAGE", "links": [1, 3]}]},
            {"id": 2, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 1}],
             "outputs": [{"name": "", "type": "IMAGE", "links": [2]}]},
            {"id": 3, "type": "PreviewImage", "mode": 0, "inputs": [{"name": "images", "type": "IMAGE", "link": 3}],
             "outputs": []},
        ],
        "links": [[1, 1, 0, 2, 0, "*"], [2, 2, 0, 1, 0, "*"], [3, 1, 0, 3, 0, "IMAGE"]],
    }
    with pytest.raises(PromptError) as info:
        ui_to_api(workflow, registry)
    assert info.value.type == "invalid_prompt" and "loop" in info.value.details


@pytest.mark.parametrize("bad_link", [[1, 2], {"id": 1, "origin_id": 1}, [1, 1, "x", 2, 0, "IMAGE"]])
def test_malformed_links_are_refused(registry, bad_link):
    workflow = load("core_graph.json")
    workflow["links"].append(bad_link)
    with pytest.raises(PromptError) as info:
        ui_to_api(workflow, registry)
    assert info.value.type == "invalid_prompt"


def test_self_containing_subgraph_is_refused(registry):
    workflow = load("core_subgraph.json")
    inner = workflow["definitions"]["subgraphs"][1]
    inner["nodes"][0]["type"] = inner["id"]
    with pytest.raises(PromptError, match="instance of itself"):
        ui_to_api(workflow, registry)


def test_is_ui_workflow():
    assert is_ui_workflow(load("core_graph.json"))
    assert not is_ui_workflow({"1": {"class_type": "EmptyImage", "inputs": {}}})
    assert not is_ui_workflow({"nodes": {"class_type": "X", "inputs": {}}})  # an API node with id "nodes"
    assert not is_ui_workflow([1, 2])
    with pytest.raises(PromptError):
        ui_to_api({"1": {"class_type": "EmptyImage", "inputs": {}}}, NodeRegistry())


def test_execution_layer_imports_neither_torch_nor_nodes():
    code = ("import sys, execution.convert; "
            "bad = [m for m in sys.modules if m == 'torch' or m == 'nodes' or m.startswith('nodes.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- official MiniMax-H3 templates
def _strip_named(data):
    if isinstance(data, dict):
        data.pop("widgets_values_named", None)
        for value in data.values():
            _strip_named(value)
    elif isinstance(data, list):
        for value in data:
            _strip_named(value)
    return data


def test_t2v_template_subgraph_flattened(registry):
    workflow = load_template("video_minimax_h3_t2v.json")
    api = ui_to_api(workflow, registry)
    # Three MarkdownNotes and the subgraph instance itself disappear; 21 inner nodes appear.
    assert "116" not in api and "117" not in api and "118" not in api and "140" not in api
    assert sorted(api) == sorted(["92", "115"] + [f"140:{i}" for i in range(119, 140)])

    instance = next(n for n in workflow["nodes"] if n["id"] == 140)
    assert api["92"]["inputs"] == {"filename_prefix": "video/MiniMax_H3", "format": "auto", "codec": "auto",
                                   "video": ["140:130", 0]}  # the subgraph's output, from inside
    assert api["115"]["inputs"] == {"aspect_ratio": "16:9 (Widescreen)", "megapixels": 0.4, "multiple": 32}
    i2v = api["140:131"]
    assert i2v["class_type"] == "MiniMaxH3ImageToVideo"
    # The prompt is the instance's widget value, not the inner node's own stale text.
    assert i2v["inputs"]["prompt"] == instance["widgets_values"][0]
    assert i2v["inputs"]["prompt"].startswith("Realistic live-action")
    # width/height come from outside the subgraph, length from an inner node; images are unconnected.
    assert i2v["inputs"]["width"] == ["115", 0] and i2v["inputs"]["height"] == ["115", 1]
    assert i2v["inputs"]["length"] == ["140:132", 1]
    assert i2v["inputs"]["clip"] == ["140:128", 0] and i2v["inputs"]["vae"] == ["140:119", 0]
    assert "first_frame" not in i2v["inputs"] and "last_frame" not in i2v["inputs"]
    assert api["140:129"]["inputs"] == {"noise_seed": 757358688076805}
    assert api["140:133"]["inputs"] == {"value": 5}  # "duration" (value_1)
    assert api["140:138"]["inputs"] == {"value": 8}  # "turbo_steps" (value_2), control value dropped
    assert api["140:137"]["inputs"] == {"value": 20}
    assert api["140:139"]["inputs"] == {"value": False}  # "turbo_mode"
    assert api["140:120"]["inputs"] == {"vae_name": "minimax_h3_audio_vae_fp32.safetensors"}  # "audio_vae"
    assert api["140:128"]["inputs"] == {"clip_name": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
                                        "type": "minimax", "device": "default"}
    assert api["140:134"]["inputs"] == {
        "lora_name": "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", "strength_model": 1,
        "model": ["140:127", 0]}
    assert api["140:132"]["inputs"] == {
        "expression": "max(5, round(a * 24)) + (5 - (max(5, round(a * 24)) % 17)) % 17",
        "values.a": ["140:133", 0]}  # values.b is unconnected
    assert api["140:135"]["inputs"] == {"switch": ["140:139", 0], "on_false": ["140:127", 0],
                                        "on_true": ["140:134", 0]}
    assert api["140:124"]["inputs"] == {"scheduler": "simple", "steps": ["140:136", 0], "denoise": 1,
                                        "model": ["140:135", 0]}
    assert api["140:130"]["inputs"] == {"fps": 24, "bit_depth": 8, "images": ["140:122", 0],
                                        "audio": ["140:121", 0]}
    assert api["140:125"]["inputs"]["latent_image"] == ["140:131", 1]


def test_r2v_template(registry):
    api = ui_to_api(load_template("video_minimax_h3_r2v.json"), registry)
    assert not {"116", "117", "140"} & set(api)  # MarkdownNotes
    assert len(api) == 26
    ref = api["136"]
    assert ref["class_type"] == "MiniMaxH3ReferenceToVideo"
    assert ref["inputs"] == {
        "prompt": ["138", 0], "width": ["115", 0], "height": ["115", 1], "length": ["131", 1],
        "ref_image_size": "match", "clip": ["128", 0], "vae": ["119", 0], "audio_vae": ["120", 0],
        "ref_images.ref_image_0": ["137", 0], "ref_images.ref_image_1": ["139", 0],
    }
    assert api["137"]["inputs"] == {"image": "red_superboy_on_city_roof.png"}  # upload button value skipped
    assert api["129"]["inputs"] == {"noise_seed": 261662374822964}
    assert api["131"]["inputs"]["values.a"] == ["132", 0]
    assert api["143"]["inputs"] == {"value": 20} and api["144"]["inputs"] == {"value": 4}
    assert api["124"]["inputs"] == {"scheduler": "simple", "steps": ["142", 0], "denoise": 1, "model": ["127", 0]}
    assert api["92"]["inputs"]["video"] == ["130", 0]


@pytest.mark.parametrize("name", ["video_minimax_h3_t2v.json", "video_minimax_h3_r2v.json"])
def test_templates_positional_widgets_match_named(registry, name):
    """Without widgets_values_named the positional rules (control values, upload buttons, subgraph
    instance widgets) must give the very same prompt."""
    workflow = load_template(name)
    assert ui_to_api(_strip_named(copy.deepcopy(workflow)), registry) == ui_to_api(workflow, registry)


def test_t2v_template_linked_and_muted_variants(registry):
    """Editing the template the way a user would: link the duration from outside the subgraph, mute
    the resolution selector, bypass the LoRA inside the subgraph."""
    workflow = load_template("video_minimax_h3_t2v.json")
    nodes = {n["id"]: n for n in workflow["nodes"]}
    workflow["nodes"].append({"id": 200, "type": "PrimitiveFloat", "mode": 0, "inputs": [],
                              "outputs": [{"name": "FLOAT", "type": "FLOAT", "links": [900]}],
                              "widgets_values": [7.5]})
    workflow["links"].append([900, 200, 0, 140, 4, "FLOAT"])
    duration = next(i for i in nodes[140]["inputs"] if i["name"] == "value_1")
    duration["link"] = 900
    nodes[115]["mode"] = 2
    inner = {n["id"]: n for n in workflow["definitions"]["subgraphs"][0]["nodes"]}
    inner[134]["mode"] = 4
    api = ui_to_api(workflow, registry)
    assert api["140:133"]["inputs"] == {"value": ["200", 0]}
    assert "115" not in api
    # Inputs fed by the muted selector are removed (the editor does the same).
    assert "width" not in api["140:131"]["inputs"] and "height" not in api["140:131"]["inputs"]
    # The bypassed LoRA hands its MODEL input to the switch.
    assert api["140:135"]["inputs"]["on_true"] == ["140:127", 0]
    assert "140:134" not in api


def test_proxy_widgets_of_older_editors(registry):
    """Instances saved with properties.proxyWidgets keep their widget values aligned with that list;
    "-1" entries are the instance's own input widgets, others are inner node widgets."""
    workflow = load("core_subgraph.json")
    instance = workflow["nodes"][2]
    instance["properties"]["proxyWidgets"] = [["21", "upscale_method"], ["-1", "width"], ["-1", "prefix"],
                                              ["-1", "height"]]
    instance["widgets_values"] = ["lanczos", 250, "unused", 90]
    api = ui_to_api(workflow, registry)
    assert api["10:21"]["inputs"] == {"upscale_method": "lanczos", "width": 250, "height": 90, "crop": "center",
                                      "image": ["1", 0]}
    assert api["10:22"]["inputs"]["filename_prefix"] == ["3", 0]  # still linked from outside
    assert api["11:21"]["inputs"]["upscale_method"] == "bilinear"  # other instances unaffected


def test_subgraph_widgets_field_is_refused_not_guessed(registry):
    workflow = load("core_subgraph.json")
    workflow["definitions"]["subgraphs"][0]["widgets"] = [{"id": 21, "name": "crop"}]
    with pytest.raises(PromptError, match="Scale and save"):
        ui_to_api(workflow, registry)


def test_muted_subgraph_instance_drops_inner_nodes_and_consumers_inputs(registry):
    workflow = load("core_subgraph.json")
    workflow["nodes"][2]["mode"] = 2  # instance 10
    api = ui_to_api(workflow, registry)
    assert not [k for k in api if k.startswith("10:")]
    assert api["2"]["inputs"] == {} and api["4"]["inputs"] == {}
    assert api["11:21"]["inputs"]["width"] == 300


def test_stale_link_id_counts_as_unconnected(registry):
    """The editor drops links missing from the link table when it loads a file; so does conversion."""
    workflow = load("core_graph.json")
    workflow["links"] = [link for link in workflow["links"] if link[0] != 1]  # PrimitiveNode -> width
    api = ui_to_api(workflow, registry)
    assert api["2"]["inputs"]["width"] == 512


def test_a_node_taking_every_input_gets_the_plain_widget_values_it_does_not_declare():
    # A video pack's output node: its editor script adds the chosen format's options as widgets, saved
    # by name with the preview's own state beside them.
    combine = _spec("EveryInputCombine", [Input.combo("format", ["video/a", "video/b"]), Input.int("frame_rate", default=8)],
                    [], takes_every_input=True)
    plain = _spec("PlainCombine", [Input.combo("format", ["video/a", "video/b"])], [])
    registry = make_registry([combine, plain])
    saved = {"format": "video/b", "frame_rate": 12, "crf": 30, "pix_fmt": "yuv420p10le", "save_metadata": False,
             "videopreview": {"hidden": False, "paused": False, "params": {"filename": "x.mp4"}}}
    workflow = {"nodes": [{"id": 1, "type": "EveryInputCombine", "mode": 0, "inputs": [], "outputs": [],
                           "widgets_values": dict(saved)},
                          {"id": 2, "type": "PlainCombine", "mode": 0, "inputs": [], "outputs": [],
                           "widgets_values": dict(saved)}],
                "links": []}
    api = inputs_by_id(ui_to_api(workflow, registry))
    assert api["1"] == ("EveryInputCombine", {"format": "video/b", "frame_rate": 12, "crf": 30,
                                              "pix_fmt": "yuv420p10le", "save_metadata": False})
    assert api["2"] == ("PlainCombine", {"format": "video/b"})
