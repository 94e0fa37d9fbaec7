"""The official MiniMax H3 templates convert, validate and run end to end on tiny released-format files.

The models folder holds what `python -m models.h3.make_tiny --released-formats` writes: tiny models under
the released file names, stored as the released files store the real ones (pruned curve-AdaLN int8-convrot
DiT, int8-convrot video VAE, weight-normalised fp32 audio VAE, bf16 turbo LoRAs, a tiny nvfp4 Qwen3-VL text
encoder with its tiny tokenizer folder). The templates come unchanged from the `comfyui-workflow-templates-json`
package (test extra). A run changes only values a user edits in the template's own widgets: the
resolution selector's megapixels (0.4 -> its minimum, 0.1), the duration (5 s -> 0.2 s: 5 frames; the
multi-frame template's guide times scaled with it, so its three guides land on frames 1, 3 and 4), the
step counts (20, 8 and 4 -> 2) and the turbo switch. At the templates' own sizes (0.4 MP, 124 frames, 20 steps) a tiny run takes
minutes on a CPU, too slow for the suite.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from execution.convert import ui_to_api
from tests.official_templates import R2V, T2V, official_template
from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths is a fixture)
    H3Env, configured_paths, install, mp4_streams, tiny_weights,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKFLOW = ROOT / "workflows" / "h3_t2va.json"
TEXT_ENCODER = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
I2V = "video_minimax_h3_i2v.json"
I2V_CONTINUATION = "video_minimax_h3_i2v_continuation.json"
MULTIFRAME = "video_minimax_h3_multiframe_reference.json"
# Template -> (the node that builds its latent, seconds of video for the tiny run, pixel frames that gives).
TEMPLATES = {T2V: ("MiniMaxH3ImageToVideo", 0.2, 5), I2V: ("MiniMaxH3ImageToVideo", 0.2, 5),
             I2V_CONTINUATION: ("MiniMaxH3ImageToVideo", 0.2, 5), R2V: ("MiniMaxH3ReferenceToVideo", 0.2, 5),
             MULTIFRAME: ("MiniMaxH3ReferenceToVideo", 0.2, 5)}
FRAMES_EXPRESSION = "max(5, round(a * 24))"        # the templates' duration -> frame count expression
GUIDE_EXPRESSION = "round (a * 24)"                # the multi-frame template's guide time -> frame index
TINY_MEGAPIXELS = 0.1
TINY_STEPS = 2


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


def add_input_images(env: H3Env, prompt: dict) -> None:
    """Each LoadImage file of the template, as a small flat-coloured picture in the input folder."""
    for n, node_id in enumerate(nodes_of(prompt, "LoadImage")):
        colour = (40 + 50 * n % 200, 200 - 30 * n % 150, 90 + 20 * n % 160)
        Image.new("RGB", (72, 48), colour).save(env.paths.input / prompt[node_id]["inputs"]["image"])


def fit_to_tiny(prompt: dict, seconds: float, frames: int, *, turbo: bool) -> dict[str, object]:
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
    for node_id in nodes_of(prompt, "PrimitiveBoolean"):        # the turbo switch
        set_value(node_id, "value", turbo)
    durations = [n for n in nodes_of(prompt, "PrimitiveFloat")
                 if any(FRAMES_EXPRESSION in str(f["inputs"].get("expression")) for f in _feeds(prompt, n))]
    (duration,) = durations
    old = float(prompt[duration]["inputs"]["value"])
    set_value(duration, "value", seconds)
    last_frame_time = (frames - 1) / 24
    for node_id in nodes_of(prompt, "PrimitiveFloat"):
        if any(f["inputs"].get("expression") == GUIDE_EXPRESSION for f in _feeds(prompt, node_id)):
            scaled = float(prompt[node_id]["inputs"]["value"]) * seconds / old
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


def run_template(env: H3Env, name: str, *, turbo: bool) -> tuple[object, dict, dict]:
    _, seconds, frames = TEMPLATES[name]
    prompt = ui_to_api(load_template(name), env.registry)
    add_input_images(env, prompt)
    changed = fit_to_tiny(prompt, seconds, frames, turbo=turbo)
    result = env.run(prompt)
    (save,) = nodes_of(prompt, "SaveVideo")
    return result, mp4_streams(env.output_file(result, save)), changed


@pytest.mark.parametrize("name", list(TEMPLATES), ids=lambda n: n[len("video_minimax_h3_"):-len(".json")])
def test_templates_convert_and_validate_unchanged(env, name):
    prompt = ui_to_api(load_template(name), env.registry)
    add_input_images(env, prompt)
    validated = env.validate(prompt)
    assert nodes_of(prompt, "SaveVideo")[0] in validated.outputs
    loaders = {prompt[n]["inputs"]["clip_name"] for n in nodes_of(prompt, "CLIPLoader")}
    assert loaders == {TEXT_ENCODER}
    assert {prompt[n]["inputs"]["type"] for n in nodes_of(prompt, "CLIPLoader")} == {"minimax"}
    unets = {prompt[n]["inputs"]["unet_name"] for n in nodes_of(prompt, "UNETLoader")}
    assert all(u.endswith("_pruned_int8_convrot.safetensors") and (env.paths.models / "diffusion_models" / u).is_file()
               for u in unets)


def _without_named_widgets(workflow: dict) -> dict:
    stripped = json.loads(json.dumps(workflow))
    graphs = [stripped] + list(stripped.get("definitions", {}).get("subgraphs", []))
    for graph in graphs:
        for node in graph.get("nodes", []):
            node.pop("widgets_values_named", None)
    return stripped


@pytest.mark.parametrize("name", list(TEMPLATES), ids=lambda n: n[len("video_minimax_h3_"):-len(".json")])
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


@pytest.mark.parametrize("turbo", [False, True], ids=["base", "turbo"])
@pytest.mark.parametrize("name", list(TEMPLATES), ids=lambda n: n[len("video_minimax_h3_"):-len(".json")])
def test_template_runs_end_to_end_on_released_formats(env, name, turbo):
    generator, _, frames = TEMPLATES[name]
    result, streams, changed = run_template(env, name, turbo=turbo)
    assert streams["video_streams"] == 1 and streams["frames"] == frames and streams["video_codec"] == "h264"
    assert streams["audio_streams"] == 1 and streams["channels"] == 2 and streams["sample_rate"] == 32000
    executed = [row["class_type"] for row in result.profile.values()]
    assert ("LoraLoaderModelOnly" in executed) == turbo
    assert {generator, "UNETLoader", "SamplerCustomAdvanced", "VAEDecode", "VAEDecodeAudio"} <= set(executed)
    if name == MULTIFRAME:
        assert executed.count("MiniMaxH3AddGuide") == 3
    if name in (I2V, I2V_CONTINUATION, R2V, MULTIFRAME):
        assert "LoadImage" in executed
    if name in (T2V, R2V):
        # The text encoder saw the reference pictures: one block of picture tokens (tag 0) per picture.
        tags = encoded_tags(env)
        blocks = int(((tags[1:] == 0) & (tags[:-1] == 1)).sum()) + int(tags[0] == 0)
        assert blocks == (2 if name == R2V else 0)
    assert all(key.endswith((".megapixels", ".value")) for key in changed)
