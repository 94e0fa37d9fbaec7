"""PDD output-head banks: one H3 output head per interval of the flow's time, blended per sampler step.

Alibaba PAI's MiniMax-H3 "Acc" adapters (Parallel Decoding Distillation, 8 steps; released as
alibaba-pai/MiniMax-H3-Acc-LoRAs, `MiniMax-H3-FL2VA-Acc-8Step.safetensors` and
`MiniMax-H3-Ref2VA-Acc-8Step.safetensors`) pair a backbone LoRA with a bank of N = 32 output heads.
ComfyUI loads them since v0.35 (Comfy-Org/ComfyUI PR 15908) through its stock LoRA loaders
(`LoraLoaderModelOnly`, `LoraLoader`; no node of their own), from files converted to its key names:

  diffusion_model.blocks.N...lora_A.weight / lora_B.weight   the backbone LoRA
  diffusion_model.final_layer.video_out.set_weight           (N * 96, hidden): the video bank
  diffusion_model.final_layer.video_out.set_bias             (N * 96,)
  diffusion_model.final_layer.audio_out.set_weight / set_bias (N * 32, hidden) and (N * 32,)

with `pdd_num_steps` (32) in the file's metadata. Weft reads that layout under the same loaders
(models/adapters/adapter.py sends a `set_weight` whose rows are a multiple of the head's to the model's
bank, not to its weight). The original release stores its LoRA half in diffusers' names; where its bank
sits in that file was not established from public sources, so only the converted layout is read.

The bank's row block 0 is a whole head and blocks 1..N-1 are offsets from it (head k = block 0 + block k,
head 0 = block 0). Interval k covers the unshifted flow time [k / N, (k + 1) / N). A sampler step from the
video noise level sigma to sigma_next covers the intervals start = round(N * (1 - u(sigma))) to stop =
round(N * (1 - u(sigma_next))) (at least one, start below N), u undoing the video shift: u(s) = s / (shift
+ s (1 - shift)). The step uses the mean of those heads weighted by how much of the stream's own shifted
time each interval spans: grid g_j = 1 - j / N, the stream's sigma at it g_j' = f g_j / (1 + (f - 1) g_j)
with f the stream's shift (video or audio), dt_j = g_j' - g_(j+1)'. With the `simple` schedule at 8 steps
and shifts 12 / 3, every step covers 4 whole intervals, as the adapter was trained.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch

PDD_METADATA = "pdd_num_steps"  # the file's count of heads, when it says


@dataclass(frozen=True)
class SamplerStep:
    """The step a sampler is taking: from the video noise level `sigma` to `sigma_next`, and the two shifts."""

    sigma: float
    sigma_next: float
    video_shift: float
    audio_shift: float


_step: contextvars.ContextVar[SamplerStep | None] = contextvars.ContextVar("weft_h3_sampler_step", default=None)


@contextlib.contextmanager
def sampler_step(step: SamplerStep) -> Iterator[None]:
    """Say which step the model calls inside the block belong to (the sampler sets it around each call)."""
    token = _step.set(step)
    try:
        yield
    finally:
        _step.reset(token)


def current_step() -> SamplerStep | None:
    """The step the running model call belongs to, or None outside a sampler."""
    return _step.get()


def _unshifted(sigma: float, shift: float) -> float:
    return sigma / (shift + sigma * (1.0 - shift))


def interval_weights(heads: int, step: SamplerStep, stream_shift: float) -> tuple[int, torch.Tensor]:
    """(first interval, float64 weights summing to 1) of the intervals `step` covers, for a stream of `stream_shift`."""
    start = round((1.0 - _unshifted(step.sigma, step.video_shift)) * heads)
    stop = round((1.0 - _unshifted(step.sigma_next, step.video_shift)) * heads)
    start = min(start, heads - 1)
    stop = max(stop, start + 1)
    grid = torch.linspace(1.0, 0.0, heads + 1, dtype=torch.float64)
    shifted = stream_shift * grid / (1.0 + (stream_shift - 1.0) * grid)
    dt = (shifted[:-1] - shifted[1:])[start:stop]
    return start, dt / dt.sum()


def blended_head(bank_weight: torch.Tensor, bank_bias: torch.Tensor | None, heads: int, step: SamplerStep,
                 stream_shift: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (weight, bias) one step uses from a bank of `heads` heads (rows: block 0 whole, others offsets)."""
    start, weights = interval_weights(heads, step, stream_shift)
    rows = bank_weight.reshape(heads, -1, bank_weight.shape[-1])
    offsets = weights.to(rows.dtype)
    # Head k = block 0 + block k, and the weights sum to 1: the mean is block 0 plus the weighted offsets.
    weight = rows[0] + torch.einsum("k,koi->oi", offsets, rows[start:start + len(offsets)]) - \
        (offsets[0] * rows[0] if start == 0 else 0)
    bias = None
    if bank_bias is not None:
        brows = bank_bias.reshape(heads, -1)
        bias = brows[0] + offsets @ brows[start:start + len(offsets)] - (offsets[0] * brows[0] if start == 0 else 0)
    return weight, bias
