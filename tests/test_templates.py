"""The official MiniMax H3 templates (ComfyUI's t2v and r2v workflows) convert, validate and run end to end.

The tiny weights are installed under the file names the templates use (and a tiny LoRA for their
switched-off turbo branch); the converted prompts get small sizes, five frames and two steps, so each
run takes seconds. The templates come from the `comfyui-workflow-templates-json` package (test extra).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from execution.convert import ui_to_api
from tests.official_templates import R2V, T2V, official_template
from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths is a fixture)
    H3Env, configured_paths, install, mp4_streams, tiny_weights, write_tiny_lora,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKFLOW = ROOT / "workflows" / "h3_t2va.json"
TEMPLATE_NAMES = {
    "video_vae": "minimax_h3_video_vae_int8_convrot.safetensors",
    "audio_vae": "minimax_h3_audio_vae_fp32.safetensors",
    "text_encoder": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
}
TRANSFORMERS = ("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "minimax_h3_ref2va_pruned_int8_convrot.safetensors")
LORAS = ("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors",
         "minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors")
INPUT_IMAGES = {"red_superboy_on_city_roof.png": (200, 60, 40), "mecha_dragon_lightning.png": (30, 40, 90)}


@pytest.fixture
def env(registry, tmp_path, tmp_path_factory, configured_paths) -> H3Env:
    weights = tiny_weights(tmp_path_factory)
    for transformer in TRANSFORMERS:
        install(weights, tmp_path, {**TEMPLATE_NAMES, "transformer": transformer})
    env = H3Env(registry, tmp_path)
    for lora in LORAS:
        write_tiny_lora(env.paths.models / "loras" / lora, env.paths.models / "diffusion_models" / TRANSFORMERS[0])
    for name, colour in INPUT_IMAGES.items():
        Image.new("RGB", (72, 48), colour).save(env.paths.input / name)
    configured_paths(env.paths)
    return env


def load_template(name: str) -> dict:
    return official_template(name)


def nodes_of(prompt: dict, class_type: str) -> list[str]:
    return [node_id for node_id, node in prompt.items() if node["class_type"] == class_type]


def shrink(prompt: dict, generator: str, *, turbo: bool = False) -> None:
    """Small size, five frames and two steps; `turbo` switches the templates' LoRA branch on."""
    (node_id,) = nodes_of(prompt, generator)
    prompt[node_id]["inputs"].update(width=64, height=32, length=5)
    for primitive in nodes_of(prompt, "PrimitiveInt"):  # the step counts of both branches
        prompt[primitive]["inputs"]["value"] = 2
    for switch in nodes_of(prompt, "PrimitiveBoolean"):
        prompt[switch]["inputs"]["value"] = turbo


def run_template(env: H3Env, workflow: dict, generator: str, *, turbo: bool = False) -> tuple[object, dict]:
    prompt = ui_to_api(workflow, env.registry)
    shrink(prompt, generator, turbo=turbo)
    result = env.run(prompt)
    (save,) = nodes_of(prompt, "SaveVideo")
    return result, mp4_streams(env.output_file(result, save))


@pytest.mark.parametrize("path", [T2V, R2V], ids=["t2v", "r2v"])
def test_templates_convert_and_validate_unchanged(env, path):
    prompt = ui_to_api(load_template(path), env.registry)
    validated = env.validate(prompt)
    assert nodes_of(prompt, "SaveVideo")[0] in validated.outputs
    loaders = {prompt[n]["inputs"]["clip_name"] for n in nodes_of(prompt, "CLIPLoader")}
    assert loaders == {TEMPLATE_NAMES["text_encoder"]}
    assert {prompt[n]["inputs"]["type"] for n in nodes_of(prompt, "CLIPLoader")} == {"minimax"}


def _without_named_widgets(workflow: dict) -> dict:
    stripped = json.loads(json.dumps(workflow))
    graphs = [stripped] + list(stripped.get("definitions", {}).get("subgraphs", []))
    for graph in graphs:
        for node in graph.get("nodes", []):
            node.pop("widgets_values_named", None)
    return stripped


@pytest.mark.parametrize("path", [T2V, R2V], ids=["t2v", "r2v"])
def test_positional_widget_values_map_like_the_named_ones(env, path):
    # The positional values follow the nodes' input order; the named ones say which input each is for.
    workflow = load_template(path)
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


def test_t2v_template_runs_end_to_end(env):
    result, streams = run_template(env, load_template(T2V), "MiniMaxH3ImageToVideo")
    assert streams["video_streams"] == 1 and streams["frames"] == 5 and streams["video_codec"] == "h264"
    assert streams["audio_streams"] == 1 and streams["channels"] == 2 and streams["sample_rate"] == 32000
    assert not any(row["class_type"] == "LoraLoaderModelOnly" for row in result.profile.values())


def test_t2v_template_turbo_branch_applies_the_lora(env):
    result, streams = run_template(env, load_template(T2V), "MiniMaxH3ImageToVideo", turbo=True)
    assert any(row["class_type"] == "LoraLoaderModelOnly" for row in result.profile.values())
    assert streams["frames"] == 5 and streams["audio_streams"] == 1


def test_r2v_template_runs_end_to_end_with_its_reference_images(env):
    workflow = load_template(R2V)
    result, streams = run_template(env, workflow, "MiniMaxH3ReferenceToVideo")
    assert streams["video_streams"] == 1 and streams["frames"] == 5
    assert streams["audio_streams"] == 1 and streams["channels"] == 2 and streams["sample_rate"] == 32000
    executed = {row["class_type"] for row in result.profile.values()}
    assert {"LoadImage", "MiniMaxH3ReferenceToVideo", "SamplerCustomAdvanced", "VAEDecodeAudio"} <= executed
