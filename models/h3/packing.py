"""The H3 packed sequence: row layout, 3-axis RoPE positions, patching, condition items and noise-mask reduction.

One forward of the transformer sees one sequence per batch element:

    [text | condition rows (keyframes, then references) | target audio | target video]

- text: one row per token at position (token index, 0, 0). Its rows are tagged text, or each token
  carries its own tag (`text_tags`: the Qwen3-VL encoder tags the tokens of its picture and video
  blocks as video).
- keyframe rows (first/last frame, AddGuide): a guide's video latent cut into 1x2x2 patches on the
  target's spatial grid, followed by its audio latent; both start at rotary time
  `origin + 5/3 * frame_index`.
- reference blocks (ref2va): an image takes one time unit, an audio one unit per latent frame, a video
  (its soundtrack's rows placed before its picture rows) the longer of its two spans. Blocks follow each
  other on the clock from the end of the text, and the targets begin where the last block ends (`origin`).
- target audio: two rows per latent frame, one per stereo lane, every left-lane row before the first
  right-lane row. Time grows by 1 per latent frame; a lane's w is the coordinate of the first (left) or
  the last (right) patch column of the video grid, and h is 0.
- target video: one row per 1x2x2 patch (96 values). A latent frame's time is 5/3 per pixel frame that
  precedes it (a clip's first latent stands for 1 pixel frame, each of its other four for 4); h and w are
  area-normalised patch coordinates.

The clock runs at 40 units per second for every medium: one audio latent frame, or 3/5 of a pixel
frame at 24 fps. Modality tags: video 0, text 1, audio 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import torch

from models.h3.latents import (AUDIO_CHANNELS, CLIP_FRAMES, CLIP_LATENTS, VIDEO_CHANNELS, latent_frames,
                               pixel_frames)

TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2
TOKEN_TAGS_KEY = "token_tags"           # CONDITIONING extras: (B, L) long modality tag per text token
FRAME_UNITS = 5.0 / 3.0                 # clock units per pixel frame (40 units/s at 24 fps)
VIDEO_CONDITION_T = 0.999               # timestep label (and noise level 1 - t) of visual condition rows
AUDIO_CONDITION_T = 1.0                 # audio condition rows are clean
FULL_MASK = 1.0 - 1e-3                  # a noise mask at or above this everywhere means "generate everything"
PATCH = (1, 2, 2)                       # (t, h, w) patch of the video rows
SPATIAL_EXTENT = 32.0                   # area-normalised coordinates span about 32 units


class SegmentRole(StrEnum):
    """What a run of packed rows holds. The values are the role names the layout has always reported."""

    TEXT = "text"
    COND_VIDEO = "cond_video"    # a keyframe's video patches
    COND_AUDIO = "cond_audio"    # a keyframe's audio
    REF_VIDEO = "ref_video"      # a reference image's or video's patches
    REF_AUDIO = "ref_audio"      # a reference audio, or a reference video's soundtrack
    AUDIO = "audio"              # the target audio
    VIDEO = "video"              # the target video

    @property
    def tag(self) -> int:
        """The modality tag of the role's rows."""
        if self is SegmentRole.TEXT:
            return TAG_TEXT
        return TAG_VIDEO if self in (SegmentRole.VIDEO, SegmentRole.COND_VIDEO, SegmentRole.REF_VIDEO) else TAG_AUDIO


class ConditionRole(StrEnum):
    """How a condition item enters the sequence."""

    KEYFRAME = "keyframe"      # pinned to a frame of the target clip
    REFERENCE = "reference"    # a block ahead of the targets on the clock


class ReferenceKind(StrEnum):
    """What a reference is; the values are those of the CONDITIONING extras' "kind"."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


# Patching --------------------------------------------------------------------------------------

def patchify_video(latent: torch.Tensor) -> torch.Tensor:
    """(C, T, H, W) latent -> (T * H/2 * W/2, C * 4) rows in (t, h, w) order; features ordered (c, ph, pw)."""
    c, t, h, w = latent.shape
    x = latent.reshape(c, t, h // 2, 2, w // 2, 2)
    return x.permute(1, 2, 4, 0, 3, 5).reshape(t * (h // 2) * (w // 2), c * 4)


def unpatchify_video(rows: torch.Tensor, t: int, h: int, w: int, channels: int = VIDEO_CHANNELS) -> torch.Tensor:
    """Inverse of patchify_video: rows -> (C, T, H, W) with H = 2h, W = 2w patches."""
    x = rows.reshape(t, h, w, channels, 2, 2)
    return x.permute(3, 0, 1, 4, 2, 5).reshape(channels, t, h * 2, w * 2)


def pack_audio(latent: torch.Tensor) -> torch.Tensor:
    """(C, lanes, T) audio latent -> (lanes * T, C): one row per (lane, frame), the whole left lane first."""
    c, lanes, t = latent.shape
    return latent.permute(1, 2, 0).reshape(lanes * t, c)


def unpack_audio(rows: torch.Tensor, lanes: int = 2) -> torch.Tensor:
    """Inverse of pack_audio: (lanes * T, C) rows -> (C, lanes, T)."""
    t = rows.shape[0] // lanes
    return rows.reshape(lanes, t, rows.shape[-1]).permute(2, 0, 1)


# Positions -------------------------------------------------------------------------------------

class FrameCoordinates(NamedTuple):
    """Where one latent frame's patches sit on the h and w axes, and the w of the two audio lanes."""
    hw: torch.Tensor                # (patch rows, 2) float64, (h, w) per patch, rows of the grid in order
    lanes: tuple[float, float]      # w of the left and right stereo lane: first and last patch column


def _patch_offsets(size: int, square_side: float) -> torch.Tensor:
    # Every frame is treated as having the area of a square of side `square_side` (sqrt(h * w)): an axis
    # of `size` latent pixels covers size / square_side of the extent, centred on its midpoint, and each
    # of its size // 2 patches sits at the start of its equal share of that length.
    share = size / square_side
    count = size // 2
    fractions = torch.arange(count, dtype=torch.float64) / count      # 0, 1/count, ... (< 1)
    return (0.5 + (fractions - 0.5) * share) * SPATIAL_EXTENT


def frame_coordinates(latent_h: int, latent_w: int) -> FrameCoordinates:
    """Area-normalised patch coordinates of a (latent_h, latent_w) frame (whole 2x2 patches)."""
    square_side = math.sqrt(latent_h * latent_w)
    along_h, along_w = _patch_offsets(latent_h, square_side), _patch_offsets(latent_w, square_side)
    return FrameCoordinates(torch.cartesian_prod(along_h, along_w).reshape(-1, 2),
                            (float(along_w[0]), float(along_w[-1])))


def _first_pixel_frame(latent_index: int) -> int:
    # The pixel frame a latent frame starts at: 17 per whole clip before it, then within its own clip
    # 1 frame for the clip's opening latent and 4 for each latent after it.
    clips, within = divmod(latent_index, CLIP_LATENTS)
    return clips * CLIP_FRAMES + (0 if within == 0 else 1 + 4 * (within - 1))


def video_times(latent_t: int, origin: float) -> torch.Tensor:
    """Rotary time of each latent frame: origin + 5/3 per pixel frame before it."""
    frames_before = torch.tensor([_first_pixel_frame(k) for k in range(latent_t)], dtype=torch.float64)
    return origin + FRAME_UNITS * frames_before


def frame_clock_span(latent_index: int) -> tuple[float, float]:
    """Clock units [start, stop) that latent frame `latent_index` covers (1 pixel frame for a clip's first
    latent, else 4), counted from the clip's start."""
    start = _first_pixel_frame(latent_index)
    return FRAME_UNITS * start, FRAME_UNITS * (start + (1 if latent_index % CLIP_LATENTS == 0 else 4))


def video_span(latent_t: int) -> float:
    """Clock units covered by `latent_t` latent frames."""
    return FRAME_UNITS * _first_pixel_frame(latent_t)


def video_positions(latent_t: int, latent_h: int, latent_w: int, origin: float,
                    frames: tuple[int, ...] | None = None) -> torch.Tensor:
    """(latent_t * patches per frame, 3) float64 positions (t, h, w) of video patch rows.

    frames: which latent frames of a longer clip the rows hold (a context window), each keeping its time
    in that clip; None: frames 0 .. latent_t - 1.
    """
    hw = frame_coordinates(latent_h, latent_w).hw
    if frames is None:
        times = video_times(latent_t, origin)
    else:
        times = origin + FRAME_UNITS * torch.tensor([_first_pixel_frame(k) for k in frames], dtype=torch.float64)
    times = times.repeat_interleave(hw.shape[0])
    return torch.cat([times[:, None], hw.repeat(latent_t, 1)], dim=1)


def audio_positions(audio_t: int, origin: float, lanes: tuple[float, float],
                    frames: tuple[int, ...] | None = None) -> torch.Tensor:
    """(2 * audio_t, 3) float64 positions (t, h, w) of lane-major stereo audio rows.

    frames: which audio latent frames of a longer clip the rows hold (each at its own time); None: 0 .. audio_t - 1.
    """
    steps = torch.arange(audio_t, dtype=torch.float64) if frames is None else torch.tensor(frames, dtype=torch.float64)
    times = (origin + steps).expand(2, audio_t)
    lane_w = torch.tensor(lanes, dtype=torch.float64)[:, None].expand(2, audio_t)
    return torch.stack([times, torch.zeros_like(times), lane_w], dim=-1).reshape(-1, 3)


def text_positions(text_len: int) -> torch.Tensor:
    """(text_len, 3) float64 positions of text rows: time = token index, h = w = 0."""
    times = torch.arange(text_len, dtype=torch.float64)
    return torch.stack([times, torch.zeros_like(times), torch.zeros_like(times)], dim=-1)


# Condition items -------------------------------------------------------------------------------

@dataclass
class ConditionItem:
    """One block of condition rows for one batch element.

    KEYFRAME: a guide pinned at pixel frame `frame_index` (already resolved, >= 0).
    REFERENCE: a reference block of `kind` image, video or audio.
    video: (24, t, h, w) normalised latent or None; audio: (32, 2, t) normalised latent or None.
    """
    role: ConditionRole
    video: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    frame_index: int = 0
    kind: ReferenceKind = ReferenceKind.IMAGE


def pad_to_patches(video: torch.Tensor) -> torch.Tensor:
    """(..., h, w) with an odd h or w -> whole 2x2 patches, padded at the end with the opposite edge's
    first row / column (circular), the way the reference transformer pads its latents."""
    pad_h, pad_w = video.shape[-2] % 2, video.shape[-1] % 2
    if not (pad_h or pad_w):
        return video
    shape = video.shape
    flat = video.reshape(-1, 1, shape[-2], shape[-1])          # circular padding wants a (N, C, H, W) tensor
    padded = torch.nn.functional.pad(flat, (0, pad_w, 0, pad_h), mode="circular")
    return padded.reshape(*shape[:-2], shape[-2] + pad_h, shape[-1] + pad_w)


def _batch_item(tensor: torch.Tensor | None, index: int, ndim: int, what: str) -> torch.Tensor | None:
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != ndim:
        raise ValueError(f"{what} must be a tensor with {ndim} dims, got "
                         f"{getattr(tensor, 'shape', type(tensor).__name__)}")
    if tensor.shape[0] not in (1,) and index >= tensor.shape[0]:
        raise ValueError(f"{what} has batch {tensor.shape[0]}, which does not cover batch element {index}")
    return tensor[0 if tensor.shape[0] == 1 else index]


def condition_items(extras: dict, batch_index: int, *, target_frames: int, latent_h: int, latent_w: int,
                    audio_t: int) -> list[ConditionItem]:
    """Condition items of one batch element from CONDITIONING extras ("keyframes", "references").

    A keyframe is {"frame_index": int (negative counts from the end), "latent": (B|1, 24, t, h, w) or None,
    "audio_latent": (B|1, 32, 2, t) or None}. A reference is {"kind": "image"|"video"|"audio",
    "latent": ... or None, "audio_latent": ... or None}. Keyframe video must be on the target's latent grid.
    """
    items: list[ConditionItem] = []
    for n, kf in enumerate(extras.get("keyframes") or []):
        what = f"keyframe {n}"
        video = _batch_item(kf.get("latent"), batch_index, 5, f"{what} latent")
        audio = _batch_item(kf.get("audio_latent"), batch_index, 4, f"{what} audio_latent")
        if video is None and audio is None:
            raise ValueError(f"{what} has neither a video latent nor an audio latent")
        index = int(kf.get("frame_index", 0))
        if index < 0:
            index += target_frames
        if not 0 <= index < target_frames:
            raise ValueError(f"{what} frame_index {kf.get('frame_index')} is outside the clip of {target_frames} frames")
        if video is not None:
            # latent_h / latent_w may be the target's grid or that grid padded to whole patches.
            padded = (video.shape[2] + video.shape[2] % 2, video.shape[3] + video.shape[3] % 2)
            grid_ok = tuple(video.shape[2:]) == (latent_h, latent_w) or padded == (latent_h, latent_w)
            if video.shape[0] != VIDEO_CHANNELS or not grid_ok:
                raise ValueError(f"{what} latent has shape {tuple(video.shape)}; expected ({VIDEO_CHANNELS}, t, "
                                 f"{latent_h}, {latent_w}) to match the target latent grid")
            if padded == (latent_h, latent_w):
                video = pad_to_patches(video)
            end = index + pixel_frames(video.shape[1])
            if end > target_frames:
                raise ValueError(f"{what} covers frames {index}..{end - 1} but the clip has {target_frames} frames")
        if audio is not None:
            if audio.shape[0] != AUDIO_CHANNELS or audio.shape[1] != 2:
                raise ValueError(f"{what} audio_latent has shape {tuple(audio.shape)}; expected ({AUDIO_CHANNELS}, 2, t)")
        items.append(ConditionItem(ConditionRole.KEYFRAME, video=video, audio=audio, frame_index=index))
    for n, ref in enumerate(extras.get("references") or []):
        what = f"reference {n}"
        video = _batch_item(ref.get("latent"), batch_index, 5, f"{what} latent")
        audio = _batch_item(ref.get("audio_latent"), batch_index, 4, f"{what} audio_latent")
        try:
            kind = ReferenceKind(ref.get("kind", "image"))
        except ValueError:
            raise ValueError(f"{what} kind {ref.get('kind')!r} is not one of 'image', 'video', 'audio'") from None
        if kind is not ReferenceKind.AUDIO and video is None:
            raise ValueError(f"{what} of kind {kind.value!r} has no latent")
        if kind is ReferenceKind.IMAGE and video.shape[1] != 1:
            raise ValueError(f"{what} is an image but its latent has {video.shape[1]} frames")
        if kind is ReferenceKind.AUDIO and audio is None:
            raise ValueError(f"{what} of kind 'audio' has no audio_latent")
        if video is not None:
            video = pad_to_patches(video)
        items.append(ConditionItem(ConditionRole.REFERENCE, video=video if kind is not ReferenceKind.AUDIO else None,
                                   audio=audio if kind is not ReferenceKind.IMAGE else None, kind=kind))
    return items


@dataclass(frozen=True)
class TargetWindow:
    """The frames of a longer clip that a forward's target rows hold (one context window).

    Each row keeps the rotary time it has in the whole clip, so a window's picture and sound stay aligned
    with each other and with the guides pinned to the clip's frames.
    """
    video: tuple[int, ...]     # latent frame index in the clip of each target video frame, in row order
    audio: tuple[int, ...]     # audio latent frame index in the clip of each target audio frame, in row order


# Layout ----------------------------------------------------------------------------------------

@dataclass
class Segment:
    """A contiguous run of rows of one role. `item` indexes the ConditionItem the rows come from."""
    role: SegmentRole
    start: int
    stop: int
    tag: int         # modality tag: video 0, text 1, audio 2 (the role's)
    item: int = -1


@dataclass
class PackedLayout:
    """Segments and (S, 3) float64 rotary positions (t, h, w) of one packed sequence."""
    segments: list[Segment] = field(default_factory=list)
    positions: torch.Tensor | None = None
    origin: float = 0.0
    text_tags: torch.Tensor | None = None  # (text_len,) long modality tag per text row; None: all text

    @property
    def seq_len(self) -> int:
        """Total number of rows."""
        return self.segments[-1].stop if self.segments else 0

    def segment(self, role: SegmentRole | str) -> Segment:
        """The (single) segment of `role` (used for the target audio and video)."""
        for seg in self.segments:
            if seg.role == role:
                return seg
        raise KeyError(role)


class _LayoutBuilder:
    """Appends segments one after another; each segment's length is that of its positions."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.positions: list[torch.Tensor] = []

    def add(self, role: SegmentRole, positions: torch.Tensor, item: int = -1) -> None:
        start = self.segments[-1].stop if self.segments else 0
        self.segments.append(Segment(role, start, start + positions.shape[0], role.tag, item))
        self.positions.append(positions)

    def layout(self, origin: float, text_tags: torch.Tensor | None) -> PackedLayout:
        return PackedLayout(self.segments, torch.cat(self.positions), origin, text_tags)


def build_layout(text_len: int, latent_t: int, latent_h: int, latent_w: int, audio_t: int,
                 items: list[ConditionItem] | None = None, text_tags: torch.Tensor | None = None,
                 window: TargetWindow | None = None) -> PackedLayout:
    """The packed layout for a target of (latent_t, latent_h, latent_w) video and audio_t audio frames.

    text_tags: the modality tag of each text row (TAG_TEXT or TAG_VIDEO); None tags every text row as text.
    window: the clip frames the targets are (a context window; their rows keep the clip's times); None:
    the targets are the whole clip.
    """
    items = items or []
    if window is not None and (len(window.video) != latent_t or len(window.audio) != audio_t):
        raise ValueError(f"the context window names {len(window.video)} video and {len(window.audio)} audio frames "
                         f"for a target of {latent_t} video and {audio_t} audio frames")
    if text_tags is not None:
        text_tags = torch.as_tensor(text_tags).reshape(-1).long().cpu()
        if text_tags.numel() != text_len:
            raise ValueError(f"{text_tags.numel()} token tags for {text_len} text rows")
        if not bool(((text_tags == TAG_TEXT) | (text_tags == TAG_VIDEO)).all()):
            raise ValueError(f"token tags must be {TAG_VIDEO} (a picture or video token) or {TAG_TEXT} (text); "
                             f"got {sorted(set(text_tags.tolist()))}")
    keyframes = [(i, item) for i, item in enumerate(items) if item.role == ConditionRole.KEYFRAME]
    references = [(i, item) for i, item in enumerate(items) if item.role == ConditionRole.REFERENCE]
    target_lanes = frame_coordinates(latent_h, latent_w).lanes
    # The reference blocks occupy the clock from the end of the text; the targets start after them.
    origin = float(text_len) + sum(_reference_span(item) for _, item in references)

    rows = _LayoutBuilder()
    rows.add(SegmentRole.TEXT, text_positions(text_len))
    for i, item in keyframes:
        start = origin + FRAME_UNITS * item.frame_index
        if item.video is not None:
            rows.add(SegmentRole.COND_VIDEO, video_positions(item.video.shape[1], latent_h, latent_w, start), i)
        if item.audio is not None:
            rows.add(SegmentRole.COND_AUDIO, audio_positions(item.audio.shape[-1], start, target_lanes), i)

    clock = float(text_len)
    for i, item in references:
        if item.audio is not None:
            # A video's soundtrack sits on the lanes of the video's own grid; a lone audio on the target's.
            lanes = target_lanes if item.video is None else frame_coordinates(*item.video.shape[2:]).lanes
            rows.add(SegmentRole.REF_AUDIO, audio_positions(item.audio.shape[-1], clock, lanes), i)
        if item.video is not None:
            rows.add(SegmentRole.REF_VIDEO, video_positions(*item.video.shape[1:], clock), i)
        clock += _reference_span(item)

    rows.add(SegmentRole.AUDIO, audio_positions(audio_t, origin, target_lanes,
                                                None if window is None else window.audio))
    rows.add(SegmentRole.VIDEO, video_positions(latent_t, latent_h, latent_w, origin,
                                                None if window is None else window.video))
    return rows.layout(origin, text_tags)


def row_timesteps(layout: PackedLayout, sigma_video: float, sigma_audio: float,
                  video_mask: torch.Tensor | None = None, audio_mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row timestep t = 1 - sigma (float64, 1 = clean) and modality tag (long) of a packed sequence.

    Text follows the video stream; visual condition rows are held at t = max(t_video, 0.999) and audio
    condition rows at max(t_audio, 1). Target rows are at their stream's t, or, under a noise mask (patch
    grid (T, h, w) for video, (Ta,) for audio; 1 = generate), at 1 - m * sigma capped at the level their
    stream's condition rows sit at: a kept row (m = 0) of video at max(t_video, 0.999), of audio at
    max(t_audio, 1). A mask at or above 1 - 1e-3 everywhere is no mask.
    """
    t_v, t_a = 1.0 - sigma_video, 1.0 - sigma_audio
    pinned_v, pinned_a = max(t_v, VIDEO_CONDITION_T), max(t_a, AUDIO_CONDITION_T)
    fixed = {SegmentRole.TEXT: t_v, SegmentRole.VIDEO: t_v, SegmentRole.AUDIO: t_a,
             SegmentRole.COND_VIDEO: pinned_v, SegmentRole.REF_VIDEO: pinned_v,
             SegmentRole.COND_AUDIO: pinned_a, SegmentRole.REF_AUDIO: pinned_a}
    masked: dict[SegmentRole, torch.Tensor] = {}
    if video_mask is not None and not bool((video_mask >= FULL_MASK).all()):
        masked[SegmentRole.VIDEO] = (1.0 - video_mask.reshape(-1).double().cpu() * sigma_video).clamp(max=pinned_v)
    if audio_mask is not None and not bool((audio_mask >= FULL_MASK).all()):
        # Both stereo lanes of a latent frame share its mask value (rows are lane-major).
        rows = 1.0 - audio_mask.reshape(-1).double().cpu().repeat(2) * sigma_audio
        masked[SegmentRole.AUDIO] = rows.clamp(max=pinned_a)
    t_rows = torch.empty(layout.seq_len, dtype=torch.float64)
    tags = torch.empty(layout.seq_len, dtype=torch.long)
    for seg in layout.segments:
        tags[seg.start:seg.stop] = seg.tag
        if seg.role is SegmentRole.TEXT and layout.text_tags is not None:
            tags[seg.start:seg.stop] = layout.text_tags
        t_rows[seg.start:seg.stop] = masked[seg.role] if seg.role in masked else fixed[seg.role]
    return t_rows, tags


def _reference_span(item: ConditionItem) -> float:
    # Clock units a reference block holds: a still image one unit whatever its size; otherwise the longer
    # of its sound (one unit per audio latent frame) and its picture (5/3 per pixel frame).
    if item.kind is ReferenceKind.IMAGE:
        return 1.0
    sound = float(item.audio.shape[-1]) if item.audio is not None else 0.0
    picture = video_span(item.video.shape[1]) if item.video is not None else 0.0
    return max(sound, picture)


# Noise masks (1 = generate, 0 = keep) ------------------------------------------------------------

def clamp_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as float32 values clamped to [0, 1] (no rounding: each row runs at its own strength)."""
    return mask.float().clamp(0.0, 1.0)


def reduce_video_mask(mask: torch.Tensor, batch: int, latent_t: int, latent_h: int, latent_w: int) -> torch.Tensor:
    """A video noise mask reduced to the transformer's patch grid: (batch, latent_t, latent_h/2, latent_w/2).

    Accepts (H, W), (T, H, W), (B, T, H, W) or (B, C, T, H, W). T may be 1, latent_t or the pixel frame
    count; H, W may be the latent size or any multiple of it (pixel masks). Reduction is by max (a
    patch is generated if any of its values is); odd sizes are padded by repeating the last row / column
    first, as the reference does for masks.
    """
    m = mask.float()
    if m.dim() == 2:
        m = m[None, None, None]
    elif m.dim() == 3:
        m = m[None, None]
    elif m.dim() == 4:
        m = m[:, None]
    elif m.dim() != 5:
        raise ValueError(f"video noise mask must have 2 to 5 dims, got shape {tuple(mask.shape)}")
    m = m.amax(dim=1)  # (B', T', H', W')
    if m.shape[0] not in (1, batch):
        raise ValueError(f"video noise mask batch {m.shape[0]} does not match latent batch {batch}")
    t = m.shape[1]
    if t == pixel_frames(latent_t) and t != latent_t:
        # Pixel frames -> the latent frame that encodes them (clip start: 1 frame, then 4 per latent).
        groups, start = [], 0
        for k in range(latent_t):
            n = 1 if k % CLIP_LATENTS == 0 else 4
            groups.append(m[:, start:start + n].amax(dim=1))
            start += n
        m = torch.stack(groups, dim=1)
    elif t not in (1, latent_t):
        raise ValueError(f"video noise mask has {t} frames; expected 1, {latent_t} latent frames or "
                         f"{pixel_frames(latent_t)} pixel frames")
    h, w = m.shape[2], m.shape[3]
    if (h, w) != (latent_h, latent_w):
        if h % latent_h == 0 and w % latent_w == 0:
            m = torch.nn.functional.max_pool2d(m, kernel_size=(h // latent_h, w // latent_w))
        else:
            m = torch.nn.functional.interpolate(m, size=(latent_h, latent_w), mode="nearest")
    m = m.expand(batch, latent_t, latent_h, latent_w)
    # Odd latent sizes are padded to whole patches by repeating the last row/column.
    pad_h, pad_w = latent_h % 2, latent_w % 2
    if pad_h or pad_w:
        m = torch.nn.functional.pad(m, (0, pad_w, 0, pad_h), mode="replicate")
    m = torch.nn.functional.max_pool2d(m, kernel_size=2)
    return clamp_mask(m)


def reduce_audio_mask(mask: torch.Tensor, batch: int, audio_t: int) -> torch.Tensor:
    """An audio noise mask reduced to one value per latent frame: (batch, audio_t), by max, clamped to [0, 1].

    Accepts (T,), (B, T), (B, C, T) or (B, C, 2, T) with T = audio_t (or 1).
    """
    m = mask.float()
    if m.dim() == 1:
        m = m[None]
    elif m.dim() > 2:
        m = m.flatten(1, -2).amax(dim=1)
    if m.dim() != 2 or m.shape[-1] not in (1, audio_t):
        raise ValueError(f"audio noise mask of shape {tuple(mask.shape)} does not fit {audio_t} audio latent frames")
    if m.shape[0] not in (1, batch):
        raise ValueError(f"audio noise mask batch {m.shape[0]} does not match latent batch {batch}")
    return clamp_mask(m.expand(batch, audio_t))


def expand_video_mask(patch_mask: torch.Tensor, latent_h: int, latent_w: int) -> torch.Tensor:
    """(B, T, h, w) patch-grid mask -> (B, 1, T, H, W) latent-resolution mask (each patch value repeated 2x2)."""
    m = patch_mask.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    return m[:, None, :, :latent_h, :latent_w]


def expand_audio_mask(frame_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-frame mask -> (B, 1, 1, T) broadcastable over the audio latent."""
    return frame_mask[:, None, None, :]


__all__ = [
    "SegmentRole", "ConditionRole", "ReferenceKind", "TAG_VIDEO", "TAG_TEXT", "TAG_AUDIO", "FRAME_UNITS", "VIDEO_CONDITION_T", "AUDIO_CONDITION_T",
    "patchify_video", "unpatchify_video", "pack_audio", "unpack_audio", "FrameCoordinates", "frame_coordinates",
    "video_positions", "text_positions", "frame_clock_span",
    "audio_positions", "ConditionItem", "TargetWindow", "condition_items", "Segment", "PackedLayout", "build_layout", "row_timesteps",
    "clamp_mask", "pad_to_patches", "reduce_video_mask", "reduce_audio_mask", "expand_video_mask", "expand_audio_mask",
    "latent_frames",
]
