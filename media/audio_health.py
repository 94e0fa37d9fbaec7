"""The sound check: figures that tell broken sound from sound that is merely quiet or busy.

`check_sound(waveform, sample_rate_hz, video_seconds=...)` looks at one clip (C, S) and returns an
`AudioHealth`: its figures and a warning line for each threshold crossed. It only reads the tensor
(on its own device, in float32) and needs nothing but torch, so every node that writes or previews
sound can run it on what it writes.

Figures and the thresholds that raise a warning (`HealthThresholds`; full scale is 1.0):

| figure | how it is measured | warning when |
|---|---|---|
| `dc_offset` | the largest absolute mean of a channel | above 0.02 (about -34 dBFS) |
| `clipping_ratio` | share of samples at or beyond 0.999 of full scale, every channel counted | above 0.001 (0.1 %) |
| `rms_dbfs` | level of all channels with each channel's mean taken out, in dB of full scale (floor -120) | below -60: `silent` |
| `click_rate_hz` | clicks per second: a click is a sample-to-sample jump of at least 0.02 and at least 8 times the RMS of the jumps around it (its 5 ms block and the blocks either side, the jump itself left out); jumps closer than 2 ms count once | above 0.25 per second |
| `channel_correlation` | Pearson correlation of the first two channels (None for mono or a silent channel) | below -0.5: a channel looks inverted |
| `duration_mismatch_s` | the sound's length minus the pictures' length, when there are pictures | more than 0.1 s either way |
| `nonfinite_samples` | samples that are NaN or infinite (they are read as 0 for the other figures) | any |

The level is taken with the offset removed so that sound made only of an offset (a flat line away from
zero) reads as both offset and silent, which is what it sounds like.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

LEVEL_FLOOR_DBFS = -120.0  # the level reported for digital silence (a finite number keeps the figures JSON)


@dataclass(frozen=True)
class HealthThresholds:
    """Where each figure starts to count as a fault (see the module docstring's table)."""

    max_dc_offset: float = 0.02            # |mean| of a channel, full scale 1.0
    full_scale: float = 0.999              # a sample this loud or louder counts as clipped
    max_clipping_ratio: float = 0.001      # share of clipped samples
    silence_dbfs: float = -60.0            # a level below this is silence
    click_min_jump: float = 0.02           # a jump smaller than this is never a click
    click_jump_factor: float = 8.0         # ... nor one below this many times the local jump RMS
    click_block_s: float = 0.005           # the local jump RMS spans the jump's block of this length and
                                           # its two neighbours
    click_merge_s: float = 0.002           # jumps closer than this are one click
    max_click_rate_hz: float = 0.25        # clicks per second
    min_channel_correlation: float = -0.5  # below this a channel looks inverted
    max_duration_mismatch_s: float = 0.1   # sound vs pictures


DEFAULT_THRESHOLDS = HealthThresholds()


@dataclass(frozen=True)
class AudioHealth:
    """The figures of one clip and the warnings they raised (empty when the sound looks sound)."""

    seconds: float
    sample_rate_hz: int
    channels: int
    dc_offset: float
    peak: float
    clipping_ratio: float
    rms_dbfs: float
    silent: bool
    clicks: int
    click_rate_hz: float
    channel_correlation: float | None
    video_seconds: float | None
    duration_mismatch_s: float | None
    nonfinite_samples: int
    warnings: tuple[str, ...]

    @property
    def healthy(self) -> bool:
        """True when no threshold was crossed."""
        return not self.warnings

    def as_dict(self) -> dict:
        """The figures as plain JSON values, with `healthy` and the warnings as a list."""
        figures = asdict(self)
        figures["warnings"] = list(self.warnings)
        figures["healthy"] = self.healthy
        return figures


def _count_clicks(sound: torch.Tensor, sample_rate_hz: int, limits: HealthThresholds) -> int:
    """Clicks in (C, S): jumps far above the jumps around them, merged when close together."""
    if sound.shape[-1] < 3:
        return 0
    jumps = (sound[:, 1:] - sound[:, :-1]).abs()  # (C, L), L = S - 1
    channels, length = jumps.shape
    # The local level is taken over blocks: a jump's block and the blocks on either side of it, so the
    # cost stays linear in the length and float32 sums stay short.
    block = max(2, int(round(limits.click_block_s * sample_rate_hz)))
    blocks = -(-length // block)
    energy = torch.nn.functional.pad(jumps.square(), (0, blocks * block - length)).view(channels, blocks, block)
    block_energy = torch.nn.functional.pad(energy.sum(dim=-1), (1, 1))  # (C, blocks + 2)
    near_energy = block_energy[:, :-2] + block_energy[:, 1:-1] + block_energy[:, 2:]  # (C, blocks)
    counts = torch.full((blocks,), float(block), device=sound.device)
    counts[-1] = length - (blocks - 1) * block
    counts = torch.nn.functional.pad(counts, (1, 1))
    near_count = counts[:-2] + counts[1:-1] + counts[2:]  # (blocks,)
    # The jump itself is left out of its own level, so a lone click stands out fully.
    local_ms = (near_energy[:, :, None] - energy).clamp(min=0) / (near_count[:, None] - 1).clamp(min=1)
    local_rms = local_ms.sqrt().reshape(channels, -1)[:, :length]
    is_click = (jumps >= limits.click_min_jump) & (jumps >= limits.click_jump_factor * local_rms)
    positions = torch.nonzero(is_click.any(dim=0)).flatten()
    if positions.numel() == 0:
        return 0
    merge = max(1, int(round(limits.click_merge_s * sample_rate_hz)))
    return 1 + int((positions.diff() > merge).sum())


def _correlation(sound: torch.Tensor) -> float | None:
    """Pearson correlation of the first two channels of (C, S) with means removed; None when undefined."""
    if sound.shape[0] < 2 or sound.shape[-1] < 2:
        return None
    left = sound[0] - float(sound[0].mean(dtype=torch.float64))
    right = sound[1] - float(sound[1].mean(dtype=torch.float64))
    scale = math.sqrt(float(left.square().sum(dtype=torch.float64)) * float(right.square().sum(dtype=torch.float64)))
    if scale < 1e-12:
        return None
    return max(-1.0, min(1.0, float((left * right).sum(dtype=torch.float64)) / scale))


def check_sound(waveform: torch.Tensor, sample_rate_hz: int, *, video_seconds: float | None = None,
                limits: HealthThresholds = DEFAULT_THRESHOLDS) -> AudioHealth:
    """The health figures of one clip `waveform` (C, S) at `sample_rate_hz`; `video_seconds` is the length
    of the pictures the sound goes with, when it goes with any."""
    if waveform.dim() != 2:
        raise ValueError(f"a sound to check is (channels, samples); got shape {tuple(waveform.shape)}")
    if sample_rate_hz <= 0:
        raise ValueError(f"the sample rate must be above 0 Hz; got {sample_rate_hz}")
    sound = waveform.detach().float()
    finite = torch.isfinite(sound)
    nonfinite = int(sound.numel() - finite.sum())
    if nonfinite:
        sound = torch.where(finite, sound, torch.zeros((), dtype=sound.dtype, device=sound.device))
    channels, samples = sound.shape
    seconds = samples / sample_rate_hz
    if samples == 0:
        means = torch.zeros(channels)
        peak, clipped, level_dbfs, clicks, correlation = 0.0, 0.0, LEVEL_FLOOR_DBFS, 0, None
    else:
        means = sound.mean(dim=-1, dtype=torch.float64)  # (C,)
        magnitude = sound.abs()
        peak = float(magnitude.max())
        clipped = float((magnitude >= limits.full_scale).sum()) / sound.numel()
        del magnitude
        # Mean square with each channel's mean taken out: E[x^2] - E[x]^2, summed in float64.
        mean_square = float((sound.square().mean(dim=-1, dtype=torch.float64) - means.square()).clamp(min=0).mean())
        level_dbfs = max(LEVEL_FLOOR_DBFS, 10.0 * math.log10(mean_square)) if mean_square > 0 else LEVEL_FLOOR_DBFS
        clicks = _count_clicks(sound, sample_rate_hz, limits)
        correlation = _correlation(sound)
    dc_offset = float(means.abs().max()) if channels else 0.0
    click_rate = clicks / seconds if seconds > 0 else 0.0
    silent = level_dbfs < limits.silence_dbfs
    mismatch = None if video_seconds is None else seconds - float(video_seconds)

    warnings = []
    if nonfinite:
        warnings.append(f"{nonfinite} samples are NaN or infinite")
    if dc_offset > limits.max_dc_offset:
        warnings.append(f"DC offset {dc_offset:.3f} of full scale (above {limits.max_dc_offset:g})")
    if clipped > limits.max_clipping_ratio:
        warnings.append(f"clipping: {clipped:.2%} of samples at full scale (above {limits.max_clipping_ratio:.1%})")
    if silent:
        warnings.append(f"silent: level {level_dbfs:.1f} dBFS (below {limits.silence_dbfs:g} dBFS)")
    if click_rate > limits.max_click_rate_hz:
        warnings.append(f"clicks: {clicks} in {seconds:.2f} s, {click_rate:.2f} per second "
                        f"(above {limits.max_click_rate_hz:g})")
    if correlation is not None and correlation < limits.min_channel_correlation:
        warnings.append(f"channels 1 and 2 correlate at {correlation:.2f}: one looks inverted "
                        f"(below {limits.min_channel_correlation:g})")
    if mismatch is not None and abs(mismatch) > limits.max_duration_mismatch_s:
        longer = "longer" if mismatch > 0 else "shorter"
        warnings.append(f"the sound is {abs(mismatch):.2f} s {longer} than the pictures ({seconds:.2f} s against "
                        f"{float(video_seconds):.2f} s; more than {limits.max_duration_mismatch_s:g} s apart)")
    return AudioHealth(
        seconds=seconds, sample_rate_hz=int(sample_rate_hz), channels=channels, dc_offset=dc_offset, peak=peak,
        clipping_ratio=clipped, rms_dbfs=level_dbfs, silent=silent, clicks=clicks, click_rate_hz=click_rate,
        channel_correlation=correlation, video_seconds=None if video_seconds is None else float(video_seconds),
        duration_mismatch_s=mismatch, nonfinite_samples=nonfinite, warnings=tuple(warnings))
