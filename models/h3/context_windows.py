"""Context windows: the sampler runs the H3 transformer over overlapping windows of latent frames and blends them.

A clip longer than the model was trained on (or than memory allows in one pass) is denoised window by window:
at every step each window's video frames and the audio frames of the same stretch of time go through the
model as one shorter clip, and each frame's velocity is the weighted mean of the velocities of the windows
that hold it. The model's activations then scale with the window, not with the clip; only latent-sized
tensors (the state, the noise, the blended velocity) span the whole clip.

How a window is laid out for H3:
- Picture: the window's latent frames (`plan_windows`, ComfyUI's four context schedules). A window that does
  not start at frame 0 may carry the frame before it as well (`causal_window_fix`), and frames listed in
  `latent_retain` ride in every window; their velocities are dropped, they only give the window context.
- Sound: every audio latent frame whose 25 ms overlaps the time of one of the window's picture frames
  (`audio_frames_for`; the last picture frame also takes any audio left after it).
- Time: every target row keeps the rotary time it has in the whole clip (`packing.TargetWindow`), so sound
  and picture stay aligned to the audio frame, and a guide pinned at frame n sits at frame n in every window.
- Guides (keyframes) go into the windows whose time span they overlap, and into every window when one of
  the latent frames they cover is listed in `cond_retain`; references go into every window; per-row noise
  masks are cut to the window's rows.

Blending (`fuse_weights`): flat, pyramid, relative (pyramid-like weights from each frame's distance to
the window's centre) and overlap-linear (ramps over the overlap only). Each frame's blended velocity is
sum(w * v) / sum(w) over the windows holding it; the sound uses the same method over its own window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterable

import torch

from models.h3 import packing
from models.h3.latents import CLIP_LATENTS, pixel_frames

# Option of a diffusion-model handle: the ContextWindowSettings its sampling runs with.
CONTEXT_WINDOWS = "context_windows"
VIDEO_TIME_DIM = 2  # the H3 video latent is (B, C, T, H, W)


class ContextSchedule(StrEnum):
    """How windows are placed over the frames. The values are ComfyUI's names."""

    STATIC_STANDARD = "standard_static"     # the same overlapping windows at every step, the last one flush with the end
    UNIFORM_STANDARD = "standard_uniform"   # windows shifted a little at every step; none wraps past the end
    UNIFORM_LOOPED = "looped_uniform"       # as above, windows may wrap from the end back to the start
    BATCHED = "batched"                     # back-to-back windows without overlap


class FuseMethod(StrEnum):
    """How the windows holding a frame are weighed against each other. The values are ComfyUI's names."""

    PYRAMID = "pyramid"
    RELATIVE = "relative"
    FLAT = "flat"
    OVERLAP_LINEAR = "overlap-linear"


@dataclass(frozen=True)
class ContextWindowSettings:
    """What ContextWindowsManual chose; frame counts are latent frames of the video."""

    context_length: int = 16                 # frames per window
    context_overlap: int = 4                 # frames two neighbouring windows share
    schedule: ContextSchedule = ContextSchedule.STATIC_STANDARD
    stride: int = 1                          # uniform schedules: also windows whose frames are 2, 4, ... apart
    closed_loop: bool = False                # looped schedule: windows also wrap from the end to the start
    fuse: FuseMethod = FuseMethod.PYRAMID
    freenoise: bool = False                  # reuse shuffled noise of the previous window (FreeNoise)
    cond_retain: tuple[int, ...] = ()        # guides covering these latent frames go into every window
    latent_retain: tuple[int, ...] = ()      # these latent frames ride in every window as context
    causal_window_fix: bool = True           # a window not starting at frame 0 carries the frame before it
    split_conds_to_windows: bool = False     # several conditioning entries: each window takes one by position

    def __post_init__(self) -> None:
        if self.context_length < 1:
            raise ValueError(f"context_length must be at least 1, got {self.context_length}")
        if not 0 <= self.context_overlap < self.context_length:
            raise ValueError(f"context_overlap must be at least 0 and less than context_length "
                             f"({self.context_length}), got {self.context_overlap}")
        if self.stride < 1:
            raise ValueError(f"context_stride must be at least 1, got {self.stride}")


def parse_index_list(text: str) -> tuple[int, ...]:
    """'0, 5, 9' -> (0, 5, 9); empty text -> (). ValueError for anything but non-negative integers."""
    found = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"{part!r} is not a latent frame index; write non-negative integers separated by commas")
        found.append(int(part))
    return tuple(found)


# Schedules -----------------------------------------------------------------------------------------

def bit_reversed_fraction(step: int) -> float:
    """`step`'s 64 bits read backwards as a binary fraction: 0, 1/2, 1/4, 3/4, 1/8, ... for steps 0, 1, 2, ...

    Uniform schedules shift their windows by this share of the clip, so successive steps put the window
    seams in ever new places.
    """
    reversed_bits = 0
    for bit in range(64):
        if step >> bit & 1:
            reversed_bits |= 1 << (63 - bit)
    return reversed_bits / float(1 << 64)


def _uniform_windows(frames: int, s: ContextWindowSettings, step: int, *, closed: bool,
                     must_fit: bool) -> list[list[int]]:
    # Windows of frames 1, 2, 4, ... apart (up to `stride` kinds), all moved along by the step's share of
    # the clip and taken modulo the clip. `closed`: they run on through the end back to the start.
    # `must_fit`: a spacing whose window is longer than the clip is skipped (it could only wrap).
    levels = min(s.stride, int(math.ceil(math.log2(frames / s.context_length))) + 1)
    shift = bit_reversed_fraction(step)
    windows = []
    for level in range(levels):
        spacing = 1 << level
        if must_fit and (s.context_length - 1) * spacing + 1 > frames:
            break
        pad = int(round(frames * shift))
        first = int(shift * spacing) + pad
        last = frames + pad - (0 if closed else s.context_overlap)
        for start in range(first, last, s.context_length * spacing - s.context_overlap):
            windows.append([k % frames for k in range(start, start + s.context_length * spacing, spacing)])
    return windows


def _unwrap(windows: list[list[int]], frames: int, context_length: int) -> list[list[int]]:
    # A window that runs past the last frame and wraps to the start is moved back so it ends on the last
    # frame; when the window after it then misses the frame the wrap started from, a window starting there is
    # added. Repeated windows are dropped.
    result: list[list[int]] = []
    index = 0
    while index < len(windows):
        window = windows[index]
        wrap_at = next((i for i in range(1, len(window)) if window[i] < window[i - 1]), None)
        if wrap_at is not None:
            wrapped_to = window[wrap_at]
            relative = [(k - window[0]) % frames for k in window]
            window = [k + frames - 1 - relative[-1] for k in relative]
            windows[index] = window
            following = windows[(index + 1) % len(windows)]
            if wrapped_to not in following:
                windows.insert(index + 1, list(range(wrapped_to, wrapped_to + context_length)))
        if window not in result:
            result.append(window)
        index += 1
    return result


def plan_windows(settings: ContextWindowSettings, frames: int, step: int = 0) -> list[list[int]]:
    """The windows (lists of latent frame indices) for a clip of `frames` latent frames at sampling step `step`."""
    s = settings
    if frames <= s.context_length:
        return [list(range(frames))]
    if s.schedule is ContextSchedule.BATCHED:
        return [list(range(start, min(start + s.context_length, frames)))
                for start in range(0, frames, s.context_length)]
    if s.schedule is ContextSchedule.STATIC_STANDARD:
        windows = []
        for start in range(0, frames, s.context_length - s.context_overlap):
            if start + s.context_length >= frames:
                windows.append(list(range(frames - s.context_length, frames)))
                break
            windows.append(list(range(start, start + s.context_length)))
        return windows
    if s.schedule is ContextSchedule.UNIFORM_LOOPED:
        return _uniform_windows(frames, s, step, closed=s.closed_loop, must_fit=False)
    return _unwrap(_uniform_windows(frames, s, step, closed=False, must_fit=True), frames, s.context_length)


# Blending weights -----------------------------------------------------------------------------------

def fuse_weights(method: FuseMethod, window: list[int], total: int, overlap: int) -> torch.Tensor:
    """float32 weight of each position of `window` (frame indices into a stream of `total` frames)."""
    length = len(window)
    if method is FuseMethod.FLAT:
        return torch.ones(length)
    if method is FuseMethod.PYRAMID:
        # 1, 2, ..., peak, ..., 2, 1: a frame counts more the further it is from the window's edges.
        return torch.tensor([float(min(i + 1, length - i)) for i in range(length)])
    if method is FuseMethod.RELATIVE:
        first, last = window[0], window[-1]
        centre, half = (first + last) / 2.0, (last - first + 1e-2) / 2.0
        return torch.tensor([max(1e-2, 1.0 - abs(k - centre) / half) for k in window])
    weights = torch.ones(length)
    if overlap > 0:
        # Ramps over the overlap only, at the sides where another window takes over; a tiny floor keeps
        # every frame's total weight above zero.
        ramp = torch.linspace(1e-37, 1.0, min(overlap, length))
        if min(window) > 0:
            weights[:ramp.numel()] = ramp
        if max(window) < total - 1:
            weights[length - ramp.numel():] = ramp.flip(0)
    return weights


# Sound aligned to picture ----------------------------------------------------------------------------

def audio_frames_for(video_frames: list[int], latent_t: int, audio_t: int) -> list[int]:
    """The audio latent frames (sorted) that share time with the given video latent frames.

    Audio frame j covers clock units [j, j + 1); video latent k covers packing.frame_clock_span(k). The first
    video frame also takes any audio before it and the last one any audio after it, so the windows of a
    clip together hold every audio frame.
    """
    chosen: set[int] = set()
    for k in video_frames:
        start, stop = packing.frame_clock_span(k)
        first = 0 if k == 0 else int(math.floor(start + 1e-9))
        end = audio_t if k == latent_t - 1 else int(math.ceil(stop - 1e-9))
        chosen.update(range(max(first, 0), min(end, audio_t)))
    return sorted(chosen)


@dataclass
class Window:
    """One context window as the model runs it.

    `video` / `audio`: the clip frames whose velocities this window contributes, in blending order (video
    may repeat a frame in a looped schedule). `model_video`: the sorted distinct video frames the model sees,
    which adds any anchor or retained frames; `audio` is what the model hears.
    """

    video: list[int]
    audio: list[int]
    model_video: list[int] = field(default_factory=list)

    @property
    def target(self) -> packing.TargetWindow:
        """The frames as the transformer's target_window."""
        return packing.TargetWindow(tuple(self.model_video), tuple(self.audio))


def plan(settings: ContextWindowSettings, latent_t: int, audio_t: int, step: int = 0) -> list[Window]:
    """Every window of one sampling step, with its sound and the frames the model sees."""
    windows = []
    for frames in plan_windows(settings, latent_t, step):
        extra = set(k for k in settings.latent_retain if 0 <= k < latent_t)
        if settings.causal_window_fix and frames[0] > 0:
            extra.add(frames[0] - 1)
        audio = audio_frames_for(sorted(set(frames)), latent_t, audio_t)
        windows.append(Window(frames, audio, sorted(set(frames) | extra)))
    return windows


def _keyframe_span(item: packing.ConditionItem) -> tuple[float, float]:
    start = packing.FRAME_UNITS * item.frame_index
    picture = packing.video_span(item.video.shape[1]) if item.video is not None else 0.0
    sound = float(item.audio.shape[-1]) if item.audio is not None else 0.0
    return start, start + max(picture, sound, 1e-6)


def _keyframe_latents(item: packing.ConditionItem) -> set[int]:
    # The clip's latent frames the guide's picture covers (pixel frames frame_index .. frame_index + n - 1).
    count = pixel_frames(item.video.shape[1]) if item.video is not None else 1
    covered = range(item.frame_index, item.frame_index + count)
    found, pixel, latent = set(), 0, 0
    while pixel <= covered.stop - 1:
        width = 1 if latent % CLIP_LATENTS == 0 else 4
        if pixel + width > covered.start:
            found.add(latent)
        pixel += width
        latent += 1
    return found


def window_conditions(items: list[packing.ConditionItem], video_frames: Iterable[int],
                      cond_retain: tuple[int, ...] = ()) -> list[packing.ConditionItem]:
    """The condition items a window whose model sees `video_frames` keeps: every reference, and the guides
    that share time with one of those frames or cover a frame of `cond_retain`."""
    spans = [packing.frame_clock_span(k) for k in sorted(set(video_frames))]
    kept = []
    for item in items:
        if item.role is not packing.ConditionRole.KEYFRAME:
            kept.append(item)
            continue
        start, stop = _keyframe_span(item)
        if any(start < span_stop and span_start < stop for span_start, span_stop in spans) or (
                cond_retain and _keyframe_latents(item) & set(cond_retain)):
            kept.append(item)
    return kept


# Noise --------------------------------------------------------------------------------------------

def _shuffle_forward(noise: torch.Tensor, dim: int, length: int, overlap: int, seed: int) -> torch.Tensor:
    # After each window, the frames that only the next window holds take a random permutation of this
    # window's first frames, so windows start from related noise (FreeNoise).
    generator = torch.Generator("cpu").manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    total = noise.shape[dim]
    advance = length - overlap
    if advance <= 0:
        return noise
    for start in range(0, total - length, advance):
        target = start + length
        count = min(advance, total - target)
        if count <= 0:
            break
        source = torch.randperm(count, generator=generator) + start
        noise.narrow(dim, target, count).copy_(noise.index_select(dim, source))
    return noise


def freenoise(noise_video: torch.Tensor, noise_audio: torch.Tensor, settings: ContextWindowSettings,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both streams' starting noise with FreeNoise's shuffle applied; the sound uses windows of the same duration."""
    latent_t, audio_t = noise_video.shape[VIDEO_TIME_DIM], noise_audio.shape[-1]
    video = _shuffle_forward(noise_video.clone(), VIDEO_TIME_DIM, settings.context_length, settings.context_overlap,
                             seed)
    ratio = audio_t / latent_t if latent_t else 1.0
    audio = _shuffle_forward(noise_audio.clone(), noise_audio.dim() - 1, max(round(settings.context_length * ratio), 1),
                             max(round(settings.context_overlap * ratio), 0), seed)
    return video, audio


# The windowed model call ----------------------------------------------------------------------------

@dataclass
class Conditioning:
    """One conditioning entry as the model takes it: hidden states, their mask and tags, per-batch items."""

    hidden: torch.Tensor
    context_mask: torch.Tensor | None
    context_tags: torch.Tensor | None
    items: list[list[packing.ConditionItem]]


def region_of(window: list[int], total: int, regions: int) -> int:
    """Which of `regions` equal stretches of the clip the window's centre falls in."""
    centre = (min(window) + max(window)) / (2.0 * total)
    return min(max(int(centre * regions), 0), regions - 1)


class WindowedModel:
    """Calls a model (H3Transformer, a handle, a guided model) window by window and blends the velocities.

    `entries`: the conditioning entries; with split_conds_to_windows each window takes the entry of its
    region of the clip, otherwise the first.
    """

    def __init__(self, model: Callable, settings: ContextWindowSettings, entries: list[Conditioning]) -> None:
        self.model = model
        self.settings = settings
        self.entries = entries

    def applies(self, latent_t: int) -> bool:
        """True when the clip is longer than one window (otherwise the model runs once, as without windows)."""
        return latent_t > self.settings.context_length

    def __call__(self, step: int, video: torch.Tensor, audio: torch.Tensor, sigma_video: float, sigma_audio: float,
                 *, video_mask: torch.Tensor | None, audio_mask: torch.Tensor | None, condition_seed: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Blended velocities (float32, on the CPU) for the whole clip (video (B, 24, T, H, W), audio (B, 32, 2, Ta))."""
        s = self.settings
        latent_t, audio_t = video.shape[VIDEO_TIME_DIM], audio.shape[-1]
        clip_size = (latent_t, video.shape[3], video.shape[4])
        windows = plan(s, latent_t, audio_t, step)
        sum_v = torch.zeros(video.shape, dtype=torch.float32)
        sum_a = torch.zeros(audio.shape, dtype=torch.float32)
        weight_v = torch.zeros(latent_t, dtype=torch.float32)
        weight_a = torch.zeros(audio_t, dtype=torch.float32)
        audio_overlap = max(round(s.context_overlap * audio_t / latent_t), 0)
        for window in windows:
            entry = self.entries[region_of(window.video, latent_t, len(self.entries))
                                 if s.split_conds_to_windows and len(self.entries) > 1 else 0]
            seen = torch.tensor(window.model_video)
            heard = torch.tensor(window.audio, dtype=torch.long)
            items = [window_conditions(batch_items, window.model_video, s.cond_retain) for batch_items in entry.items]
            v, a = self.model(
                video.index_select(VIDEO_TIME_DIM, seen).to(device), audio.index_select(-1, heard).to(device),
                entry.hidden.to(device), sigma_video, sigma_audio,
                context_mask=entry.context_mask.to(device) if entry.context_mask is not None else None,
                conditions=items,
                video_mask=video_mask.index_select(1, seen) if video_mask is not None else None,
                audio_mask=audio_mask.index_select(1, heard) if audio_mask is not None else None,
                condition_seed=condition_seed, target_window=window.target, clip_size=clip_size,
                **({} if entry.context_tags is None else {"context_tags": entry.context_tags}))
            v, a = v.float().cpu(), a.float().cpu()
            if len(windows) == 1 and window.video == window.model_video == list(range(latent_t)):
                return v, a  # one window holding the whole clip in order: its velocities as they are
            # Rows of the model's output for each blended frame (the model saw distinct frames in order).
            row_of = {k: row for row, k in enumerate(window.model_video)}
            rows = torch.tensor([row_of[k] for k in window.video])
            frames = torch.tensor(window.video)
            w_v = fuse_weights(s.fuse, window.video, latent_t, s.context_overlap)
            w_a = fuse_weights(s.fuse, window.audio, audio_t, audio_overlap)
            sum_v.index_add_(VIDEO_TIME_DIM, frames, v.index_select(VIDEO_TIME_DIM, rows) * w_v.view(1, 1, -1, 1, 1))
            weight_v.index_add_(0, frames, w_v)
            sum_a.index_add_(audio.dim() - 1, heard, a * w_a)
            weight_a.index_add_(0, heard, w_a)
        for stream, weights in (("video", weight_v), ("audio", weight_a)):
            missing = (weights <= 0).nonzero().flatten().tolist()
            if missing:
                raise ValueError(f"the context windows leave {stream} latent frames {missing[:8]} uncovered; "
                                 "use a larger context_length or another context_schedule")
        return sum_v / weight_v.view(1, 1, -1, 1, 1), sum_a / weight_a


def settings_of(model: Any) -> ContextWindowSettings | None:
    """The context-window settings a MODEL handle (or a model wrapping one in `.handle`) carries, or None."""
    handle = getattr(model, "handle", model)
    settings = getattr(handle, "options", {}).get(CONTEXT_WINDOWS)
    return settings if isinstance(settings, ContextWindowSettings) else None
