"""MiniMax H3 nodes: task conditioning (text / first-last frame / references to video with audio), the
sigma shifts, and the resolution selector the official templates use.

MiniMaxH3ImageToVideo and MiniMaxH3ReferenceToVideo return the prompt's CONDITIONING and an empty H3
LATENT of the requested size. Keyframes (first / last frame) and references (images, videos with their
soundtracks, audios) are encoded with the VAEs and ride in the conditioning's extras as `keyframes` and
`references` (models/h3/__init__.py); the transformer packs them as clean condition rows.

Weft's text encoder reads text only: the reference tags of a prompt (<Picture 1>, <Audio 1>, ...) stay
plain text, and the images are not shown to it (the real model's Qwen3-VL also sees them).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from nodes.image import MAX_RESOLUTION, check_image, scale_images
from nodes.latent import LENGTH_TOOLTIP, empty_av_latent
from nodes.loaders import check_clip, check_model, check_vae, with_options
from nodes.spec import Input, NodeSpec, Output
from nodes.vae import encode_frames, encode_waveform

CANVAS_MULTIPLE = 32           # H3 sizes are multiples of 32 pixels (whole 1x2x2 patches of 16x latents)
BASE_SHORT_EDGE = 768          # the reference-video canvas of the released model
MAX_CANVAS_PIXELS = 768 * 1344
REF_IMAGE_SHORT_EDGE = 2048    # 'max' reference image sizing
REF_VIDEO_MIN_FRAMES = 5
ASPECT_RATIOS = {
    "1:1 (Square)": (1, 1), "3:2 (Photo)": (3, 2), "4:3 (Standard)": (4, 3), "16:9 (Widescreen)": (16, 9),
    "21:9 (Ultrawide)": (21, 9), "2:3 (Portrait Photo)": (2, 3), "3:4 (Portrait Standard)": (3, 4),
    "9:16 (Portrait Widescreen)": (9, 16),
}


# ---------------------------------------------------------------------- sizing
def _grid(value: float) -> int:
    return max(CANVAS_MULTIPLE, round(value / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)


def _grid_floor(value: float) -> int:
    return max(CANVAS_MULTIPLE, math.floor(value / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)


def downscale_to_area(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) on the 32-pixel grid with at most `max_pixels`, keeping the aspect; never enlarges."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    sw, sh = width * scale, height * scale
    # Nearest grid size, but rounding may not turn a down-scale into an up-scale.
    tw, th = min(_grid(sw), _grid_floor(width)), min(_grid(sh), _grid_floor(height))
    if tw * th > max_pixels:
        tw, th = _grid_floor(sw), _grid_floor(sh)
    while tw * th > max_pixels and (tw > CANVAS_MULTIPLE or th > CANVAS_MULTIPLE):
        if tw >= th and tw > CANVAS_MULTIPLE:
            tw -= CANVAS_MULTIPLE
        else:
            th -= CANVAS_MULTIPLE
    return tw, th


def official_video_canvas(width: int, height: int) -> tuple[int, int]:
    """The released model's reference-video canvas: 768-pixel short edge, at most 768 x 1344 pixels."""
    ratio = width / height
    w, h = (BASE_SHORT_EDGE * ratio, BASE_SHORT_EDGE) if ratio >= 1 else (BASE_SHORT_EDGE, BASE_SHORT_EDGE / ratio)
    if w * h > MAX_CANVAS_PIXELS:
        shrink = math.sqrt(MAX_CANVAS_PIXELS / (w * h))
        w, h = w * shrink, h * shrink
    tw, th = _grid(w), _grid(h)
    if width * height < tw * th:  # a smaller source keeps its own size (on the grid)
        tw, th = _grid(width), _grid(height)
    return tw, th


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
    keyframes = []
    if first_frame is not None or last_frame is not None:
        vae = check_vae(node, vae, "video")
    if first_frame is not None:
        # The first frame fixes the geometry: stretched to the canvas.
        image = _resize(check_image(node, first_frame, "first_frame")[:1], width, height, "disabled")
        keyframes.append({"frame_index": 0, "latent": encode_frames(node, vae, image, "first_frame")})
    if last_frame is not None:
        # The last frame follows it: scaled to cover the canvas, centre-cropped.
        image = _resize(check_image(node, last_frame, "last_frame")[:1], width, height, "center")
        keyframes.append({"frame_index": frames - 1, "latent": encode_frames(node, vae, image, "last_frame")})
    conditioning = clip.encode(prompt, node=node)
    if keyframes:
        conditioning = _with_extras(conditioning, keyframes=keyframes)
    return conditioning, latent


def _reference_to_video(clip: Any, vae: Any, audio_vae: Any, prompt: str, width: int, height: int, length: int,
                        ref_image_size: str = "match", ref_images: dict | None = None, ref_videos: dict | None = None,
                        ref_video_audios: dict | None = None, ref_audios: dict | None = None,
                        ref_video_size: str = "official") -> tuple[list, dict]:
    node = "MiniMaxH3ReferenceToVideo"
    clip = check_clip(node, clip)
    latent = empty_av_latent(node, width, height, length)
    frames, width, height = latent["length"], width - width % 16, height - height % 16
    references: list[dict] = []

    for name, image in (ref_images or {}).items():
        if image is None:
            continue
        vae = check_vae(node, vae, "video")
        image = check_image(node, image, f"ref_images.{name}")
        h, w = int(image.shape[1]), int(image.shape[2])
        if ref_image_size == "match":
            tw, th = downscale_to_area(w, h, width * height)
        elif ref_image_size == "max":
            scale = min(1.0, REF_IMAGE_SHORT_EDGE / min(w, h))
            tw, th = _grid(w * scale), _grid(h * scale)
        else:
            raise ValueError(f"{node}: ref_image_size {ref_image_size!r} is not 'match' or 'max'")
        resized = _resize(image[:1], tw, th, "disabled")
        references.append({"kind": "image", "latent": encode_frames(node, vae, resized, f"ref_images.{name}")})

    soundtracks = ref_video_audios or {}
    for name, video in (ref_videos or {}).items():
        if video is None:
            continue
        vae = check_vae(node, vae, "video")
        video = check_image(node, video, f"ref_videos.{name}")
        vh, vw = int(video.shape[1]), int(video.shape[2])
        if ref_video_size == "official":
            cw, ch = official_video_canvas(vw, vh)
        elif ref_video_size == "match":
            cw, ch = downscale_to_area(vw, vh, min(width * height, MAX_CANVAS_PIXELS))
        else:
            raise ValueError(f"{node}: ref_video_size {ref_video_size!r} is not 'official' or 'match'")
        count = min(int(video.shape[0]), frames)
        if count < REF_VIDEO_MIN_FRAMES:
            raise ValueError(f"{node}: reference video {name} has {video.shape[0]} frames; at least "
                             f"{REF_VIDEO_MIN_FRAMES} (about 0.2 s at 24 fps) are needed")
        count -= (count - 5) % 17  # whole encoder clips: 17k + 5 frames
        clip_frames = _resize(video[:count], cw, ch, "disabled")
        entry = {"kind": "video", "latent": encode_frames(node, vae, clip_frames, f"ref_videos.{name}"),
                 "audio_latent": None}
        # ref_video_audio_N is the soundtrack of ref_video_N.
        soundtrack = soundtracks.get("ref_video_audio_" + name.rsplit("_", 1)[-1])
        if soundtrack is not None:
            audio_vae = check_vae(node, audio_vae, "audio", "audio_vae")
            entry["audio_latent"] = encode_waveform(node, audio_vae, _first(soundtrack), "ref_video_audios")[:1]
        references.append(entry)

    for name, audio in (ref_audios or {}).items():
        if audio is None:
            continue
        audio_vae = check_vae(node, audio_vae, "audio", "audio_vae")
        references.append({"kind": "audio",
                           "audio_latent": encode_waveform(node, audio_vae, _first(audio), f"ref_audios.{name}")[:1]})

    conditioning = clip.encode(prompt, node=node)
    if references:
        conditioning = _with_extras(conditioning, references=references)
    return conditioning, latent


def _first(audio: Any) -> Any:
    # A reference is one clip: the first of a batch.
    if isinstance(audio, dict) and isinstance(audio.get("waveform"), torch.Tensor):
        return {**audio, "waveform": audio["waveform"][:1]}
    return audio


def _sigma_shift(model: Any, shift_video: float, shift_audio: float) -> tuple[Any]:
    model = check_model("MiniMaxH3SigmaShift", model)
    return (with_options(model, h3_shifts=(float(shift_video), float(shift_audio))),)


def _resolution_selector(aspect_ratio: str, megapixels: float, multiple: int = 8,
                         minimum: int = 256) -> tuple[int, int]:
    if aspect_ratio not in ASPECT_RATIOS:
        raise ValueError(f"ResolutionSelector: aspect_ratio {aspect_ratio!r} is not one of {', '.join(ASPECT_RATIOS)}")
    if multiple < 1:
        raise ValueError(f"ResolutionSelector: multiple must be positive, got {multiple}")
    w_ratio, h_ratio = ASPECT_RATIOS[aspect_ratio]
    unit = math.sqrt(megapixels * 1024 * 1024 / (w_ratio * h_ratio))  # pixels per aspect unit
    width = round(w_ratio * unit / multiple) * multiple
    height = round(h_ratio * unit / multiple) * multiple
    if width < minimum or height < minimum:
        # The smallest size that keeps the exact ratio, is on the grid and reaches the minimum on both sides.
        step_w = multiple // math.gcd(w_ratio, multiple)
        step_h = multiple // math.gcd(h_ratio, multiple)
        k_step = step_w * step_h // math.gcd(step_w, step_h)
        k = math.ceil(math.ceil(max(minimum / w_ratio, minimum / h_ratio)) / k_step) * k_step
        width, height = w_ratio * k, h_ratio * k
    return int(width), int(height)


def _size(name: str) -> Any:
    return Input.int(name, 1344 if name == "width" else 768, min=32, max=MAX_RESOLUTION, step=32)


def _grow(name: str, prefix: str, template: Any, maximum: int) -> Any:
    return Input.autogrow(name, template, prefix=prefix, min=0, max=maximum)


_CATEGORY = "model/conditioning/minimax"
_MODULE = "comfy_extras.nodes_minimax_h3"

NODES = [
    NodeSpec(
        node_id="MiniMaxH3ImageToVideo", display_name="MiniMax H3 Image to Video", category=_CATEGORY,
        python_module=_MODULE,
        description="Text (and optional first / last frame) to video with audio: the prompt's conditioning and an "
                    "empty joint latent.",
        execute=_image_to_video,
        inputs=[
            Input.link("clip", "CLIP"),
            Input.link("vae", "VAE"),
            Input.string("prompt", multiline=True, dynamic_prompts=True),
            _size("width"), _size("height"),
            Input.int("length", 124, min=5, max=3600, step=17, tooltip=LENGTH_TOOLTIP),
            Input.link("first_frame", "IMAGE", optional=True),
            Input.link("last_frame", "IMAGE", optional=True),
        ],
        outputs=[Output("CONDITIONING", "positive"), Output("LATENT")],
    ),
    NodeSpec(
        node_id="MiniMaxH3ReferenceToVideo", display_name="MiniMax H3 Reference to Video", category=_CATEGORY,
        python_module=_MODULE,
        description="<Picture i> / <Video k> / <Audio j> reference conditioning for MiniMax H3. Use the same tags "
                    "when prompting.",
        execute=_reference_to_video,
        inputs=[
            Input.link("clip", "CLIP"),
            Input.link("vae", "VAE"),
            Input.link("audio_vae", "VAE"),
            Input.string("prompt", multiline=True, dynamic_prompts=True),
            _size("width"), _size("height"),
            Input.int("length", 124, min=5, max=3600, step=17,
                      tooltip="Frame count at 24 fps, (124 = ~5s, trained range is ~124-362)"),
            Input.combo("ref_image_size", ["match", "max"], "match",
                        tooltip="Reference image sizing. 'match' scales each reference (down only, keeping aspect) "
                                "to the generation's pixel area; 'max' uses a 2048 px short edge (slower)."),
            Input.combo("ref_video_size", ["official", "match"], "official", optional=True,
                        tooltip="Reference video sizing. 'official' keeps the 768 px short-edge recipe (up to "
                                "1344x768); 'match' scales down to the generation's pixel area."),
            _grow("ref_images", "ref_image_", Input.link(
                "ref_image", "IMAGE", tooltip="Reference image (downscaled, never upscaled)"), 9),
            _grow("ref_videos", "ref_video_", Input.link(
                "ref_video", "IMAGE", tooltip="Reference video frames at 24 fps (2-15s)"), 3),
            _grow("ref_video_audios", "ref_video_audio_", Input.link(
                "ref_video_audio", "AUDIO", tooltip="Soundtrack of the same-numbered reference video"), 3),
            _grow("ref_audios", "ref_audio_", Input.link(
                "ref_audio", "AUDIO", tooltip="Standalone reference audio"), 3),
        ],
        outputs=[Output("CONDITIONING", "positive"), Output("LATENT")],
    ),
    NodeSpec(
        node_id="MiniMaxH3SigmaShift", display_name="ModelSamplingMiniMaxH3", category="model/patch/minimax",
        python_module=_MODULE, description="Set the video/audio flow shifts.",
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
        node_id="ResolutionSelector", display_name="Resolution Selector", category="utils",
        python_module="comfy_extras.nodes_resolution",
        description="Calculate width and height from aspect ratio and megapixel target.",
        execute=_resolution_selector,
        inputs=[
            Input.combo("aspect_ratio", list(ASPECT_RATIOS), "1:1 (Square)",
                        tooltip="The aspect ratio for the output dimensions."),
            Input.float("megapixels", 1.0, min=0.1, max=16.0, step=0.1,
                        tooltip="Target total megapixels. 1.0 MP is about 1024x1024 for square."),
            # Optional: prompts saved by editors from before these two inputs existed still validate.
            Input.int("multiple", 8, min=8, max=128, step=4, optional=True,
                      tooltip="Nearest multiple of the result to set the selected resolution to."),
            Input.int("minimum", 256, min=32, max=4096, step=32, optional=True,
                      tooltip="Set minimum resolution for any side to be used"),
        ],
        outputs=[Output("INT", "width", tooltip="Calculated width in pixels."),
                 Output("INT", "height", tooltip="Calculated height in pixels.")],
        search_aliases=("aspect ratio", "dimensions", "resolution", "image size", "megapixels"),
    ),
]
