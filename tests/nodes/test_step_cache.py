"""EasyCache and LazyCache through the executor: ComfyUI's inputs, threshold 0 changes nothing, the defaults
skip steps in the window and report exactly the transformer calls made, and two such patches are refused."""
from __future__ import annotations

import pytest
import torch

from models.h3.transformer import H3Transformer
from tests.nodes.test_h3_nodes import H3Env, configured_paths, h3, probe, t2va_prompt, tiny_weights  # noqa: F401
from web.object_info import object_info


@pytest.fixture
def transformer_sigmas(monkeypatch):
    """The video sigma of every H3 transformer forward made while the test runs, in order."""
    seen: list[float] = []
    forward = H3Transformer.forward

    def counted(self, video, audio, context, sigma_video, *args, **kwargs):
        seen.append(float(sigma_video))
        return forward(self, video, audio, context, sigma_video, *args, **kwargs)

    monkeypatch.setattr(H3Transformer, "forward", counted)
    return seen


def _cached_prompt(node: str | None, *, steps: int, threshold: float = 0.2, start: float = 0.15,
                   end: float = 0.95) -> dict:
    prompt = t2va_prompt(steps=steps, save_video=False)
    del prompt["decode"], prompt["decode_audio"], prompt["probe_frames"], prompt["probe_audio"], prompt["vv"], prompt["av"]
    if node is not None:
        prompt["cache"] = {"class_type": node, "inputs": {"model": ["unet", 0], "reuse_threshold": threshold,
                                                          "start_percent": start, "end_percent": end,
                                                          "verbose": False}}
        prompt["guider"]["inputs"]["model"] = ["cache", 0]
    return prompt


def _sampler_row(result) -> dict:
    return next(row for row in result.profile.values() if row["class_type"] == "SamplerCustomAdvanced")


def test_inputs_defaults_and_outputs_are_comfyuis(registry):
    info = object_info(registry)
    for node in ("EasyCache", "LazyCache"):
        entry = info[node]
        assert entry["category"] == "advanced/debug/model" and entry["output"] == ["MODEL"]
        assert entry["python_module"] == "comfy_extras.nodes_easycache"
        assert entry["input_order"]["required"] == ["model", "reuse_threshold", "start_percent", "end_percent",
                                                    "verbose"]
        required = entry["input"]["required"]
        threshold = required["reuse_threshold"][1]
        assert {key: threshold[key] for key in ("default", "min", "max", "step")} == {
            "default": 0.2, "min": 0.0, "max": 3.0, "step": 0.01}
        assert required["start_percent"][1]["default"] == 0.15 and required["end_percent"][1]["default"] == 0.95
        assert required["verbose"][0] == "BOOLEAN" and required["verbose"][1]["default"] is False


@pytest.mark.parametrize("node", ["EasyCache", "LazyCache"])
def test_threshold_zero_skips_nothing_and_equals_the_unpatched_run_bit_for_bit(h3, node, transformer_sigmas):
    plain = probe(h3.run(_cached_prompt(None, steps=8)), "probe_latent")
    plain_calls = len(transformer_sigmas)
    result = h3.run(_cached_prompt(node, steps=8, threshold=0.0, start=0.0, end=1.0))
    cached = probe(result, "probe_latent")
    assert torch.equal(cached["samples"], plain["samples"])
    assert torch.equal(cached["audio_samples"], plain["audio_samples"])
    assert len(transformer_sigmas) == 2 * plain_calls == 16
    assert _sampler_row(result)["counts"] == {"steps_computed": 8, "steps_skipped": 0, "model_calls": 8}


@pytest.mark.parametrize("node", ["EasyCache", "LazyCache"])
def test_defaults_on_30_steps_compute_the_first_and_last_steps_and_count_the_calls(h3, node, transformer_sigmas):
    texts = []
    h3.events.subscribe(lambda event, data: texts.append(data["text"])
                        if event == "progress_text" and data.get("node") == "sample" else None)
    result = h3.run(_cached_prompt(node, steps=30))
    from models.h3.sampling import sigmas as schedule
    steps = schedule(30, 1.0, 12.0).tolist()[:-1]
    counts = _sampler_row(result)["counts"]
    assert counts["steps_computed"] + counts["steps_skipped"] == 30
    assert counts["steps_skipped"] > 0  # the tiny model's output settles enough for the defaults to skip
    assert counts["model_calls"] == counts["steps_computed"] == len(transformer_sigmas)
    computed = [index for index, sigma in enumerate(steps) if any(abs(sigma - seen) < 1e-6 for seen in transformer_sigmas)]
    assert len(computed) == len(transformer_sigmas)
    assert computed[:5] == [0, 1, 2, 3, 4]  # start_percent 0.15 at shift 12: the first five steps
    assert computed[-1] == 29  # the last step always
    assert texts and f"skipped {counts['steps_skipped']}" in texts[-1] and node in texts[-1]
    latent = probe(result, "probe_latent")
    assert torch.isfinite(latent["samples"]).all() and torch.isfinite(latent["audio_samples"]).all()


def test_easycache_with_guidance_skips_both_calls_of_a_step(h3, transformer_sigmas):
    prompt = _cached_prompt("EasyCache", steps=12, start=0.0)
    prompt["neg"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["clip", 0]}}
    prompt["sample"] = {"class_type": "KSampler", "inputs": {
        "model": ["cache", 0], "seed": 3, "steps": 12, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["text", 0], "negative": ["neg", 0], "latent_image": ["empty", 0], "denoise": 1.0}}
    for name in ("noise", "select", "sched", "guider"):
        del prompt[name]
    result = h3.run(prompt)
    counts = next(row for row in result.profile.values() if row["class_type"] == "KSampler")["counts"]
    assert counts["steps_computed"] + counts["steps_skipped"] == 12
    assert counts["model_calls"] == 2 * counts["steps_computed"] == len(transformer_sigmas)


@pytest.mark.parametrize("first, second", [("EasyCache", "LazyCache"), ("LazyCache", "LazyCache")])
def test_a_second_step_skipping_patch_is_refused_naming_the_node(h3, first, second):
    prompt = _cached_prompt(first, steps=2)
    prompt["cache2"] = {"class_type": second, "inputs": {**prompt["cache"]["inputs"], "model": ["cache", 0]}}
    prompt["guider"]["inputs"]["model"] = ["cache2", 0]
    node_type, message = h3.run_error(prompt)
    assert node_type == second
    assert message.startswith(f"{second}: input 'model' already carries a {first} patch")
