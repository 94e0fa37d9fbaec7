"""PDD adapters (a backbone LoRA plus a bank of output heads, ComfyUI's converted layout) on the tiny H3 DiT.

The oracle for a model call inside a sampler step is the same model with the same backbone LoRA and plain
`set_weight` / `set_bias` replacements of its two heads by the mean of the bank's heads the step covers,
computed here from the rule written out in models/h3/pdd.py.
"""
from __future__ import annotations

import pytest
import torch

from models.adapters import load_adapter
from models.h3 import pdd, sampling
from models.h3.make_tiny import build_tiny
from models.patcher import ModelHandle
from tests.models.adapters.helpers import rand, write_adapter

HEADS = 4


def _mean_head(rows: torch.Tensor, heads: int, step: pdd.SamplerStep, shift: float) -> torch.Tensor:
    """The dt-weighted mean of whole heads (block 0, block 0 + block k) over the intervals `step` covers."""
    blocks = rows.reshape(heads, -1, *rows.shape[1:]).double()
    whole = [blocks[0]] + [blocks[0] + blocks[k] for k in range(1, heads)]
    unshift = lambda s: s / (step.video_shift + s * (1 - step.video_shift))  # noqa: E731
    start = min(round((1 - unshift(step.sigma)) * heads), heads - 1)
    stop = max(round((1 - unshift(step.sigma_next)) * heads), start + 1)
    sigma_at = lambda j: shift * (1 - j / heads) / (1 + (shift - 1) * (1 - j / heads))  # noqa: E731
    dts = [sigma_at(j) - sigma_at(j + 1) for j in range(start, stop)]
    return (sum(dt * whole[j] for dt, j in zip(dts, range(start, stop))) / sum(dts)).float()


def _bank_tensors(model):
    video, audio = model.final_layer.video_out, model.final_layer.audio_out
    qkv = model.blocks[0].attn.qkv_proj
    return {
        "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight": rand(4, qkv.in_features, seed=1) * 0.2,
        "diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight": rand(qkv.out_features, 4, seed=2) * 0.2,
        "diffusion_model.final_layer.video_out.set_weight": rand(HEADS * video.out_features, video.in_features, seed=3),
        "diffusion_model.final_layer.video_out.set_bias": rand(HEADS * video.out_features, seed=4),
        "diffusion_model.final_layer.audio_out.set_weight": rand(HEADS * audio.out_features, audio.in_features, seed=5),
        "diffusion_model.final_layer.audio_out.set_bias": rand(HEADS * audio.out_features, seed=6),
    }


def _inputs():
    gen = torch.Generator().manual_seed(5)
    cfg = build_tiny("transformer").config
    return (torch.randn(1, cfg.video_channels, 2, 4, 4, generator=gen), torch.randn(1, cfg.audio_channels, 2, 5, generator=gen),
            torch.randn(1, 3, cfg.text_dim, generator=gen))


def test_eight_simple_steps_at_shift_12_cover_four_of_32_intervals_each():
    schedule = sampling.sigmas(8, shift=12.0).tolist()
    starts = []
    for sigma, sigma_next in zip(schedule[:-1], schedule[1:]):
        start, weights = pdd.interval_weights(32, pdd.SamplerStep(sigma, sigma_next, 12.0, 3.0), 3.0)
        starts.append(start)
        assert len(weights) == 4 and abs(float(weights.sum()) - 1) < 1e-12
    assert starts == [0, 4, 8, 12, 16, 20, 24, 28]


@pytest.mark.parametrize("sigmas", [(0.9, 0.6), (1.0, 0.97), (0.2, 0.0)])
def test_a_model_call_in_a_step_uses_the_mean_of_the_heads_the_step_covers(tmp_path, sigmas):
    model = build_tiny("transformer").float()
    tensors = _bank_tensors(model)
    step = pdd.SamplerStep(*sigmas, 12.0, 3.0)
    bank = load_adapter(write_adapter(tmp_path / "pdd.safetensors", tensors, metadata={"pdd_num_steps": str(HEADS)}))
    oracle_tensors = {k: v for k, v in tensors.items() if ".lora_" in k}
    for head, shift in (("video_out", 12.0), ("audio_out", 3.0)):
        for part in ("weight", "bias"):
            key = f"diffusion_model.final_layer.{head}.set_{part}"
            oracle_tensors[key] = _mean_head(tensors[key], HEADS, step, shift)
    oracle = load_adapter(write_adapter(tmp_path / "oracle.safetensors", oracle_tensors))
    handle = ModelHandle(model).with_adapter(bank, 1.0)
    expected_handle = ModelHandle(model).with_adapter(oracle, 1.0)
    inputs = _inputs()
    with torch.no_grad(), pdd.sampler_step(step):
        got = handle(*inputs, step.sigma, sampling.convert_sigma(step.sigma, 12.0, 3.0))
        merged = handle.merged()(*inputs, step.sigma, sampling.convert_sigma(step.sigma, 12.0, 3.0))
        want = expected_handle(*inputs, step.sigma, sampling.convert_sigma(step.sigma, 12.0, 3.0))
    for a, m, b in zip(got, merged, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m, b, rtol=1e-5, atol=1e-5)


def test_the_bank_needs_a_sampler_step(tmp_path):
    model = build_tiny("transformer").float()
    handle = ModelHandle(model).with_adapter(load_adapter(write_adapter(tmp_path / "pdd.safetensors",
                                                                        _bank_tensors(model))), 1.0)
    with pytest.raises(ValueError, match="sampler"):
        handle(*_inputs(), 0.5, 0.3)


def test_sampling_with_the_bank_runs_and_each_step_uses_its_own_heads(tmp_path):
    model = build_tiny("transformer").float()
    handle = ModelHandle(model).with_adapter(load_adapter(write_adapter(tmp_path / "pdd.safetensors",
                                                                        _bank_tensors(model))), 1.0)
    video, audio, text = _inputs()
    latent = {"samples": torch.zeros_like(video), "audio_samples": torch.zeros_like(audio)}
    conditioning = [[text, {}]]
    seen = []
    original = pdd.blended_head

    def spy(bank_weight, bank_bias, heads, step, shift):
        seen.append(pdd.interval_weights(heads, step, shift)[0])
        return original(bank_weight, bank_bias, heads, step, shift)

    pdd.blended_head, saved = spy, pdd.blended_head
    try:
        out = sampling.sample(handle, latent, conditioning, sampling.sigmas(2, shift=12.0), noise_seed=3)
    finally:
        pdd.blended_head = saved
    assert torch.isfinite(out["samples"]).all() and torch.isfinite(out["audio_samples"]).all()
    assert sorted(set(seen)) == [0, 2]  # two steps of a 4-head bank: intervals 0-1, then 2-3


def test_a_bank_that_disagrees_with_the_file_metadata_is_refused(tmp_path):
    model = build_tiny("transformer").float()
    file = write_adapter(tmp_path / "pdd.safetensors", _bank_tensors(model), metadata={"pdd_num_steps": "32"})
    with pytest.raises(ValueError, match="pdd_num_steps"):
        ModelHandle(model).with_adapter(load_adapter(file), 1.0)
