"""H3 control over time: guides pinned to frames, per-token noise masks, saved conditioning, reference limits.

- MiniMaxH3AddGuide adds one keyframe to the positive conditioning's `keyframes` list (models/h3/__init__.py):
  an image (or a short clip) encoded by the video VAE and / or a sound encoded by the audio VAE, pinned at
  a frame. The transformer packs it as condition rows (models/h3/packing.py); the latent is not touched.
- SetLatentNoiseMask (ComfyUI's) and MiniMaxH3SetLatentNoiseMasks set the LATENT's `noise_mask` /
  `audio_noise_mask` (1 = generate, 0 = keep); MiniMaxH3FrameRangeMasks builds both masks for a range of
  frames, so "regenerate frames 7..14" is one node.
- MiniMaxH3SaveConditioning / MiniMaxH3LoadConditioning store a prompt's encoded hidden states as a
  safetensors file and feed them back instead of running the text encoder.
- ImageFromBatch and TrimAudioDuration (node ids and inputs as ComfyUI names them) take a run of frames
  and a stretch of sound out of a clip; continuation workflows use the end of one clip to guide the next.
- GRAPH_CHECKS refuses MiniMaxH3ReferenceToVideo prompts outside the reference limits at validation
  time, where every connected slot is still visible (a slot past an auto-grow group's max is otherwise
  dropped without a word).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch

from execution.errors import node_error
from execution.paths import atomic_write_bytes
from media.audio import check_audio, resample_waveform
from media.image import check_image, scale_images
from models.h3.packing import TOKEN_TAGS_KEY
from nodes.files import file_metadata, output_target
from nodes.latent import check_latent, serialize_safetensors
from nodes.loaders import check_model, check_vae
from nodes.spec import Input, NodeOutput, NodeSpec, Output
from nodes.vae import encode_frames, encode_waveform

GUIDE_NODE = "MiniMaxH3AddGuide"
CLIP_MIN_FRAMES = 5            # a guide batch shorter than this is a single image
CLIP_FRAME_STEP = 17           # longer guides are whole encoder clips: 17k + 5 frames
SPATIAL_RATIO = 16             # pixels per latent pixel
CONDITIONING_EXTENSION = ".safetensors"
CONDITIONING_KEY = "conditioning"          # (B, L, D) float32 hidden states in a saved conditioning file
CONDITIONING_MASK_KEY = "attention_mask"   # (B, L) bool, True for real tokens
CONDITIONING_TAGS_KEY = TOKEN_TAGS_KEY       # (B, L) int64 modality per token (Qwen3-VL: 0 picture/video, 1 text)
# MiniMaxH3ReferenceToVideo's limits: per kind, in all, and what a reference generation needs.
REFERENCE_GROUPS = {"ref_images": ("images", 9), "ref_videos": ("videos", 3), "ref_audios": ("audios", 3)}
REFERENCE_TOTAL_MAX = 12
REFERENCE_NODE = "MiniMaxH3ReferenceToVideo"


# ---------------------------------------------------------------------- helpers
def clip_frames(latent: dict) -> int:
    """Pixel frames of an H3 LATENT: its `length`, else what its video latent decodes to."""
    from models.h3 import pixel_frames

    return int(latent.get("length") or 0) or pixel_frames(int(latent["samples"].shape[2]))


def guide_frame_count(batch: int) -> int:
    """Frames of an image batch a guide uses: 1 below 5 frames, else the most 17k+5 frames the batch holds."""
    if batch < CLIP_MIN_FRAMES:
        return 1
    return batch - (batch - CLIP_MIN_FRAMES) % CLIP_FRAME_STEP


def resolve_frame(node: str, frame_idx: int, frames: int) -> int:
    """A frame index (negative counts from the end) as 0..frames-1; ValueError naming the clip's frames."""
    start = frame_idx + frames if frame_idx < 0 else frame_idx
    if not 0 <= start < frames:
        raise ValueError(f"{node}: frame_idx {frame_idx} is outside the clip: it has frames 0..{frames - 1} "
                         f"(or -{frames}..-1 counted from the end)")
    return start


def check_conditioning(node: str, value: Any, name: str = "positive") -> list:
    """Refuse anything that is not a CONDITIONING list of [hidden (B, L, D), extras] entries."""
    if (not isinstance(value, list) or not value
            or not all(isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], torch.Tensor)
                       and isinstance(e[1], dict) for e in value)):
        raise TypeError(f"{node}: input '{name}' must be a CONDITIONING (a list of [hidden, extras]), "
                        f"got {type(value).__name__}")
    return value


def reference_count_problem(images: int, videos: int, audios: int) -> str | None:
    """Why a reference-to-video request with these counts is refused, or None when it is within the limits."""
    counts = {"images": images, "videos": videos, "audios": audios}
    for label, limit in REFERENCE_GROUPS.values():
        if counts[label] > limit:
            return f"{counts[label]} reference {label} given; at most {limit} are allowed"
    total = images + videos + audios
    if total > REFERENCE_TOTAL_MAX:
        return (f"{total} references given ({images} images, {videos} videos, {audios} audios); at most "
                f"{REFERENCE_TOTAL_MAX} are allowed in all")
    # No reference at all is allowed: the official Fun ControlNet template generates from the prompt and
    # the control video alone.
    return None


# ---------------------------------------------------------------------- MiniMaxH3AddGuide
def _guide_video(vae: Any, image: torch.Tensor, start: int, frames: int, latent: dict) -> torch.Tensor:
    node = GUIDE_NODE
    vae = check_vae(node, vae, "video")
    image = check_image(node, image, "image")
    count = guide_frame_count(int(image.shape[0]))
    if start + count > frames:
        raise ValueError(f"{node}: the image guide has {count} frame{'s' if count > 1 else ''}; placed at frame "
                         f"{start} it covers frames {start}..{start + count - 1}, but the clip has frames "
                         f"0..{frames - 1}")
    latent_h, latent_w = int(latent["samples"].shape[-2]), int(latent["samples"].shape[-1])
    # On the target's grid: the guide becomes rows at the target's spatial positions.
    pixels = scale_images(image[:count, ..., :3], latent_w * SPATIAL_RATIO, latent_h * SPATIAL_RATIO, "bilinear",
                          "center")
    return encode_frames(node, vae, pixels, "image")


def _guide_audio(audio_vae: Any, audio: Any, start: int, latent: dict) -> torch.Tensor:
    from models.h3.latents import AUDIO_LATENT_RATE, FRAME_RATE
    from models.h3.packing import FRAME_UNITS

    node = GUIDE_NODE
    audio_vae = check_vae(node, audio_vae, "audio", "audio_vae")
    audio = check_audio(node, audio, "audio")
    batch = int(latent["audio_samples"].shape[0])
    waveform = audio["waveform"]
    if waveform.shape[0] not in (1, batch):
        raise ValueError(f"{node}: input 'audio' holds {waveform.shape[0]} clips; the latent's batch is {batch} "
                         "(give one clip, or one per batch element)")
    audio_t = int(latent["audio_samples"].shape[-1])
    # The guide's audio rows start at audio latent frame 5/3 * start (40 per second, 24 frames per second)
    # and must end inside the clip's sound: whole latent frames of room from there to the end.
    room = math.floor(audio_t - FRAME_UNITS * start + 1e-9)
    if room < 1:
        raise ValueError(f"{node}: an audio guide at frame {start} starts {start / FRAME_RATE:.3f} s into the clip, "
                         f"whose sound ends at {audio_t / AUDIO_LATENT_RATE:.3f} s (frame {clip_frames(latent) - 1} is "
                         "the last); there is no room for it")
    rate = audio_vae.audio_sample_rate
    hop = rate // AUDIO_LATENT_RATE
    waveform = resample_waveform(waveform.float(), int(audio["sample_rate"]), rate)[..., :room * hop]
    return encode_waveform(node, audio_vae, {"waveform": waveform, "sample_rate": rate}, "audio")


def add_guide(positive: list, latent: dict, frame_idx: int, vae: Any = None, audio_vae: Any = None,
              image: torch.Tensor | None = None, audio: Any = None) -> tuple[list]:
    """MiniMaxH3AddGuide: `positive` with one more keyframe (image and / or audio) pinned at `frame_idx`."""
    node = GUIDE_NODE
    positive = check_conditioning(node, positive)
    latent = check_latent(node, latent, need=("samples", "audio_samples"), name="latent")
    if image is None and audio is None:
        raise ValueError(f"{node}: connect an image or an audio clip (or both); a guide needs at least one")
    if image is not None and vae is None:
        raise ValueError(f"{node}: an image guide needs the video VAE on input 'vae'")
    if audio is not None and audio_vae is None:
        raise ValueError(f"{node}: an audio guide needs the audio VAE on input 'audio_vae'")
    frames = clip_frames(latent)
    start = resolve_frame(node, int(frame_idx), frames)
    keyframe: dict[str, Any] = {"frame_index": start, "latent": None, "audio_latent": None}
    if image is not None:
        keyframe["latent"] = _guide_video(vae, image, start, frames, latent)
    if audio is not None:
        keyframe["audio_latent"] = _guide_audio(audio_vae, audio, start, latent)
    # New lists and dicts: the upstream conditioning (maybe a cached text encoding) stays as it was.
    out = [[hidden, {**extras, "keyframes": [*(extras.get("keyframes") or []), keyframe]}]
           for hidden, extras in positive]
    return (out,)


# ---------------------------------------------------------------------- noise masks
def _mask_tensor(node: str, name: str, mask: Any) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 3) or mask.numel() == 0:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{node}: input '{name}' must be a MASK tensor (frames, H, W) or (H, W), got {shape}")
    return mask.detach().float().cpu()


def video_noise_mask(node: str, name: str, mask: Any, latent: dict) -> torch.Tensor:
    """A MASK (frames, H, W) as the LATENT's video noise mask (1, 1, frames, H, W), checked against the latent.

    The MASK's batch is time: 1 frame (the same mask for every frame), one per latent frame, or one per
    pixel frame. H, W may be the latent's size or any multiple of it (a pixel mask)."""
    from models.h3 import packing

    m = _mask_tensor(node, name, mask)
    if m.dim() == 2:
        m = m[None]
    b, _, lt, lh, lw = latent["samples"].shape
    frames = clip_frames(latent)
    if m.shape[0] not in (1, lt, frames):
        raise ValueError(f"{node}: input '{name}' has {m.shape[0]} frames; the latent needs 1, {lt} (latent frames) "
                         f"or {frames} (pixel frames)")
    try:
        packing.reduce_video_mask(m, b, lt, lh, lw)
    except ValueError as exc:
        raise ValueError(f"{node}: input '{name}': {exc}") from None
    return m[None, None]


def audio_noise_mask(node: str, name: str, mask: Any, latent: dict) -> torch.Tensor:
    """A MASK whose last axis is the audio latent frames (40 per second) as the LATENT's audio noise mask (1, T_a).

    Other axes are reduced by max; a last axis of 1 is the same value for the whole clip."""
    from models.h3 import packing

    m = _mask_tensor(node, name, mask)
    b, _, _, audio_t = latent["audio_samples"].shape
    m = m.reshape(-1, m.shape[-1]).amax(dim=0, keepdim=True)
    if m.shape[-1] not in (1, audio_t):
        raise ValueError(f"{node}: input '{name}' has {m.shape[-1]} values on its last axis; the latent's audio "
                         f"has {audio_t} latent frames (40 per second)")
    packing.reduce_audio_mask(m, b, audio_t)
    return m


def _set_latent_noise_mask(samples: dict, mask: torch.Tensor) -> tuple[dict]:
    node = "SetLatentNoiseMask"
    latent = check_latent(node, samples)
    return ({**latent, "noise_mask": video_noise_mask(node, "mask", mask, latent)},)


def _set_latent_noise_masks(samples: dict, video_mask: torch.Tensor | None = None,
                            audio_mask: torch.Tensor | None = None) -> tuple[dict]:
    node = "MiniMaxH3SetLatentNoiseMasks"
    latent = check_latent(node, samples, need=("samples", "audio_samples"))
    if video_mask is None and audio_mask is None:
        raise ValueError(f"{node}: connect a video_mask, an audio_mask or both")
    out = dict(latent)
    if video_mask is not None:
        out["noise_mask"] = video_noise_mask(node, "video_mask", video_mask, latent)
    if audio_mask is not None:
        out["audio_noise_mask"] = audio_noise_mask(node, "audio_mask", audio_mask, latent)
    return (out,)


def frame_range_masks(latent: dict, start_frame: int, frame_count: int, *,
                      node: str = "MiniMaxH3FrameRangeMasks") -> tuple[torch.Tensor, torch.Tensor]:
    """(video MASK (frames, h, w), audio MASK (1, 1, T_a)): 1 over `frame_count` frames from `start_frame`, else 0.

    An audio latent frame is 1 when its 25 ms overlap the range's time span at the clip's frame rate."""
    from models.h3.latents import AUDIO_LATENT_RATE, FRAME_RATE

    frames = clip_frames(latent)
    start = resolve_frame(node, int(start_frame), frames)
    if frame_count < 1 or start + frame_count > frames:
        raise ValueError(f"{node}: {frame_count} frames from frame {start} end at frame {start + frame_count - 1}; "
                         f"the clip has frames 0..{frames - 1}")
    _, _, _, lh, lw = latent["samples"].shape
    video = torch.zeros(frames, lh, lw)
    video[start:start + frame_count] = 1.0
    fps = float(latent.get("frame_rate") or FRAME_RATE)
    audio_t = int(latent["audio_samples"].shape[-1]) if isinstance(latent.get("audio_samples"), torch.Tensor) else 0
    t0, t1 = start / fps, (start + frame_count) / fps
    k = torch.arange(audio_t, dtype=torch.float64)
    audio = ((k + 1) / AUDIO_LATENT_RATE > t0 + 1e-9) & (k / AUDIO_LATENT_RATE < t1 - 1e-9)
    return video, audio.float().reshape(1, 1, audio_t)


def _frame_range_masks(samples: dict, start_frame: int, frame_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    latent = check_latent("MiniMaxH3FrameRangeMasks", samples)
    return frame_range_masks(latent, start_frame, frame_count)


# ---------------------------------------------------------------------- saved conditioning
def _save_conditioning(conditioning: list, filename_prefix: str, prompt: Any = None,
                       extra_pnginfo: Any = None) -> NodeOutput:
    node = "MiniMaxH3SaveConditioning"
    conditioning = check_conditioning(node, conditioning, "conditioning")
    if len(conditioning) != 1:
        raise ValueError(f"{node}: input 'conditioning' has {len(conditioning)} entries; H3 conditioning has one")
    hidden, extras = conditioning[0]
    if hidden.dim() != 3:
        raise ValueError(f"{node}: conditioning hidden states must be (B, L, D), got {tuple(hidden.shape)}")
    tensors = {CONDITIONING_KEY: hidden.detach().float().contiguous().cpu()}
    mask = extras.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        tensors[CONDITIONING_MASK_KEY] = mask.detach().bool().contiguous().cpu()
    tags = extras.get(TOKEN_TAGS_KEY)
    if isinstance(tags, torch.Tensor):
        tensors[CONDITIONING_TAGS_KEY] = tags.detach().long().contiguous().cpu()
    metadata = {k: json.dumps(v, sort_keys=True, default=str) for k, v in file_metadata(prompt, extra_pnginfo).items()}
    metadata["width"] = str(int(hidden.shape[-1]))
    path, filename, subfolder = output_target("output", filename_prefix, CONDITIONING_EXTENSION[1:])
    atomic_write_bytes(path, serialize_safetensors(tensors, metadata))
    return NodeOutput.of(ui={"conditioning": [{"filename": filename, "subfolder": subfolder, "type": "output"}]})


def read_conditioning_file(path: Any, *, node: str = "MiniMaxH3LoadConditioning") -> list:
    """A saved conditioning file (safetensors: `conditioning` (B, L, D) or (L, D), optional `attention_mask` and
    `token_tags`)."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path), device="cpu")
    except Exception as exc:  # not safetensors (a pickle, a damaged file)
        raise ValueError(f"{node}: {path.name} is not a safetensors conditioning file ({exc})") from None
    hidden = tensors.get(CONDITIONING_KEY)
    if hidden is None:
        raise ValueError(f"{node}: {path.name} holds no '{CONDITIONING_KEY}' tensor (found "
                         f"{', '.join(sorted(tensors)[:6]) or 'no tensors'}); save one with MiniMaxH3SaveConditioning")
    if hidden.dim() == 2:
        hidden = hidden[None]
    if hidden.dim() != 3 or hidden.shape[1] == 0:
        raise ValueError(f"{node}: {path.name}: '{CONDITIONING_KEY}' must be (B, L, D), got {tuple(hidden.shape)}")
    mask = tensors.get(CONDITIONING_MASK_KEY)
    if mask is None:
        mask = torch.ones(hidden.shape[:2], dtype=torch.bool)
    if mask.numel() != hidden.shape[0] * hidden.shape[1]:
        raise ValueError(f"{node}: {path.name}: '{CONDITIONING_MASK_KEY}' of shape {tuple(mask.shape)} does not match "
                         f"the hidden states {tuple(hidden.shape)}")
    extras = {"attention_mask": mask.bool().reshape(hidden.shape[:2])}
    tags = tensors.get(CONDITIONING_TAGS_KEY)
    if tags is not None:
        if tags.numel() != hidden.shape[0] * hidden.shape[1]:
            raise ValueError(f"{node}: {path.name}: '{CONDITIONING_TAGS_KEY}' of shape {tuple(tags.shape)} does not "
                             f"match the hidden states {tuple(hidden.shape)}")
        extras[TOKEN_TAGS_KEY] = tags.long().reshape(hidden.shape[:2])
    return [[hidden.float(), extras]]


def _load_conditioning(model: Any, conditioning: Path) -> tuple[list]:
    node = "MiniMaxH3LoadConditioning"
    model = check_model(node, model)
    path = conditioning
    loaded = read_conditioning_file(path, node=node)
    width = int(loaded[0][0].shape[-1])
    config = getattr(getattr(model, "model", model), "config", None)
    expected = getattr(config, "text_dim", None)
    if expected is not None and width != int(expected):
        name = getattr(model, "name", "")
        raise ValueError(f"{node}: {path.name} holds conditioning of width {width}, but the model"
                         f"{f' {name!r}' if name else ''} reads conditioning of width {expected} (its text "
                         "encoder's width); it was saved for another model")
    return (loaded,)


# ---------------------------------------------------------------------- cutting clips
def _image_from_batch(image: torch.Tensor, batch_index: int, length: int) -> tuple[torch.Tensor]:
    image = check_image("ImageFromBatch", image)
    available = int(image.shape[0])
    # An index past the end picks the last frame; a length past the end stops there.
    first = min(int(batch_index), available - 1)
    last = min(first + int(length), available)
    return (image[first:last].clone(),)


def _trim_audio_duration(audio: dict, start_index: float, duration: float) -> tuple[dict]:
    node = "TrimAudioDuration"
    audio = check_audio(node, audio)
    waveform, rate = audio["waveform"], int(audio["sample_rate"])
    samples = int(waveform.shape[-1])
    first = int(round(float(start_index) * rate))
    if first < 0:  # seconds before the end
        first += samples
    first = min(max(first, 0), samples - 1)  # on a sample of the clip, whatever was asked
    stop = min(max(first + int(round(float(duration) * rate)), 0), samples)
    if first >= stop:
        raise ValueError(f"{node}: start {start_index} s and duration {duration} s select no sound from a clip of "
                         f"{samples / rate:.3f} s")
    return ({**audio, "waveform": waveform[..., first:stop]},)


# ---------------------------------------------------------------------- reference limits (a graph check)
def check_reference_limits(prompt: Any, registry: Any, options: Mapping[str, Any]) -> dict[str, list[dict]]:
    """Validation: every MiniMaxH3ReferenceToVideo node's connected reference slots are within the limits."""
    errors: dict[str, list[dict]] = {}
    for node_id, node in prompt.nodes.items():
        if node.class_type != REFERENCE_NODE:
            continue
        counts = {label: 0 for label, _ in REFERENCE_GROUPS.values()}
        for key, value in node.inputs.items():
            group = key.partition(".")[0]
            if group in REFERENCE_GROUPS and value is not None:
                counts[REFERENCE_GROUPS[group][0]] += 1
        problem = reference_count_problem(counts["images"], counts["videos"], counts["audios"])
        if problem:
            errors[node_id] = [node_error("custom_validation_failed", f"Node {node.label}: {REFERENCE_NODE}: {problem}",
                                          problem)]
    return errors


GRAPH_CHECKS = [check_reference_limits]


# ---------------------------------------------------------------------- declarations
_CATEGORY = "model/conditioning/minimax"
_MODULE = "comfy_extras.nodes_minimax_h3"

NODES = [
    NodeSpec(
        node_id=GUIDE_NODE, display_name="MiniMax H3 Add Guide", category=_CATEGORY, python_module=_MODULE,
        description="Anchors a picture (or a few frames) and / or a sound at one frame of the generated clip. The "
                    "anchor travels inside the positive conditioning as extra condition tokens; the latent and its "
                    "noise masks are left alone. Chain the node to place several anchors.",
        execute=add_guide,
        inputs=[
            Input.link("positive", "CONDITIONING", tooltip="Conditioning that receives the anchor."),
            Input.link("latent", "LATENT", tooltip="Latent of the clip to generate; only its size and length are "
                                                   "read."),
            Input.int("frame_idx", 0, min=-9999, max=9999, step=1,
                      tooltip="Frame where the anchor begins; -1 is the last frame, -2 the one before, and so on."),
            Input.link("vae", "VAE", optional=True, tooltip="H3 video VAE; required with an image."),
            Input.link("audio_vae", "VAE", optional=True, tooltip="H3 audio VAE; required with a sound."),
            Input.link("image", "IMAGE", optional=True,
                       tooltip="Anchor frames. Under 5 frames only the first counts; longer batches keep the "
                               "largest 17k+5 frame count they hold. Resized and cropped to the clip's size."),
            Input.link("audio", "AUDIO", optional=True,
                       tooltip="Anchor sound; converted to 32 kHz and shortened so it stops inside the clip."),
        ],
        outputs=[Output("CONDITIONING", "positive")],
        search_aliases=("guide", "keyframe", "add guide", "video continuation"),
    ),
    NodeSpec(
        node_id="SetLatentNoiseMask", display_name="Set Latent Noise Mask", category="latent/inpaint",
        python_module="nodes",
        description="Marks which parts of the picture are sampled again (1) and which stay as they are (0). The "
                    "MASK's batch axis is time: one mask for all frames, or one per latent or per pixel frame.",
        execute=_set_latent_noise_mask,
        inputs=[Input.link("samples", "LATENT"), Input.link("mask", "MASK")],
        outputs=[Output("LATENT")],
    ),
    NodeSpec(
        node_id="MiniMaxH3SetLatentNoiseMasks", display_name="MiniMax H3 Set Latent Noise Masks",
        category="model/latent/minimax", python_module=_MODULE,
        description="Sets the video and / or audio noise masks of an H3 latent (1 regenerates, 0 keeps); an "
                    "unconnected mask leaves that stream's mask as it was.",
        execute=_set_latent_noise_masks,
        inputs=[
            Input.link("samples", "LATENT"),
            Input.link("video_mask", "MASK", optional=True,
                       tooltip="(frames, H, W): 1, latent or pixel frames; latent or pixel size. Reduced to the "
                               "transformer's 2x2 patches by max."),
            Input.link("audio_mask", "MASK", optional=True,
                       tooltip="Last axis: the audio latent frames (40 per second) or 1; other axes reduced by max."),
        ],
        outputs=[Output("LATENT")],
        search_aliases=("inpaint", "audio mask", "noise mask"),
    ),
    NodeSpec(
        node_id="MiniMaxH3FrameRangeMasks", display_name="MiniMax H3 Frame Range Masks",
        category="model/latent/minimax", python_module=_MODULE,
        description="Video and audio noise masks that regenerate a range of frames (and the sound under them) and "
                    "keep the rest.",
        execute=_frame_range_masks,
        inputs=[
            Input.link("samples", "LATENT", tooltip="The latent the masks are for (its size and length)."),
            Input.int("start_frame", 0, min=-9999, max=9999, tooltip="First frame to regenerate; negative counts "
                                                                     "from the end."),
            Input.int("frame_count", 1, min=1, max=9999, tooltip="How many frames to regenerate."),
        ],
        outputs=[Output("MASK", "video_mask"), Output("MASK", "audio_mask")],
    ),
    NodeSpec(
        node_id="MiniMaxH3SaveConditioning", display_name="MiniMax H3 Save Conditioning", category="conditioning",
        python_module=_MODULE, output_node=True,
        description="Saves a prompt's encoded hidden states (and attention mask) as a safetensors file in the output "
                    "folder, to be loaded with MiniMaxH3LoadConditioning instead of encoding again. Guides and "
                    "references are not saved.",
        execute=_save_conditioning,
        inputs=[
            Input.link("conditioning", "CONDITIONING"),
            Input.string("filename_prefix", "conditioning/ComfyUI"),
            Input.hidden("prompt", "PROMPT"), Input.hidden("extra_pnginfo", "EXTRA_PNGINFO"),
        ],
        outputs=[],
    ),
    NodeSpec(
        node_id="MiniMaxH3LoadConditioning", display_name="MiniMax H3 Load Conditioning", category="conditioning",
        python_module=_MODULE,
        description="Loads precomputed conditioning (a safetensors file from MiniMaxH3SaveConditioning, in the input "
                    "folder) instead of running the text encoder; refused when its width is not the model's.",
        execute=_load_conditioning,
        inputs=[
            Input.link("model", "MODEL", tooltip="The diffusion model the conditioning is for (its width is checked)."),
            Input.file("conditioning", extensions=(CONDITIONING_EXTENSION,),
                       tooltip="A conditioning file in the input folder."),
        ],
        outputs=[Output("CONDITIONING")],
    ),
    NodeSpec(
        node_id="ImageFromBatch", display_name="Image From Batch", category="image/batch", python_module="nodes",
        description="Copies `length` frames out of a batch, beginning at frame `batch_index`; both are cut back "
                    "to what the batch holds.",
        execute=_image_from_batch,
        inputs=[
            Input.link("image", "IMAGE"),
            Input.int("batch_index", 0, min=0, max=4095),
            Input.int("length", 1, min=1, max=4096),
        ],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="TrimAudioDuration", display_name="Trim Audio Duration", category="audio",
        python_module="comfy_extras.nodes_audio",
        description="Keeps `duration` seconds of the sound, beginning `start_index` seconds in; the kept stretch "
                    "ends early where the sound ends.",
        execute=_trim_audio_duration,
        inputs=[
            Input.link("audio", "AUDIO"),
            Input.float("start_index", 0.0, min=-0xFFFFFFFFFFFFFFFF, max=0xFFFFFFFFFFFFFFFF, step=0.01,
                        tooltip="Where the kept stretch begins, in seconds (fractions allowed); a negative value "
                                "is measured back from the end."),
            Input.float("duration", 60.0, min=0.0, step=0.01, tooltip="How many seconds to keep."),
        ],
        outputs=[Output("AUDIO")],
    ),
]
