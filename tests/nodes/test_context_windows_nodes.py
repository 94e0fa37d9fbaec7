"""ContextWindowsManual: its ComfyUI interface, its refusals, and the bundled windowed workflow on the tiny models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from execution.convert import ui_to_api
from execution.errors import PromptError
from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths is a fixture)
    H3Env, configured_paths, install, mp4_streams, tiny_weights,
)

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "workflows" / "h3_context_windows.json"


@pytest.fixture
def env(registry, tmp_path, tmp_path_factory, configured_paths):
    install(tiny_weights(tmp_path_factory), tmp_path)
    h3 = H3Env(registry, tmp_path)
    configured_paths(h3.paths)
    return h3


def _prompt(env) -> dict:
    return ui_to_api(json.loads(WORKFLOW.read_text(encoding="utf-8")), env.registry)


def _node(prompt: dict, class_type: str) -> str:
    (found,) = [key for key, node in prompt.items() if node["class_type"] == class_type]
    return found


def test_the_node_has_comfyuis_inputs_defaults_and_choices(registry):
    spec = registry.get("ContextWindowsManual")
    inputs = {i.name: i for i in spec.inputs}
    assert list(inputs) == ["model", "context_length", "context_overlap", "context_schedule", "context_stride",
                            "closed_loop", "fuse_method", "dim", "freenoise", "cond_retain_index_list",
                            "split_conds_to_windows", "latent_retain_index_list", "causal_window_fix"]
    defaults = {name: i.options.get("default") for name, i in inputs.items() if name != "model"}
    assert defaults == {"context_length": 16, "context_overlap": 4, "context_schedule": "standard_static",
                        "context_stride": 1, "closed_loop": False, "fuse_method": "pyramid", "dim": 0,
                        "freenoise": False, "cond_retain_index_list": "", "split_conds_to_windows": False,
                        "latent_retain_index_list": "", "causal_window_fix": True}
    assert inputs["context_schedule"].choices == ["standard_static", "standard_uniform",
                                                             "looped_uniform", "batched"]
    assert inputs["fuse_method"].choices == ["pyramid", "relative", "flat", "overlap-linear"]
    assert [o.type for o in spec.outputs] == ["MODEL"] and spec.category == "model_patches"


@pytest.mark.parametrize("change, words", [
    ({"dim": 0}, ["'dim'", "set dim to 2"]),
    ({"context_overlap": 12}, ["'context_overlap'", "smaller than context_length"]),
    ({"cond_retain_index_list": "0, first"}, ["'cond_retain_index_list'", "'first'"]),
])
def test_settings_that_cannot_window_an_h3_latent_are_refused_naming_the_input(env, change, words):
    prompt = _prompt(env)
    prompt[_node(prompt, "ContextWindowsManual")]["inputs"].update(change)
    with pytest.raises(PromptError) as info:
        env.validate(prompt)
    message = json.dumps(info.value.to_json())
    assert "ContextWindowsManual" in message and all(word in message for word in words), message


def test_the_bundled_windowed_workflow_runs_on_the_tiny_models(env):
    prompt = _prompt(env)
    latent_node = prompt[_node(prompt, "EmptyMiniMaxH3LatentAV")]["inputs"]
    windows_node = prompt[_node(prompt, "ContextWindowsManual")]["inputs"]
    assert windows_node["context_length"] < (latent_node["length"] - 5) // 17 * 5 + 2  # longer than one window
    prompt[_node(prompt, "BasicScheduler")]["inputs"]["steps"] = 2  # the suite's time; the graph is as shipped
    result = env.run(prompt)
    streams = mp4_streams(env.output_file(result, _node(prompt, "SaveVideo")))
    assert streams["frames"] == latent_node["length"] == 73
    assert streams["audio_codec"] == "aac" and streams["channels"] == 2
    assert abs(streams["audio_seconds"] - 73 / 24) < 0.05
    assert {"ContextWindowsManual", "SamplerCustomAdvanced"} <= {row["class_type"] for row in result.profile.values()}


def test_the_node_returns_a_new_model_carrying_the_settings_and_the_shifts(registry, env):
    from models.h3.context_windows import CONTEXT_WINDOWS, ContextSchedule, FuseMethod
    from models.h3.transformer import TINY_CONFIG, H3Transformer
    from models.patcher import ModelHandle
    from nodes.loaders import with_options

    base = with_options(ModelHandle(H3Transformer(TINY_CONFIG)), h3_shifts=(5.0, 2.0))
    spec = registry.get("ContextWindowsManual")
    (model,) = spec.execute(base, 9, 3, "looped_uniform", 2, True, "overlap-linear", 2, True, "0", False, "1, 2",
                            False)
    settings = model.options[CONTEXT_WINDOWS]
    assert (settings.context_length, settings.context_overlap, settings.stride) == (9, 3, 2)
    assert settings.schedule is ContextSchedule.UNIFORM_LOOPED and settings.fuse is FuseMethod.OVERLAP_LINEAR
    assert settings.closed_loop and settings.freenoise and not settings.causal_window_fix
    assert settings.cond_retain == (0,) and settings.latent_retain == (1, 2)
    assert model.h3_shifts == (5.0, 2.0) and model.base is base.base and CONTEXT_WINDOWS not in base.options


def test_ksampler_with_cfg_samples_a_windowed_model_and_each_window_keeps_the_negative_guides_it_covers(registry):
    from models.h3 import empty_latent
    from models.h3.transformer import TINY_CONFIG, H3Transformer
    from models.patcher import ModelHandle

    torch.manual_seed(0)
    transformer = H3Transformer(TINY_CONFIG).eval()
    latent = empty_latent(32, 32, 56)                                   # 17 latent frames
    guide = {"frame_index": 50, "latent": torch.randn(1, 24, 1, 2, 2), "audio_latent": None}
    positive = [[torch.randn(1, 4, TINY_CONFIG.text_dim), {}]]
    negative = [[torch.randn(1, 3, TINY_CONFIG.text_dim), {"keyframes": [guide]}]]
    seen = []
    forward = transformer.forward

    def recording(video, audio, *args, conditions=None, **kwargs):
        seen.append((video.shape[2], args[0].shape[1], [item.frame_index for item in conditions[0]]))
        return forward(video, audio, *args, conditions=conditions, **kwargs)

    transformer.forward = recording
    (windowed,) = registry.get("ContextWindowsManual").execute(ModelHandle(transformer), 6, 2, "standard_static", 1,
                                                                False, "pyramid", 2, False, "", False, "", True)
    (out,) = registry.get("KSampler").execute(windowed, 1, 1, 2.0, "euler", "simple", positive, negative, latent, 1.0)
    assert out["samples"].shape == latent["samples"].shape and torch.isfinite(out["samples"]).all()
    positive_calls = [call for call in seen if call[1] == 4]
    negative_calls = [call for call in seen if call[1] == 3]
    assert len(positive_calls) == len(negative_calls) == 4 and all(call[0] <= 7 for call in seen)
    assert [bool(call[2]) for call in negative_calls] == [False, False, False, True]  # only the last window covers 50
    assert not any(call[2] for call in positive_calls)
