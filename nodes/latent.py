"""Latent nodes: the empty H3 audio-video latent, and saving / loading latents as `.latent` files.

An H3 LATENT carries both streams (see models/h3/__init__.py): `samples` (video, B x 24 x T' x H/16 x
W/16), `audio_samples` (B x 32 x 2 x T_a), `frame_rate`, `length` and optional noise masks; a latent of
one stream (VAEEncode, VAEEncodeAudio, LTXVSeparateAVLatent) holds the keys of that stream, an audio one
also `"type": "audio"`. Guides are not part of the LATENT: they travel in the CONDITIONING's `keyframes`.

A `.latent` file is safetensors, laid out as ComfyUI writes it: `latent_tensor` (the video stream), the
empty `latent_format_version_0` marker and the run's prompt (and the editor's workflow) as JSON in the
metadata. Weft adds `audio_latent_tensor`, `noise_mask` / `audio_noise_mask`, any other tensor of the
LATENT under `latent.<key>`, its other entries as one JSON object (`latent_fields`) and the model family
(`latent_family`), so a saved latent reloads bit for bit (dtypes included) in another run. Loading
refuses a latent of another model family: one whose file names another family, or, for files without
the entry (ComfyUI's), whose tensors do not have H3's channel layout.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from execution.paths import atomic_write_bytes
from nodes import MAX_RESOLUTION
from nodes.files import file_metadata, output_target
from nodes.spec import Input, NodeOutput, NodeSpec, Output

LATENT_EXTENSION = ".latent"
FORMAT_MARKER = "latent_format_version_0"
# LATENT key -> tensor name in the file.
TENSOR_KEYS = {"samples": "latent_tensor", "audio_samples": "audio_latent_tensor", "noise_mask": "noise_mask",
               "audio_noise_mask": "audio_noise_mask"}
LENGTH_TOOLTIP = ("Video frames at 24 fps, raised to the next count of the form 17k + 5 that the video "
                  "encoder works in. 124 frames play for about 5 seconds; the model was trained on roughly "
                  "124 to 362 frames.")


# torch dtype -> safetensors dtype name, for the tensors a latent file holds.
_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def serialize_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Safetensors bytes with the header's keys in sorted order, so equal inputs give equal bytes.

    (The safetensors library writes its metadata from a hash map, whose order changes between runs.)
    """
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    blobs, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"cannot store tensor {name!r} of dtype {tensor.dtype} in a latent file")
        blob = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the format recommends
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def check_latent(node: str, latent: Any, *, need: tuple[str, ...] = ("samples",), name: str = "samples") -> dict:
    """Refuse anything that is not a LATENT dict holding the tensors `need` names."""
    if not isinstance(latent, dict):
        raise TypeError(f"{node}: input '{name}' must be a LATENT dict, got {type(latent).__name__}")
    for key in need:
        value = latent.get(key)
        if not isinstance(value, torch.Tensor):
            what = {"samples": "video stream ('samples')", "audio_samples": "audio stream ('audio_samples')"}
            raise ValueError(f"{node}: input '{name}' has no {what.get(key, repr(key))}; it holds "
                             f"{sorted(k for k, v in latent.items() if isinstance(v, torch.Tensor)) or 'no tensors'}")
    return latent


def empty_av_latent(node: str, width: int, height: int, length: int) -> dict:
    """An empty H3 LATENT; sizes are floored to whole 16-pixel latent cells (as ComfyUI's integer division does)."""
    from models.h3 import empty_latent

    try:
        return empty_latent(width - width % 16, height - height % 16, length)
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


def _empty_latent_av(width: int, height: int, length: int) -> tuple[dict]:
    return (empty_av_latent("EmptyMiniMaxH3LatentAV", width, height, length),)


def _empty_latent_image(width: int, height: int, batch_size: int) -> tuple[dict]:
    from models.h3 import empty_image_latent

    try:
        return (empty_image_latent(width - width % 16, height - height % 16, batch_size),)
    except ValueError as exc:
        raise ValueError(f"EmptyLatentImage: {exc}") from None


def _separate_av_latent(av_latent: dict) -> tuple[dict, dict]:
    latent = check_latent("LTXVSeparateAVLatent", av_latent, need=("samples", "audio_samples"), name="av_latent")
    timing = {key: latent[key] for key in ("frame_rate", "length") if latent.get(key) is not None}
    video = {"samples": latent["samples"], **timing}
    audio = {"audio_samples": latent["audio_samples"], "type": "audio", **timing}
    if latent.get("noise_mask") is not None:
        video["noise_mask"] = latent["noise_mask"]
    if latent.get("audio_noise_mask") is not None:
        audio["audio_noise_mask"] = latent["audio_noise_mask"]
    return video, audio


FAMILY = "minimax_h3"  # the `latent_family` entry of the files Weft writes
EXTRA_TENSOR_PREFIX = "latent."  # a LATENT tensor without a ComfyUI file name is stored as latent.<key>
# The channel layout of each H3 stream: (dimensions, channels at axis 1, size of axis 2 or None).
_H3_LAYOUT = {"samples": (5, 24, None), "audio_samples": (4, 32, 2)}


def _family_problem(latent: dict) -> str | None:
    """Why `latent` is not an H3 latent (its streams' shapes), or None."""
    for key, (dims, channels, lanes) in _H3_LAYOUT.items():
        value = latent.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        shape = tuple(value.shape)
        if value.dim() != dims or shape[1] != channels or (lanes is not None and shape[2] != lanes):
            expected = ("[B, 24, T', H/16, W/16]" if key == "samples" else "[B, 32, 2, T_a]")
            return (f"its {'video' if key == 'samples' else 'audio'} stream has shape {list(shape)}, while MiniMax "
                    f"H3's is {expected}")
    return None


def _save_latent(samples: dict, filename_prefix: str, prompt: Any = None,
                 extra_pnginfo: Any = None) -> NodeOutput:
    latent = check_latent("SaveLatent", samples, need=())
    if not any(isinstance(latent.get(key), torch.Tensor) for key in ("samples", "audio_samples")):
        raise ValueError("SaveLatent: input 'samples' holds neither a video stream ('samples') nor an audio stream "
                         "('audio_samples')")
    problem = _family_problem(latent)
    if problem is not None:
        raise ValueError(f"SaveLatent: input 'samples' is not a MiniMax H3 latent: {problem}")
    tensors = {FORMAT_MARKER: torch.tensor([])}
    fields: dict[str, Any] = {}
    for key, value in latent.items():
        if isinstance(value, torch.Tensor):
            tensors[TENSOR_KEYS.get(key, EXTRA_TENSOR_PREFIX + key)] = value.detach().contiguous().cpu()
        elif value is not None:
            try:
                fields[key] = json.loads(json.dumps(value))
            except (TypeError, ValueError):
                raise ValueError(f"SaveLatent: input 'samples' has an entry {key!r} of type {type(value).__name__} "
                                 f"that a latent file cannot hold (only tensors and plain numbers, text and lists)"
                                 ) from None
            if fields[key] != value:  # a tuple or a non-string key would come back changed
                raise ValueError(f"SaveLatent: input 'samples' has an entry {key!r} ({value!r}) that would not "
                                 f"load back equal; latent files hold plain numbers, text, lists and dicts")
    # Sorted keys: the same latent and prompt give the same file bytes.
    metadata = {k: json.dumps(v, sort_keys=True, default=str) for k, v in file_metadata(prompt, extra_pnginfo).items()}
    for key in ("frame_rate", "length"):  # also as entries of their own, as files written before held them
        if fields.get(key) is not None:
            metadata[key] = json.dumps(fields[key])
    metadata["latent_family"] = FAMILY
    metadata["latent_fields"] = json.dumps(fields, sort_keys=True)
    path, filename, subfolder = output_target("output", filename_prefix, LATENT_EXTENSION[1:])
    atomic_write_bytes(path, serialize_safetensors(tensors, metadata))
    return NodeOutput.of(ui={"latents": [{"filename": filename, "subfolder": subfolder, "type": "output"}]})


def read_latent_file(path, *, node: str = "LoadLatent", name: str = "latent") -> dict:
    """A `.latent` file (safetensors) as an H3 LATENT value; refuses another model family's latent."""
    from safetensors import safe_open

    where = f"{node}: input '{name}': {path.name}"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
        tensors = load_file(str(path), device="cpu")
    except Exception as exc:  # not safetensors: a pickle-era file or a damaged one
        raise ValueError(f"{where} is not a safetensors latent file ({exc})") from None
    if "latent_tensor" not in tensors and "audio_latent_tensor" not in tensors:
        raise ValueError(f"{where} holds no 'latent_tensor' or 'audio_latent_tensor' "
                         f"(found {', '.join(sorted(tensors)[:6]) or 'no tensors'})")
    family = metadata.get("latent_family")
    if family is not None and family != FAMILY:
        raise ValueError(f"{where} holds a latent of the {family!r} model family; Weft's models (MiniMax H3) "
                         f"cannot decode or continue it. Save the latent again from an H3 workflow.")
    latent: dict[str, Any] = {}
    by_file_key = {file_key: key for key, file_key in TENSOR_KEYS.items()}
    for file_key, tensor in tensors.items():
        if file_key in by_file_key:
            latent[by_file_key[file_key]] = tensor
        elif file_key.startswith(EXTRA_TENSOR_PREFIX):
            latent[file_key[len(EXTRA_TENSOR_PREFIX):]] = tensor
    problem = _family_problem(latent)
    if problem is not None:
        raise ValueError(f"{where} holds a latent of another model family: {problem}. Weft's models (MiniMax H3) "
                         f"cannot decode or continue it.")
    try:
        if "latent_fields" in metadata:
            fields = json.loads(metadata["latent_fields"])
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
        else:  # written before the fields were stored together: frame_rate and length only
            fields = {key: json.loads(metadata[key]) for key in ("frame_rate", "length") if key in metadata}
    except (json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{where} has unreadable latent metadata ({exc}); save the latent again") from None
    for key, value in fields.items():
        latent.setdefault(key, value)
    return latent


def _load_latent(latent: Path) -> tuple[dict]:
    return (read_latent_file(latent),)


def frame_size_input(name: str) -> Any:
    """The "width" or "height" widget of the H3 video nodes: 1344 x 768 by default, in steps of 32 pixels."""
    return Input.int(name, 1344 if name == "width" else 768, min=32, max=MAX_RESOLUTION, step=32)


NODES = [
    NodeSpec(
        node_id="EmptyMiniMaxH3LatentAV", display_name="Empty MiniMax H3 AV Latent", category="model/latent/minimax",
        python_module="comfy_extras.nodes_minimax_h3",
        description="An all-zero MiniMax H3 latent holding both picture and sound; the length becomes a "
                    "frame count of the form 5 + 17n, the next one up (24 frames a second).",
        execute=_empty_latent_av,
        inputs=[frame_size_input("width"), frame_size_input("height"), Input.int("length", 124, min=5, max=3600, step=17, tooltip=LENGTH_TOOLTIP)],
        outputs=[Output("LATENT")],
    ),
    NodeSpec(
        node_id="EmptyLatentImage", display_name="Empty Latent Image", category="latent", python_module="nodes",
        description="Empty H3 latents for single images: one latent frame each (a clip start), no sound. "
                    "Sizes are floored to multiples of 16 pixels.",
        inputs=[Input.int("width", 512, min=32, max=MAX_RESOLUTION, step=16, tooltip="Image width in pixels."),
                Input.int("height", 512, min=32, max=MAX_RESOLUTION, step=16, tooltip="Image height in pixels."),
                Input.int("batch_size", 1, min=1, max=4096, tooltip="How many images.")],
        outputs=[Output("LATENT", tooltip="One H3 latent frame per image.")],
        execute=_empty_latent_image,
    ),
    NodeSpec(
        node_id="LTXVSeparateAVLatent", display_name="LTXV Separate AV Latent", category="latent/video/ltxv",
        python_module="comfy_extras.nodes_lt",
        description="Splits an audio-video latent into a latent holding only its picture stream and one holding "
                    "only its sound stream; each keeps its own noise mask.",
        execute=_separate_av_latent,
        inputs=[Input.link("av_latent", "LATENT", tooltip="A latent carrying both streams, as the H3 sampler "
                                                          "gives it.")],
        outputs=[Output("LATENT", "video_latent", tooltip="The picture stream (and its noise mask)."),
                 Output("LATENT", "audio_latent", tooltip="The sound stream (and its noise mask).")],
    ),
    NodeSpec(
        node_id="SaveLatent", display_name="Save Latent", category="_for_testing", python_module="nodes",
        description="Saves a latent (both H3 streams) as a safetensors .latent file in the output folder.",
        execute=_save_latent, output_node=True,
        inputs=[
            Input.link("samples", "LATENT"),
            Input.string("filename_prefix", "latents/ComfyUI"),
            # ComfyUI's classic node: /object_info shows these as bare strings.
            Input.hidden("prompt", "PROMPT", as_string=True),
            Input.hidden("extra_pnginfo", "EXTRA_PNGINFO", as_string=True),
        ],
        outputs=[],
    ),
    NodeSpec(
        node_id="LoadLatent", display_name="Load Latent", category="_for_testing", python_module="nodes",
        description="Loads a .latent file (safetensors) from the input folder.",
        execute=_load_latent,
        inputs=[Input.file("latent", extensions=(LATENT_EXTENSION,))],
        outputs=[Output("LATENT")],
    ),
]
