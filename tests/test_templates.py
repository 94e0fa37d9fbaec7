"""Every local official H3 template converts, validates and runs end to end on tiny released-format files.

The templates come unchanged from the `comfyui-workflow-templates-json` package (test extra); the local
H3 ones are those named `*minimax_h3*` or `*fasth3*`, without the `api_` prefix. The models folder holds
what `python -m models.h3.make_tiny --released-formats` writes: tiny models under the released file
names, stored as the released files store the real ones (pruned curve-AdaLN int8-convrot DiT, int8-convrot
video VAE, weight-normalised fp32 audio VAE, bf16 turbo LoRAs, the int8-convrot Fun ControlNet patch, a
tiny nvfp4 Qwen3-VL text encoder with its tiny tokenizer folder). Every model file a template names must be
among them.

A run changes only values a user edits in the template's own widgets: the resolution selector's
megapixels (-> its minimum, 0.1), the duration (-> 0.2 s: 5 frames; the multi-frame template's guide
times scaled with it, so its three guides land on frames 1, 3 and 4), the step counts (-> 2) and the
turbo switch. At the templates' own sizes (0.4 MP, 124 frames, 20 steps) a tiny run takes minutes on a
CPU, too slow for the suite. Input files the templates name are written small (flat-coloured pictures,
a short video).

Templates that cannot run are listed in NOT_RUNNABLE with the reason; that list may only shrink, and a
test fails as soon as a listed template converts, so an entry is removed once its nodes exist.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from execution.convert import ui_to_api
from execution.errors import PromptError
from media.video import VideoComponents
from tests.official_templates import R2V, T2V, local_h3_templates, official_template
from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths is a fixture)
    H3Env, configured_paths, install, mp4_streams, probe, tiny_weights,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKFLOW = ROOT / "workflows" / "h3_t2va.json"
TEXT_ENCODER = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
CONTROLNET = "video_minimax_h3_fun_controlnet_union.json"
MULTIFRAME = "video_minimax_h3_multiframe_reference.json"
POSE_NODES = ("CheckpointLoaderSimple", "RTDETR_detect", "SDPoseDrawKeypoints", "SDPoseKeypointExtractor")
# Template -> (why it cannot run unchanged, the node types it lacks). May only shrink.
NOT_RUNNABLE = {
    CONTROLNET: ("its pose-extraction subgraph needs the SDPose and RT-DETR model families, which Weft does not "
                 "have; test_controlnet_template_runs_with_the_control_video_given_directly runs the rest of it",
                 POSE_NODES),
}
RUNNABLE = [name for name in local_h3_templates() if name not in NOT_RUNNABLE]
FRAMES_EXPRESSION = "max(5, round(a * 24))"        # the templates' duration -> frame count expression
GUIDE_EXPRESSION = "round (a * 24)"                # the multi-frame template's guide time -> frame index
TINY_MEGAPIXELS = 0.1
TINY_STEPS = 2
TINY_SECONDS, TINY_FRAMES = 0.2, 5
# Loader input -> the models folder its file is in.
MODEL_INPUTS = {("UNETLoader", "unet_name"): "diffusion_models", ("CLIPLoader", "clip_name"): "text_encoders",
                ("VAELoader", "vae_name"): "vae", ("LoraLoaderModelOnly", "lora_name"): "loras",
                ("LoraLoader", "lora_name"): "loras", ("ModelPatchLoader", "name"): "model_patches",
                ("CheckpointLoaderSimple", "ckpt_name"): "checkpoints"}


def _short(name: str) -> str:
    return name.removesuffix(".json")


@pytest.fixture(scope="session")
def released_models(tmp_path_factory) -> Path:
    """The tiny released-format files, written once per session."""
    from models.h3.tiny_released import write_released
    root = tmp_path_factory.mktemp("released_models")
    write_released(root)
    return root


def link_tree(source: Path, target: Path) -> None:
    for path in (p for p in source.rglob("*") if p.is_file()):  # the weights and the tokenizer folder
        dest = target / path.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            try:
                dest.hardlink_to(path)
            except OSError:
                dest.write_bytes(path.read_bytes())


@pytest.fixture
def env(registry, tmp_path, released_models, configured_paths) -> H3Env:
    link_tree(released_models, tmp_path / "models")
    env = H3Env(registry, tmp_path)
    configured_paths(env.paths)
    return env


def load_template(name: str) -> dict:
    return official_template(name)


def nodes_of(prompt: dict, class_type: str) -> list[str]:
    return [node_id for node_id, node in prompt.items() if node["class_type"] == class_type]


def _feeds(prompt: dict, node_id: str) -> list[dict]:
    """The nodes that take an input from node_id."""
    return [node for node in prompt.values()
            if any(isinstance(v, list) and len(v) == 2 and v[0] == node_id for v in node["inputs"].values())]


def _has_turbo_switch(name: str) -> bool:
    graphs = [load_template(name)] + load_template(name).get("definitions", {}).get("subgraphs", [])
    return any(node["type"] == "PrimitiveBoolean" for graph in graphs for node in graph.get("nodes", []))


def listed_model_files(prompt: dict) -> set[tuple[str, str]]:
    """(models folder, file name) of every model file the prompt's loaders name."""
    return {(folder, node["inputs"][name]) for node in prompt.values()
            for (class_type, name), folder in MODEL_INPUTS.items()
            if node["class_type"] == class_type and isinstance(node["inputs"].get(name), str)}


def add_inputs(env: H3Env, prompt: dict) -> None:
    """Each LoadImage file as a small flat-coloured picture, each LoadVideo file as a short small video."""
    for n, node_id in enumerate(nodes_of(prompt, "LoadImage")):
        colour = (40 + 50 * n % 200, 200 - 30 * n % 150, 90 + 20 * n % 160)
        Image.new("RGB", (72, 48), colour).save(env.paths.input / prompt[node_id]["inputs"]["image"])
    for node_id in nodes_of(prompt, "LoadVideo"):
        ramp = torch.linspace(0.1, 0.9, 8).view(8, 1, 1, 1)
        frames = (ramp * torch.tensor([1.0, 0.6, 0.3])).expand(8, 48, 64, 3).contiguous()
        VideoComponents(images=frames, frame_rate=24).save_to(env.paths.input / prompt[node_id]["inputs"]["file"])


def fit_to_tiny(prompt: dict, *, turbo: bool) -> dict[str, object]:
    """Set the template's own widgets for a tiny run (see the module docstring); {node id: what changed}."""
    changed: dict[str, object] = {}

    def set_value(node_id: str, name: str, value: object) -> None:
        inputs = prompt[node_id]["inputs"]
        assert name in inputs and not isinstance(inputs[name], list), f"{node_id}.{name} is not a widget"
        inputs[name] = value
        changed[f"{node_id}.{name}"] = value

    for node_id in nodes_of(prompt, "ResolutionSelector") + nodes_of(prompt, "ImageScaleToTotalPixels"):
        set_value(node_id, "megapixels", TINY_MEGAPIXELS)
    for node_id in nodes_of(prompt, "PrimitiveInt"):            # the step counts of both branches
        set_value(node_id, "value", TINY_STEPS)
    for node_id in nodes_of(prompt, "BasicScheduler"):          # a step count set on the scheduler itself
        if not isinstance(prompt[node_id]["inputs"]["steps"], list):
            set_value(node_id, "steps", TINY_STEPS)
    for node_id in nodes_of(prompt, "PrimitiveBoolean"):        # the turbo switch
        if _feeds(prompt, node_id):
            set_value(node_id, "value", turbo)
    durations = [n for n in nodes_of(prompt, "PrimitiveFloat")
                 if any(FRAMES_EXPRESSION in str(f["inputs"].get("expression")) for f in _feeds(prompt, n))]
    for duration in durations:
        old = float(prompt[duration]["inputs"]["value"])
        set_value(duration, "value", TINY_SECONDS)
        last_frame_time = (TINY_FRAMES - 1) / 24
        for node_id in nodes_of(prompt, "PrimitiveFloat"):
            if any(f["inputs"].get("expression") == GUIDE_EXPRESSION for f in _feeds(prompt, node_id)):
                scaled = float(prompt[node_id]["inputs"]["value"]) * TINY_SECONDS / old
                set_value(node_id, "value", min(scaled, last_frame_time))
    return changed


def encoded_tags(env: H3Env):
    """The token tags of the prompt the run's Qwen3-VL encoder encoded (its only remembered prompt)."""
    from models.cache import ModelCache
    from models.components import TextEncoder
    from models.h3.packing import TOKEN_TAGS_KEY
    clips = [v for v in env.runtime.shared("model_cache", ModelCache)._entries.values() if isinstance(v, TextEncoder)]
    (clip,) = clips
    assert clip.reads_pictures
    ((_, extras),) = clip._encoded.values()
    return extras[TOKEN_TAGS_KEY][0]


def check_outputs(env: H3Env, prompt: dict, result) -> None:
    """The template's saved result: an MP4 of 5 frames with stereo 32 kHz sound, or one image per latent."""
    for save in nodes_of(prompt, "SaveVideo"):
        streams = mp4_streams(env.output_file(result, save))
        assert streams["video_streams"] == 1 and streams["frames"] == TINY_FRAMES
        assert streams["video_codec"] == "h264"
        assert streams["audio_streams"] == 1 and streams["channels"] == 2 and streams["sample_rate"] == 32000
    for save in nodes_of(prompt, "SaveImage"):
        with Image.open(env.output_file(result, save)) as image:
            assert image.size[0] % 16 == 0 and image.size[1] % 16 == 0
    assert nodes_of(prompt, "SaveVideo") or nodes_of(prompt, "SaveImage")


def run_prompt(env: H3Env, prompt: dict, *, turbo: bool = False) -> tuple[object, dict]:
    add_inputs(env, prompt)
    changed = fit_to_tiny(prompt, turbo=turbo)
    return env.run(prompt), changed


# ---------------------------------------------------------------------- which templates run
def test_templates_that_cannot_run_are_listed_with_what_they_lack(env):
    assert set(NOT_RUNNABLE) <= set(local_h3_templates())
    for name, (reason, lacking) in NOT_RUNNABLE.items():
        assert reason
        with pytest.raises(PromptError) as refused:
            ui_to_api(load_template(name), env.registry)
        message = str(refused.value)
        assert "not registered" in message
        # Exactly the listed node types are missing: the ones Weft built are registered.
        assert set(re.findall(r"'([^']+)' \(node #", message)) == set(lacking), message


@pytest.mark.parametrize("name", RUNNABLE, ids=_short)
def test_templates_convert_and_validate_unchanged(env, name):
    prompt = ui_to_api(load_template(name), env.registry)
    add_inputs(env, prompt)
    validated = env.validate(prompt)
    outputs = nodes_of(prompt, "SaveVideo") + nodes_of(prompt, "SaveImage")
    assert outputs and all(node in validated.outputs for node in outputs)
    assert {prompt[n]["inputs"]["clip_name"] for n in nodes_of(prompt, "CLIPLoader")} == {TEXT_ENCODER}
    assert {prompt[n]["inputs"]["type"] for n in nodes_of(prompt, "CLIPLoader")} == {"minimax"}
    unets = {prompt[n]["inputs"]["unet_name"] for n in nodes_of(prompt, "UNETLoader")}
    assert unets and all(u.endswith("_pruned_int8_convrot.safetensors") for u in unets)
    # The tiny files are written under every name the template lists.
    missing = [f"{folder}/{file}" for folder, file in listed_model_files(prompt)
               if not (env.paths.models / folder / file).is_file()]
    assert not missing


def _without_named_widgets(workflow: dict) -> dict:
    stripped = json.loads(json.dumps(workflow))
    graphs = [stripped] + list(stripped.get("definitions", {}).get("subgraphs", []))
    for graph in graphs:
        for node in graph.get("nodes", []):
            node.pop("widgets_values_named", None)
    return stripped


@pytest.mark.parametrize("name", RUNNABLE, ids=_short)
def test_positional_widget_values_map_like_the_named_ones(env, name):
    # The positional values follow the nodes' input order; the named ones say which input each is for.
    workflow = load_template(name)
    assert ui_to_api(_without_named_widgets(workflow), env.registry) == ui_to_api(workflow, env.registry)


def test_default_workflow_runs_on_the_tiny_models(registry, tmp_path, tmp_path_factory, configured_paths):
    install(tiny_weights(tmp_path_factory), tmp_path)  # the tiny models under their own names, as make_tiny writes
    env = H3Env(registry, tmp_path)
    configured_paths(env.paths)
    workflow = json.loads(DEFAULT_WORKFLOW.read_text(encoding="utf-8"))
    notes = [n["widgets_values"][0] for n in workflow["nodes"] if n["type"] == "Note"]
    assert any("random" in text.lower() and "noise" in text.lower() for text in notes)
    prompt = ui_to_api(workflow, env.registry)
    result = env.run(prompt)
    (save,) = nodes_of(prompt, "SaveVideo")
    streams = mp4_streams(env.output_file(result, save))
    assert streams["frames"] == 22 and streams["video_codec"] == "h264"
    assert streams["audio_codec"] == "aac" and streams["channels"] == 2 and streams["sample_rate"] == 32000
    stages = {row["class_type"] for row in result.profile.values()}
    assert {"CLIPTextEncode", "SamplerCustomAdvanced", "VAEDecode", "VAEDecodeAudio", "SaveVideo"} <= stages


RUNS = [(name, turbo) for name in RUNNABLE for turbo in ((False, True) if _has_turbo_switch(name) else (False,))]


@pytest.mark.parametrize("name, turbo", RUNS, ids=[f"{_short(n)}-{'turbo' if t else 'base'}" for n, t in RUNS])
def test_template_runs_end_to_end_on_released_formats(env, name, turbo):
    prompt = ui_to_api(load_template(name), env.registry)
    result, changed = run_prompt(env, prompt, turbo=turbo)
    check_outputs(env, prompt, result)
    executed = [row["class_type"] for row in result.profile.values()]
    assert ("LoraLoaderModelOnly" in executed) == turbo
    assert {"UNETLoader", "SamplerCustomAdvanced", "VAEDecode"} <= set(executed)
    if name == MULTIFRAME:
        assert executed.count("MiniMaxH3AddGuide") == 3
    if nodes_of(prompt, "LoadImage"):
        assert "LoadImage" in executed
    if name in (T2V, R2V):
        # The text encoder saw the reference pictures: one block of picture tokens (tag 0) per picture.
        tags = encoded_tags(env)
        blocks = int(((tags[1:] == 0) & (tags[:-1] == 1)).sum()) + int(tags[0] == 0)
        assert blocks == (2 if name == R2V else 0)
    for built in ("BlockSparseAttention", "ModelAttentionBackend", "LTXVSeparateAVLatent"):
        assert bool(nodes_of(prompt, built)) == (built in executed)
    assert all(key.endswith((".megapixels", ".value", ".steps")) for key in changed)


# ---------------------------------------------------------------------- the ControlNet template's own path
def controlnet_with_video_control() -> dict:
    """The ControlNet template with its pose-extraction subgraph swapped for GetVideoComponents: the frames
    of the (sliced) input video go to control_video as they are, as a pre-rendered pose video would."""
    workflow = json.loads(json.dumps(load_template(CONTROLNET)))
    (pose,) = [n for n in workflow["nodes"] if n["type"] == workflow["definitions"]["subgraphs"][0]["id"]]
    video_in = next(i["link"] for i in pose["inputs"] if i["name"] == "video")
    frames_out = pose["outputs"][0]["links"]
    pose.clear()
    pose.update({"id": 700, "type": "GetVideoComponents", "mode": 0, "widgets_values": [],
                 "inputs": [{"name": "video", "type": "VIDEO", "link": video_in}],
                 "outputs": [{"name": "images", "type": "IMAGE", "links": frames_out},
                             {"name": "audio", "type": "AUDIO", "links": []},
                             {"name": "fps", "type": "FLOAT", "links": []}]})
    for link in workflow["links"]:
        if link[0] == video_in:
            link[4] = 0
    workflow["definitions"]["subgraphs"] = []
    return workflow


def _controlnet_prompt(env: H3Env, *, strength: float | None) -> dict:
    """The swapped ControlNet template at `strength`, or with the ControlNet node bypassed (None)."""
    workflow = controlnet_with_video_control()
    (apply,) = [n for n in workflow["nodes"] if n["type"] == "MiniMaxH3FunControlNetApply"]
    if strength is None:
        apply["mode"] = 4
    else:
        apply["widgets_values"][0] = strength
        if "widgets_values_named" in apply:
            apply["widgets_values_named"]["strength"] = strength
    prompt = ui_to_api(workflow, env.registry)
    (sampler,) = nodes_of(prompt, "SamplerCustomAdvanced")
    prompt["probe_latent"] = {"class_type": "TestOutput", "inputs": {"value": [sampler, 0]}}
    return prompt


def test_controlnet_template_runs_with_the_control_video_given_directly(env):
    prompt = _controlnet_prompt(env, strength=1.0)
    result, _ = run_prompt(env, prompt)
    check_outputs(env, prompt, result)
    executed = {row["class_type"] for row in result.profile.values()}
    assert {"ModelPatchLoader", "MiniMaxH3FunControlNetApply", "Video Slice", "LoadVideo"} <= executed
    assert ("model_patches", "minimax_h3_fun_controlnet_union_pruned_int8_convrot.safetensors") in \
        listed_model_files(prompt)


def test_controlnet_strength_zero_is_the_run_without_the_patch_and_strength_one_is_not(env):
    latents = {}
    for label, strength in (("bypassed", None), ("zero", 0.0), ("one", 1.0)):
        result, _ = run_prompt(env, _controlnet_prompt(env, strength=strength))
        latents[label] = probe(result, "probe_latent")
    for key in ("samples", "audio_samples"):
        assert torch.equal(latents["zero"][key], latents["bypassed"][key])
    assert not torch.equal(latents["one"]["samples"], latents["bypassed"]["samples"])
