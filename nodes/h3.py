"""MiniMax H3 conditioning nodes (text, first / last frame and references to video with sound), the node
that sets the two flow shifts, and the resolution picker the official templates use.

The two conditioning nodes hand back the encoded prompt and an empty H3 LATENT of the asked size.
Keyframes and references are VAE-encoded here and travel in the conditioning's extras under
`keyframes` and `references` (the format is in models/h3/__init__.py); the transformer turns them into
clean condition rows of its packed sequence.

With the Qwen3-VL encoder (the released models'), the pictures and videos reach the encoder too, laid
out before the prompt as the released pipeline does (models/text/qwen_prompt.py): first/last frame
as "<Picture 1>: " and "<Picture 2>: " blocks of the frames as encoded, references as "<Picture i>: ",
"<Audio j>: " and "<Video k>: " (the video at 2 frames per second), in that order; their tokens are
tagged as video for the transformer. Weft's small encoder reads the prompt's text alone.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from media.image import check_image, scale_images
from models.text.qwen_prompt import AudioReference, ImageReference, VideoReference
from nodes.latent import LENGTH_TOOLTIP, empty_av_latent, frame_size_input
from nodes.loaders import check_clip, check_model, check_model_patch, check_vae, keep_shifts, with_options
from nodes.spec import Input, NodeSpec, Output
from nodes.vae import encode_frames, encode_waveform

# Frame sides are multiples of this many pixels: whole 1x2x2 patches of the 16x-downsampled latent.
SIZE_STEP = 32
# How the released pipeline sizes references, in pixels.
VIDEO_REFERENCE_SHORT_SIDE = 768
VIDEO_REFERENCE_MAX_AREA = 1344 * 768
IMAGE_REFERENCE_MAX_SHORT_SIDE = 2048
# The video encoder's smallest input: one clip start and one group of four frames.
VIDEO_REFERENCE_MIN_FRAMES = 5
REFERENCE_VIDEO_FPS = 24.0  # the frame rate reference videos are taken to have

# ResolutionSelector's choices: label -> (width units, height units).
ASPECT_RATIOS = {
    "1:1 (Square)": (1, 1), "3:2 (Photo)": (3, 2), "4:3 (Standard)": (4, 3), "16:9 (Widescreen)": (16, 9),
    "21:9 (Ultrawide)": (21, 9), "2:3 (Portrait Photo)": (2, 3), "3:4 (Portrait Standard)": (3, 4),
    "9:16 (Portrait Widescreen)": (9, 16),
}


# ---------------------------------------------------------------------- sizing
def _snap(pixels: float) -> int:
    """The multiple of SIZE_STEP nearest to `pixels`, at least one step."""
    return max(SIZE_STEP, round(pixels / SIZE_STEP) * SIZE_STEP)


def _snap_down(pixels: float) -> int:
    """The largest multiple of SIZE_STEP not above `pixels`, at least one step."""
    return max(SIZE_STEP, math.floor(pixels / SIZE_STEP) * SIZE_STEP)


def downscale_to_area(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """A frame of at most `max_pixels` with the proportions of width x height, snapped to the size grid
    without enlarging the source (a side under one grid step still becomes one step)."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    sw, sh = width * scale, height * scale
    # Nearest grid size, but rounding may not turn a down-scale into an up-scale.
    tw, th = min(_snap(sw), _snap_down(width)), min(_snap(sh), _snap_down(height))
    if tw * th > max_pixels:
        tw, th = _snap_down(sw), _snap_down(sh)
    while tw * th > max_pixels and (tw > SIZE_STEP or th > SIZE_STEP):
        if tw >= th and tw > SIZE_STEP:
            tw -= SIZE_STEP
        else:
            th -= SIZE_STEP
    return tw, th


def reference_video_canvas(width: int, height: int) -> tuple[int, int]:
    """The frame size 'official' sizing encodes a width x height reference video at.

    The released pipeline's canvas: the video scaled to a 768-pixel short side, or less where that
    would pass 1344 x 768 pixels of area, and snapped to the size grid. A video with fewer pixels than
    that canvas is not enlarged; it is only snapped.
    """
    scale = min(VIDEO_REFERENCE_SHORT_SIDE / min(width, height),
                math.sqrt(VIDEO_REFERENCE_MAX_AREA / (width * height)))
    canvas = _snap(width * scale), _snap(height * scale)
    if width * height < canvas[0] * canvas[1]:
        return _snap(width), _snap(height)
    return canvas


def _cap_short_side(width: int, height: int, limit: int) -> tuple[int, int]:
    """(width, height) snapped to the size grid, scaled down first when the short side passes `limit`."""
    shrink = limit / min(width, height)
    if shrink >= 1.0:
        return _snap(width), _snap(height)
    return _snap(width * shrink), _snap(height * shrink)


def _resize(images: torch.Tensor, width: int, height: int, crop: str) -> torch.Tensor:
    return scale_images(images[..., :3], width, height, "lanczos", crop)


def _with_extras(conditioning: list, **extras: Any) -> list:
    # A new list and dict: the CLIP's cached encoding stays as it was.
    return [[entry[0], {**entry[1], **extras}] for entry in conditioning]


# ---------------------------------------------------------------------- node functions
def _image_to_video(clip: Any, vae: Any, prompt: str, width: int, height: int, length: int,
                    first_frame: torch.Tensor | None = None, last_frame: torch.Tensor | None = None) -> tuple[list, dict]:
    node = "MiniMaxH3ImageToVideo"
    clip = check_clip(node, clip)
    latent = empty_av_latent(node, width, height, length)
    frames, width, height = latent["length"], width - width % 16, height - height % 16
    # The released pipeline prepares the two ends differently: the opening frame is resized to the canvas
    # as it is (all of the picture kept, proportions bent if they differ); the closing frame keeps its
    # proportions, covering the canvas and losing what overhangs.
    ends = [("first_frame", first_frame, 0, "disabled"), ("last_frame", last_frame, frames - 1, "center")]
    keyframes, pictures = [], []
    for name, image, frame_index, crop in ends:
        if image is None:
            continue
        vae = check_vae(node, vae, "video")
        fitted = _resize(check_image(node, image, name)[:1], width, height, crop)
        keyframes.append({"frame_index": frame_index, "latent": encode_frames(node, vae, fitted, name)})
        pictures.append(ImageReference(fitted[0]))
    conditioning = clip.encode(prompt, node=node, references=pictures)
    if keyframes:
        conditioning = _with_extras(conditioning, keyframes=keyframes)
    return conditioning, latent


def _slot_number(name: str, prefix: str) -> str:
    """The number an autogrow slot is named with: "ref_video_2" with prefix "ref_video_" -> "2"."""
    return name.removeprefix(prefix)


def _reference_to_video(clip: Any, vae: Any, audio_vae: Any, prompt: str, width: int, height: int, length: int,
                        ref_image_size: str, ref_images: dict | None = None, ref_videos: dict | None = None,
                        ref_video_audios: dict | None = None, ref_audios: dict | None = None,
                        ref_video_size: str = "official") -> tuple[list, dict]:
    node = "MiniMaxH3ReferenceToVideo"
    clip = check_clip(node, clip)
    latent = empty_av_latent(node, width, height, length)
    frames, width, height = latent["length"], width - width % 16, height - height % 16
    references: list[dict] = []
    # What the text encoder is shown, in H3's order: the pictures, then each video preceded by its
    # soundtrack's sound label when it has one, then the sounds given on their own.
    shown: list = []

    for name, image in (ref_images or {}).items():
        if image is None:
            continue
        vae = check_vae(node, vae, "video")
        image = check_image(node, image, f"ref_images.{name}")
        h, w = int(image.shape[1]), int(image.shape[2])
        if ref_image_size == "match":
            size = downscale_to_area(w, h, width * height)
        elif ref_image_size == "max":
            size = _cap_short_side(w, h, IMAGE_REFERENCE_MAX_SHORT_SIDE)
        else:
            raise ValueError(f"{node}: ref_image_size {ref_image_size!r} is not 'match' or 'max'")
        resized = _resize(image[:1], *size, "disabled")
        references.append({"kind": "image", "latent": encode_frames(node, vae, resized, f"ref_images.{name}")})
        shown.append(ImageReference(resized[0]))

    soundtracks = {_slot_number(slot, "ref_video_audio_"): audio for slot, audio in (ref_video_audios or {}).items()}
    for name, video in (ref_videos or {}).items():
        if video is None:
            continue
        vae = check_vae(node, vae, "video")
        video = check_image(node, video, f"ref_videos.{name}")
        vh, vw = int(video.shape[1]), int(video.shape[2])
        if ref_video_size == "official":
            size = reference_video_canvas(vw, vh)
        elif ref_video_size == "match":
            size = downscale_to_area(vw, vh, min(width * height, VIDEO_REFERENCE_MAX_AREA))
        else:
            raise ValueError(f"{node}: ref_video_size {ref_video_size!r} is not 'official' or 'match'")
        usable = min(int(video.shape[0]), frames)
        if usable < VIDEO_REFERENCE_MIN_FRAMES:
            raise ValueError(f"{node}: reference video {name} has {video.shape[0]} frames, fewer than the "
                             f"{VIDEO_REFERENCE_MIN_FRAMES} the video encoder needs")
        usable -= (usable - 5) % 17  # the encoder reads 17k + 5 frames; the rest of the last clip is dropped
        clip_frames = _resize(video[:usable], *size, "disabled")
        entry = {"kind": "video", "latent": encode_frames(node, vae, clip_frames, f"ref_videos.{name}"),
                 "audio_latent": None}
        soundtrack = soundtracks.get(_slot_number(name, "ref_video_"))
        if soundtrack is not None:
            audio_vae = check_vae(node, audio_vae, "audio", "audio_vae")
            entry["audio_latent"] = encode_waveform(node, audio_vae, _first(soundtrack), "ref_video_audios")[:1]
            shown.append(AudioReference())
        shown.append(VideoReference.sampled(clip_frames, REFERENCE_VIDEO_FPS))
        references.append(entry)

    for name, audio in (ref_audios or {}).items():
        if audio is None:
            continue
        audio_vae = check_vae(node, audio_vae, "audio", "audio_vae")
        references.append({"kind": "audio",
                           "audio_latent": encode_waveform(node, audio_vae, _first(audio), f"ref_audios.{name}")[:1]})
        shown.append(AudioReference())

    conditioning = clip.encode(prompt, node=node, references=shown)
    if references:
        conditioning = _with_extras(conditioning, references=references)
    return conditioning, latent


def _first(audio: Any) -> Any:
    # A reference is one clip: the first of a batch.
    if isinstance(audio, Mapping) and isinstance(audio.get("waveform"), torch.Tensor):  # any AUDIO mapping
        return {**audio, "waveform": audio["waveform"][:1]}
    return audio


def _sigma_shift(model: Any, shift_video: float, shift_audio: float) -> tuple[Any]:
    model = check_model("MiniMaxH3SigmaShift", model)
    return (with_options(model, h3_shifts=(float(shift_video), float(shift_audio))),)


def percent_sigma(percent: float, shift: float) -> float:
    """The video sigma reached `percent` of the way through sampling: 1 at 0, 0 at 1, shifted between."""
    from models.h3.sampling import shifted_sigma

    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    return float(shifted_sigma(1.0 - percent, shift))


def _fun_controlnet_apply(model: Any, model_patch: Any, vae: Any, strength: float, start_percent: float,
                          end_percent: float, control_video: torch.Tensor | None = None,
                          mask: torch.Tensor | None = None, source_video: torch.Tensor | None = None) -> tuple[Any]:
    from models.h3.fun_control import FunControlHook
    from models.patcher import BLOCK_HOOKS
    from nodes.sampling import model_shifts

    node = "MiniMaxH3FunControlNetApply"
    model = check_model(node, model)
    patch = check_model_patch(node, model_patch)
    if strength == 0 or (control_video is None and mask is None):
        return (model,)
    vae = check_vae(node, vae, "video")
    if control_video is not None:
        control_video = check_image(node, control_video, "control_video")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 3):
            raise TypeError(f"{node}: input 'mask' takes a MASK (frames, height, width); got "
                            f"{getattr(mask, 'shape', type(mask).__name__)}")
        if source_video is not None:
            source_video = check_image(node, source_video, "source_video")
    else:
        source_video = None  # only read behind a mask
    video_shift, _ = model_shifts(model)

    def encode(frames: torch.Tensor) -> torch.Tensor:
        try:
            return vae.model.encode(frames)
        except ValueError as exc:
            raise ValueError(f"{node}: {exc}") from None

    hook = FunControlHook(patch.net, encode, lambda frames, w, h: scale_images(frames, w, h, "bilinear", "center"),
                          strength=strength, sigma_start=percent_sigma(start_percent, video_shift),
                          sigma_end=percent_sigma(end_percent, video_shift), control_video=control_video, mask=mask,
                          source_video=source_video)
    hooks = (*model.options.get(BLOCK_HOOKS, ()), hook)
    return (keep_shifts(model, model.with_options(**{BLOCK_HOOKS: hooks})),)


def _resolution_selector(aspect_ratio: str, megapixels: float, multiple: int = 8,
                         minimum: int = 256) -> tuple[int, int]:
    if aspect_ratio not in ASPECT_RATIOS:
        raise ValueError(f"ResolutionSelector: aspect_ratio {aspect_ratio!r} is not one of {', '.join(ASPECT_RATIOS)}")
    if multiple < 1:
        raise ValueError(f"ResolutionSelector: multiple must be positive, got {multiple}")
    ratio = ASPECT_RATIOS[aspect_ratio]
    # A frame of this ratio is (ratio[0] * u) x (ratio[1] * u) pixels; its area, megapixels * 2^20, fixes u.
    unit_px = math.sqrt(megapixels * 1024 * 1024 / math.prod(ratio))
    size = [multiple * round(side * unit_px / multiple) for side in ratio]
    if min(size) < minimum:
        size = _smallest_exact_size(ratio, multiple, minimum)
    width, height = size
    return int(width), int(height)


def _smallest_exact_size(ratio: tuple[int, int], multiple: int, minimum: int) -> list[int]:
    """The least u with both ratio[i] * u on the `multiple` grid and at least `minimum`, as [width, height]."""
    # ratio[i] * u is a multiple of `multiple` exactly when u is a multiple of multiple / gcd(ratio[i], multiple).
    grid_u = math.lcm(*(multiple // math.gcd(side, multiple) for side in ratio))
    least_u = math.ceil(max(minimum / side for side in ratio))
    u = grid_u * math.ceil(least_u / grid_u)
    return [side * u for side in ratio]


def _grow(name: str, prefix: str, template: Any, maximum: int) -> Any:
    return Input.autogrow(name, template, prefix=prefix, min=0, max=maximum)


_CATEGORY = "model/conditioning/minimax"
_MODULE = "comfy_extras.nodes_minimax_h3"

NODES = [
    NodeSpec(
        node_id="MiniMaxH3ImageToVideo", display_name="MiniMax H3 Image to Video", category=_CATEGORY,
        python_module=_MODULE,
        description="Starts a MiniMax H3 video with sound from a prompt, optionally pinned to a given opening "
                    "and/or closing frame. Gives the encoded prompt and an empty latent of the chosen size.",
        execute=_image_to_video,
        inputs=[
            Input.link("clip", "CLIP"),
            Input.link("vae", "VAE"),
            Input.string("prompt", multiline=True, dynamic_prompts=True),
            frame_size_input("width"), frame_size_input("height"),
            Input.int("length", 124, min=5, max=3600, step=17, tooltip=LENGTH_TOOLTIP),
            Input.link("first_frame", "IMAGE", optional=True),
            Input.link("last_frame", "IMAGE", optional=True),
        ],
        outputs=[Output("CONDITIONING", "positive"), Output("LATENT")],
    ),
    NodeSpec(
        node_id="MiniMaxH3ReferenceToVideo", display_name="MiniMax H3 Reference to Video", category=_CATEGORY,
        python_module=_MODULE,
        description="Starts a MiniMax H3 video with sound that follows reference pictures, videos and sounds. "
                    "Name them in the prompt as <Picture 1>, <Video 1>, <Audio 1> and so on, counted per kind.",
        execute=_reference_to_video,
        inputs=[
            Input.link("clip", "CLIP"),
            Input.link("vae", "VAE"),
            Input.link("audio_vae", "VAE"),
            Input.string("prompt", multiline=True, dynamic_prompts=True),
            frame_size_input("width"), frame_size_input("height"),
            Input.int("length", 124, min=5, max=3600, step=17, tooltip=LENGTH_TOOLTIP),
            Input.combo("ref_image_size", ["match", "max"], "match",
                        tooltip="How reference pictures are sized for the model. match: shrunk, never enlarged, "
                                "to about the output's pixel count, proportions kept. max: shrunk only past a "
                                "2048-pixel short side; closer likeness, but every step takes longer."),
            Input.combo("ref_video_size", ["official", "match"], "official", optional=True,
                        tooltip="How reference videos are sized for the model. official: as the released "
                                "pipeline does, 768 pixels on the short side within 1344 x 768 pixels of area. "
                                "match: shrunk to about the output's pixel count."),
            _grow("ref_images", "ref_image_", Input.link(
                "ref_image", "IMAGE", tooltip="A picture the video should follow; large ones are shrunk, small "
                                              "ones are not enlarged."), 9),
            _grow("ref_videos", "ref_video_", Input.link(
                "ref_video", "IMAGE", tooltip="Frames of a video to follow, at 24 fps; 2 to 15 seconds suit "
                                              "the model."), 3),
            _grow("ref_video_audios", "ref_video_audio_", Input.link(
                "ref_video_audio", "AUDIO", tooltip="The sound of the reference video in the slot with the "
                                                    "same number."), 3),
            _grow("ref_audios", "ref_audio_", Input.link(
                "ref_audio", "AUDIO", tooltip="A sound to follow that belongs to no reference video."), 3),
        ],
        outputs=[Output("CONDITIONING", "positive"), Output("LATENT")],
    ),
    NodeSpec(
        node_id="MiniMaxH3SigmaShift", display_name="ModelSamplingMiniMaxH3", category="model/patch/minimax",
        python_module=_MODULE,
        description="Sets how far the MiniMax H3 noise schedules lean toward high noise: one shift for the "
                    "video and one for the sound.",
        execute=_sigma_shift,
        inputs=[
            Input.link("model", "MODEL"),
            Input.float("shift_video", 12.0, min=0.01, max=100.0, step=0.01),
            Input.float("shift_audio", 3.0, min=0.01, max=100.0, step=0.01),
        ],
        outputs=[Output("MODEL")],
        search_aliases=("sigma shift", "minimax shift"),
    ),
    NodeSpec(
        node_id="MiniMaxH3FunControlNetApply", display_name="Apply MiniMax H3 Fun ControlNet",
        category="model/patch/minimax", python_module=_MODULE,
        description="Makes a MiniMax H3 model follow a control video (pose, depth, edges...) and / or repaint the "
                    "masked part of a source video, through a Fun ControlNet-Union patch. Strength 0, or neither "
                    "a control video nor a mask, leaves the model as it is.",
        execute=_fun_controlnet_apply,
        inputs=[
            Input.link("model", "MODEL"),
            Input.link("model_patch", "MODEL_PATCH", tooltip="The Fun ControlNet-Union patch from ModelPatchLoader."),
            Input.link("vae", "VAE", tooltip="The H3 video VAE; it encodes the control and source videos."),
            Input.float("strength", 1.0, min=0.0, max=10.0, step=0.01,
                        tooltip="How strongly the patch steers the picture; the sound is never touched directly."),
            Input.float("start_percent", 0.0, min=0.0, max=1.0, step=0.001,
                        tooltip="Share of the sampling done before the patch starts acting."),
            Input.float("end_percent", 1.0, min=0.0, max=1.0, step=0.001,
                        tooltip="Share of the sampling done when the patch stops acting."),
            Input.link("control_video", "IMAGE", optional=True,
                       tooltip="Frames to follow; fitted to the output's size, the last repeated if too few."),
            Input.link("mask", "MASK", optional=True, tooltip="Where the patch repaints: 1 is redrawn, 0 follows source_video."),
            Input.link("source_video", "IMAGE", optional=True,
                       tooltip="Frames kept outside the masked area; ignored without a mask."),
        ],
        outputs=[Output("MODEL")],
        search_aliases=("minimax controlnet", "h3 controlnet", "video inpaint controlnet"),
    ),
    NodeSpec(
        node_id="ResolutionSelector", display_name="Resolution Selector", category="utils",
        python_module="comfy_extras.nodes_resolution",
        description="Turns a frame shape and a pixel budget into a width and a height on a chosen step.",
        execute=_resolution_selector,
        inputs=[
            Input.combo("aspect_ratio", list(ASPECT_RATIOS), "1:1 (Square)",
                        tooltip="Shape of the frame, width to height."),
            Input.float("megapixels", 1.0, min=0.1, max=16.0, step=0.1,
                        tooltip="Pixel budget in millions of pixels; 1 megapixel here is 1024 x 1024."),
            # Optional: prompts saved by editors from before these two inputs existed still validate.
            Input.int("multiple", 8, min=8, max=128, step=4, optional=True,
                      tooltip="Width and height are rounded to a multiple of this."),
            Input.int("minimum", 256, min=32, max=4096, step=32, optional=True,
                      tooltip="Smallest allowed side; below it the size grows, keeping the exact shape."),
        ],
        outputs=[Output("INT", "width", tooltip="Frame width in pixels."),
                 Output("INT", "height", tooltip="Frame height in pixels.")],
        search_aliases=("aspect ratio", "dimensions", "resolution", "image size", "megapixels"),
    ),
]
