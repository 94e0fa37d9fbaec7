"""H3's prompt layouts for the Qwen3-VL text encoder, and the preprocessing of the images and videos in them.

Layouts. H3 uses no chat template and no system prompt. Each text piece is tokenized on its own, and
vision blocks are spliced in between the pieces:

    text to video        prompt
    first/last frame     "<Picture 1>: " block  ["<Picture 2>: " block]  prompt
    reference to video   per reference, in the order given, numbered from 1 per kind:
                           image  "<Picture i>: " block
                           audio  "<Audio j>: "          (the sound itself never reaches the encoder)
                           video  "<Video k>: " then, per two frames sampled at 2 fps,
                                  "<T.T seconds>" block  (T.T = the mean time of the two frames)
                         then the prompt

If all of that is empty (no references and an empty prompt), the prompt is the pad token alone.

Output, in transformers' Qwen3-VL convention. `input_ids` holds, for each image, `<|vision_start|>`,
then one `<|image_pad|>` per merged patch (a 2x2 group of 16-pixel patches), then `<|vision_end|>`;
a video has one such block per two frames with `<|video_pad|>`. `visual_items` lists each image and
each video once, in the order they appear, with its patches in the order the vision tower reads them
and its grid (t, h, w) in 16-pixel patches: the encoder puts the vision tower's output rows for item i
at item i's pad tokens. `token_tags` holds H3's modality per token: 0 for a whole vision block
(its start and end tokens included), 1 for text.

Preprocessing (the released encoder's, as ComfyUI's MiniMax encoder does it). A frame is resized to
a multiple of 32 pixels on each side (`fit_to_patch_grid`: the nearest multiples, scaled down
when above `MAX_PIXELS` or up when below `MIN_PIXELS`) with bilinear interpolation (no antialiasing),
normalised with mean and std 0.5 per channel, and cut into 2x16x16 patches. A single image fills
both frames of the temporal patch with itself; a video with an odd number of frames repeats its last
frame. The H3 nodes hand the encoder frames already sized in multiples of 32, so the resize leaves
them untouched; the patches then equal transformers' Qwen3-VL processor's bit for bit
(`tests/models/text/test_qwen_prompt.py`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum

import torch
import torch.nn.functional as F

from models.text.qwen_tokenizer import IMAGE_PAD_ID, PAD_ID, VIDEO_PAD_ID, VISION_END_ID, VISION_START_ID, QwenTokenizer

PATCH_SIZE = 16           # pixels per patch side
TEMPORAL_PATCH_SIZE = 2   # frames per patch
MERGE_SIZE = 2            # patches per merged token side (2x2 patches become one encoder token)
GRID_MULTIPLE = PATCH_SIZE * MERGE_SIZE
MIN_PIXELS = 56 * 56      # smallest frame area after resizing
MAX_PIXELS = 16384 * 28 * 28  # largest frame area after resizing
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5
MAX_ASPECT_RATIO = 200
VIDEO_SAMPLE_FPS = 2      # reference videos reach the encoder at this rate


class TokenTag(IntEnum):
    """H3's modality per encoder token, which the DiT reads as the row's modality."""
    VISION = 0
    TEXT = 1


class VisualKind(Enum):
    """Whether a visual item is an image or a video; decides its pad token."""
    IMAGE = "image"
    VIDEO = "video"

    @property
    def pad_id(self) -> int:
        """The token that stands for one merged patch of this kind in `input_ids`."""
        return IMAGE_PAD_ID if self is VisualKind.IMAGE else VIDEO_PAD_ID


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class VisualItem:
    """One image or video ready for the vision tower."""
    kind: VisualKind
    patches: torch.Tensor           # (t * h * w, 3 * 2 * 16 * 16) float32, in the vision tower's patch order
    grid_thw: tuple[int, int, int]  # temporal patches, patch rows, patch columns

    @property
    def tokens_per_frame_pair(self) -> int:
        """Pad tokens in one vision block: merged patches of one temporal patch."""
        return self.grid_thw[1] * self.grid_thw[2] // (MERGE_SIZE * MERGE_SIZE)

    @property
    def token_count(self) -> int:
        """Pad tokens this item fills in `input_ids`, over all its blocks."""
        return self.grid_thw[0] * self.tokens_per_frame_pair


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class EncoderPrompt:
    """A prompt laid out for the Qwen3-VL encoder: token ids, H3's token tags and the visual items."""
    input_ids: torch.Tensor   # (T,) int64
    token_tags: torch.Tensor  # (T,) int64, TokenTag per token
    visual_items: tuple[VisualItem, ...]

    def transformers_inputs(self) -> dict[str, torch.Tensor]:
        """The same prompt as keyword arguments of transformers' Qwen3-VL model (batch of one)."""
        inputs = {"input_ids": self.input_ids[None], "attention_mask": torch.ones_like(self.input_ids)[None]}
        # transformers numbers modalities 0 text, 1 image pad, 2 video pad (start/end tokens count as text)
        type_ids = torch.zeros_like(self.input_ids)
        type_ids[self.input_ids == IMAGE_PAD_ID] = 1
        type_ids[self.input_ids == VIDEO_PAD_ID] = 2
        inputs["mm_token_type_ids"] = type_ids[None]
        for kind, pixels_key, grid_key in ((VisualKind.IMAGE, "pixel_values", "image_grid_thw"),
                                           (VisualKind.VIDEO, "pixel_values_videos", "video_grid_thw")):
            items = [item for item in self.visual_items if item.kind is kind]
            if items:
                inputs[pixels_key] = torch.cat([item.patches for item in items])
                inputs[grid_key] = torch.tensor([item.grid_thw for item in items], dtype=torch.int64)
        return inputs


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class ImageReference:
    """An image shown to the encoder as `<Picture i>`."""
    image: torch.Tensor  # (H, W, C) or (1, H, W, C), values in [0, 1]


@dataclass(frozen=True)
class AudioReference:
    """A sound named to the encoder as `<Audio j>`; only the label enters the prompt."""


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class VideoReference:
    """A video shown to the encoder as `<Video k>`: frames already at 2 fps and their times in seconds."""
    frames: torch.Tensor             # (T, H, W, C), values in [0, 1]
    timestamps_s: tuple[float, ...]  # one per frame

    @classmethod
    def sampled(cls, frames: torch.Tensor, fps: float) -> VideoReference:
        """Take the frames of a video at `fps` that fall every half second (frame 0, 0.5 s, 1 s, ...)."""
        if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[0] == 0:
            raise ValueError(f"a reference video must be a (frames, height, width, channels) tensor with at "
                             f"least one frame; got {_describe(frames)}")
        if not fps > 0:
            raise ValueError(f"a reference video needs a positive frame rate, got {fps}")
        count = frames.shape[0]
        sample_count = math.floor((count - 1) / fps * VIDEO_SAMPLE_FPS) + 1
        # the nearest frame to each half second, a tie going to the later frame
        indices = [min(count - 1, math.floor(k * fps / VIDEO_SAMPLE_FPS + 0.5)) for k in range(sample_count)]
        return cls(frames[indices], tuple(k / VIDEO_SAMPLE_FPS for k in range(sample_count)))


Reference = ImageReference | AudioReference | VideoReference


def fit_to_patch_grid(height: int, width: int, *, min_pixels: int = MIN_PIXELS,
                      max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The frame size (height, width) the encoder reads: multiples of 32 near the original, area in bounds."""
    if height <= 0 or width <= 0:
        raise ValueError(f"an image for the Qwen3-VL encoder must have a positive size, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"an image for the Qwen3-VL encoder must be less elongated than {MAX_ASPECT_RATIO}:1, "
                         f"got {height}x{width} (height x width)")
    sides = (height, width)
    fitted = [_on_grid(side, round) for side in sides]
    area = height * width
    if fitted[0] * fitted[1] > max_pixels:
        # One factor for both sides keeps the shape; rounding down then keeps the area within the bound.
        factor = math.sqrt(area / max_pixels)
        fitted = [max(GRID_MULTIPLE, _on_grid(side / factor, math.floor)) for side in sides]
    elif fitted[0] * fitted[1] < min_pixels:
        factor = math.sqrt(min_pixels / area)
        fitted = [_on_grid(side * factor, math.ceil) for side in sides]
    return fitted[0], fitted[1]


def _on_grid(length: float, to_int: Callable[[float], int]) -> int:
    """`length` as a whole number of GRID_MULTIPLE pixels, `to_int` choosing how the count is rounded."""
    return to_int(length / GRID_MULTIPLE) * GRID_MULTIPLE


def preprocess_image(image: torch.Tensor) -> VisualItem:
    """An image (H, W, C) or (1, H, W, C) in [0, 1] as one temporal patch (the image in both frames)."""
    if isinstance(image, torch.Tensor) and image.dim() == 4 and image.shape[0] == 1:
        image = image[0]
    if not isinstance(image, torch.Tensor) or image.dim() != 3:
        raise ValueError(f"an image for the Qwen3-VL encoder must be one (height, width, channels) frame; "
                         f"got {_describe(image)}")
    pixels = _normalised_frames(image[None])          # (1, 3, H', W')
    pixels = pixels.expand(TEMPORAL_PATCH_SIZE, -1, -1, -1)
    patches, grid = _patchify(pixels)
    return VisualItem(VisualKind.IMAGE, patches, grid)


def preprocess_video(frames: torch.Tensor) -> VisualItem:
    """Video frames (T, H, W, C) in [0, 1], two per temporal patch (an odd last frame is repeated)."""
    if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[0] == 0:
        raise ValueError(f"a video for the Qwen3-VL encoder must be a (frames, height, width, channels) tensor "
                         f"with at least one frame; got {_describe(frames)}")
    pixels = _normalised_frames(frames)               # (T, 3, H', W')
    if pixels.shape[0] % TEMPORAL_PATCH_SIZE:
        pixels = torch.cat([pixels, pixels[-1:].expand(TEMPORAL_PATCH_SIZE - pixels.shape[0] % TEMPORAL_PATCH_SIZE,
                                                       -1, -1, -1)])
    patches, grid = _patchify(pixels)
    return VisualItem(VisualKind.VIDEO, patches, grid)


def frame_pair_timestamps(timestamps_s: Sequence[float]) -> list[float]:
    """The time of each two-frame block: the mean of its frames' times (an odd last frame pairs with itself)."""
    times = list(timestamps_s)
    if len(times) % TEMPORAL_PATCH_SIZE:
        times.append(times[-1])
    return [(times[i] + times[i + 1]) / 2 for i in range(0, len(times), TEMPORAL_PATCH_SIZE)]


def build_encoder_prompt(tokenizer: QwenTokenizer, prompt: str,
                         references: Sequence[Reference] = ()) -> EncoderPrompt:
    """Lay out `references` (in the order given) then `prompt` as H3 presents them to Qwen3-VL.

    The reference-to-video node's order (images, videos with their soundtracks' labels, other sounds)
    is `reference_to_video_prompt`'s; this function keeps whatever order it is given."""
    builder = _PromptBuilder(tokenizer)
    counts = {ImageReference: 0, AudioReference: 0, VideoReference: 0}
    for position, reference in enumerate(references):
        if type(reference) not in counts:
            raise TypeError(f"reference {position + 1} is a {type(reference).__name__}; expected an "
                            f"ImageReference, AudioReference or VideoReference")
        counts[type(reference)] += 1
        number = counts[type(reference)]
        if isinstance(reference, ImageReference):
            builder.add_text(f"<Picture {number}>: ")
            builder.add_visual(preprocess_image(reference.image))
        elif isinstance(reference, AudioReference):
            builder.add_text(f"<Audio {number}>: ")
        else:
            if len(reference.timestamps_s) != reference.frames.shape[0]:
                raise ValueError(f"reference video {number} has {reference.frames.shape[0]} frames but "
                                 f"{len(reference.timestamps_s)} timestamps")
            builder.add_text(f"<Video {number}>: ")
            builder.add_visual(preprocess_video(reference.frames),
                               block_labels=[f"<{t:.1f} seconds>" for t in frame_pair_timestamps(reference.timestamps_s)])
    builder.add_text(prompt)
    return builder.finish()


def text_to_video_prompt(tokenizer: QwenTokenizer, prompt: str) -> EncoderPrompt:
    """The text-to-video layout: the prompt alone."""
    return build_encoder_prompt(tokenizer, prompt)


def first_last_frame_prompt(tokenizer: QwenTokenizer, prompt: str, images: Sequence[torch.Tensor]) -> EncoderPrompt:
    """The first/last-frame layout: up to two keyframes as `<Picture 1>`, `<Picture 2>`, then the prompt."""
    if len(images) > 2:
        raise ValueError(f"the first/last-frame layout takes at most two images, got {len(images)}")
    return build_encoder_prompt(tokenizer, prompt, [ImageReference(image) for image in images])


def reference_to_video_prompt(tokenizer: QwenTokenizer, prompt: str, *, images: Sequence[torch.Tensor] = (),
                              videos: Sequence[torch.Tensor] = (), video_has_sound: Sequence[bool] = (),
                              standalone_audio_count: int = 0, video_fps: float = 24.0) -> EncoderPrompt:
    """The reference-to-video layout in H3's order: the images, then each video (its soundtrack's
    `<Audio j>` label just before its `<Video k>`, its frames taken at 2 fps from `video_fps`), then the
    standalone sounds' labels, then the prompt."""
    if len(video_has_sound) not in (0, len(videos)):
        raise ValueError(f"video_has_sound has {len(video_has_sound)} entries for {len(videos)} videos")
    if standalone_audio_count < 0:
        raise ValueError(f"standalone_audio_count must not be negative, got {standalone_audio_count}")
    references: list[Reference] = [ImageReference(image) for image in images]
    for index, frames in enumerate(videos):
        if video_has_sound and video_has_sound[index]:
            references.append(AudioReference())
        references.append(VideoReference.sampled(frames, video_fps))
    references += [AudioReference() for _ in range(standalone_audio_count)]
    return build_encoder_prompt(tokenizer, prompt, references)


class _PromptBuilder:
    """Accumulates token ids, tags and visual items; text pieces are tokenized one at a time."""

    def __init__(self, tokenizer: QwenTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.tags: list[int] = []
        self.items: list[VisualItem] = []

    def add_text(self, text: str) -> None:
        ids = self.tokenizer.encode(text)
        self.ids += ids
        self.tags += [TokenTag.TEXT] * len(ids)

    def add_visual(self, item: VisualItem, block_labels: Sequence[str] = ("",)) -> None:
        # one block per temporal patch; a video's blocks are each preceded by their time label
        if len(block_labels) != item.grid_thw[0]:
            raise ValueError(f"{len(block_labels)} block labels for {item.grid_thw[0]} temporal patches")
        for label in block_labels:
            self.add_text(label)
            block = [VISION_START_ID] + [item.kind.pad_id] * item.tokens_per_frame_pair + [VISION_END_ID]
            self.ids += block
            self.tags += [TokenTag.VISION] * len(block)
        self.items.append(item)

    def finish(self) -> EncoderPrompt:
        if not self.ids:
            self.ids, self.tags = [PAD_ID], [TokenTag.TEXT]
        return EncoderPrompt(torch.tensor(self.ids, dtype=torch.int64), torch.tensor(self.tags, dtype=torch.int64),
                             tuple(self.items))


def _normalised_frames(frames: torch.Tensor) -> torch.Tensor:
    # (T, H, W, C) in [0, 1] -> (T, 3, H', W') float32 on the patch grid, normalised
    if frames.shape[-1] not in (3, 4):
        raise ValueError(f"frames for the Qwen3-VL encoder must have 3 (RGB) or 4 (RGBA) channels, "
                         f"got {frames.shape[-1]}")
    if frames.is_complex() or not (frames.is_floating_point() or frames.dtype == torch.uint8):
        raise ValueError(f"frames for the Qwen3-VL encoder must be float in [0, 1], got {frames.dtype}")
    pixels = frames[..., :3].permute(0, 3, 1, 2).to(torch.float32)
    if frames.dtype == torch.uint8:
        pixels = pixels / 255.0
    height, width = pixels.shape[-2:]
    fitted = fit_to_patch_grid(height, width)
    if fitted != (height, width):
        pixels = F.interpolate(pixels, size=fitted, mode="bilinear", align_corners=False, antialias=False)
    return (pixels - PIXEL_MEAN) / PIXEL_STD


def _patchify(pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    # (T, C, H, W), T a multiple of the temporal patch -> (t*h*w, C*2*16*16) with the patches of each
    # 2x2 merge group consecutive, which is the order the vision tower's merger reads them in
    frames, channels, height, width = pixels.shape
    grid_t, grid_h, grid_w = frames // TEMPORAL_PATCH_SIZE, height // PATCH_SIZE, width // PATCH_SIZE
    patches = pixels.reshape(grid_t, TEMPORAL_PATCH_SIZE, channels,
                             grid_h // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE,
                             grid_w // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE)
    # -> (t, row group, column group, row in group, column in group, C, frame, patch row, patch column)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, channels * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE)
    return flat.contiguous(), (grid_t, grid_h, grid_w)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
