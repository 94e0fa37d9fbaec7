"""Safetensors loading, checkpoint detection by keys, and config recovery from tensor shapes.

Only `.safetensors` and GGUF files are read (never pickle). Headers are read without loading tensors; weights
are read one by one (`safe_open`, memory-mapped; models/gguf.py for GGUF) into a model built on the meta
device, so a large checkpoint never exists twice in memory. A GGUF file's block-typed 2-D weights become
quantized layers of its block type (models/quant/formats/gguf.py); its names are detected like a
safetensors file's. Every expected tensor's shape is checked and a mismatch
names the key. Refusals say what was found and what is supported.

Architectures (detected by keys, optionally under a prefix such as `model.diffusion_model.`):
- h3_transformer: `video_patch_proj.weight` + `audio_patch_proj.weight`
- h3_video_vae: `encoder.conv_in.weight` + `decoder.x_embedder.weight`
- h3_audio_vae: `pre_block.attn.qkv.weight` + `decoder.conv_pre.weight`
- h3_text_encoder: `embed_tokens.weight` + `layers.0.attn.qkv_proj.weight` (Weft's small stand-in encoder)
- qwen3vl: `visual.deepstack_merger_list.0.norm.weight` + `model.layers.0.self_attn.q_proj.weight` (the
  Qwen3-VL encoder H3 is conditioned on; Hugging Face's `model.language_model.` / `model.visual.` names are
  read as `model.` / `visual.`)
- h3_fun_control: `control_proj_in.weight` + `control_blocks.0.after_proj.weight` (the Fun ControlNet-Union
  model patch; its metadata gives the injection layers and the modulation form)
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from models import gguf as gguf_files
from models.memory import compute_dtype
from models.ops import QuantizedEmbedding, QuantizedLinear
from models.quant.formats import EMBEDDABLE_FORMATS, STORED_DTYPES, SUPPORTED_FORMATS
from models.quant.markers import QuantPlan, read_plan

SUPPORTED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
FLOAT8 = ("F8_E4M3", "F8_E5M2")
# Key suffixes that only quantised formats carry (scales, zero points, packed blocks).
QUANT_KEY_MARKERS = ("weight_scale", "scale_weight", "input_scale", "weight_scale_2", ".absmax", ".quant_map",
                     ".qweight", ".qzeros", ".scales", "comfy_quant", ".quant_state", "weight_global_scale")
ARCHITECTURES = {
    "h3_transformer": ("video_patch_proj.weight", "audio_patch_proj.weight"),
    "h3_video_vae": ("encoder.conv_in.weight", "decoder.x_embedder.weight"),
    "h3_audio_vae": ("pre_block.attn.qkv.weight", "decoder.conv_pre.weight"),
    "h3_text_encoder": ("embed_tokens.weight", "layers.0.attn.qkv_proj.weight"),
    "qwen3vl": ("visual.deepstack_merger_list.0.norm.weight", "model.layers.0.self_attn.q_proj.weight"),
    "h3_fun_control": ("control_proj_in.weight", "control_blocks.0.after_proj.weight"),
}
# Architectures whose config recovery also reads the file's metadata (what shapes cannot say).
CONFIG_READS_METADATA = ("qwen3vl", "h3_fun_control")
SUPPORTED_TEXT = ("H3 transformer (video_patch_proj + audio_patch_proj), H3 video VAE, H3 audio VAE, "
                  "H3 text encoder, Qwen3-VL text encoder, H3 Fun ControlNet patch; as .safetensors in float32, float16, "
                  "bfloat16, unscaled "
                  "float8, or with layers quantized in ComfyUI's formats (int8_tensorwise with or without convrot, nvfp4, float8 with "
                  "scales, mxfp8); or as .gguf with F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0, Q3_K "
                  "or Q2_K tensors")
# Checkpoint entries that are recomputed, not loaded (deterministic buffers some exports include).
IGNORED_KEYS = {
    # A pruned H3 DiT may carry the affine of its pruning (read apart by _curve_affine, for adapters).
    "h3_transformer": re.compile(r"^(adaln_basis|adaln_mean)$"),
    "h3_audio_vae": re.compile(r".*\.(filter|upsample\.filter|downsample\.lowpass\.filter)$"),
    "h3_video_vae": re.compile(r"^(decoder\.pos_embed\.inv_freq|pixel_mean|pixel_std)$"),
}


@dataclass
class TensorInfo:
    """A tensor's entry in a safetensors header."""
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Header:
    """A model file's header (safetensors, or GGUF read as one): metadata and tensor entries, without data.

    For a GGUF file `gguf` holds its entries; `tensors` lists block-stored layer weights as "U8"
    (rows, bytes per row) and every other tensor as the float values it loads as.
    """
    path: str
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    gguf: gguf_files.GgufFile | None = None


class _GgufTensors:
    """A GGUF file's tensors as a safetensors handle gives them: block layer weights as bytes, the rest as floats."""

    def __init__(self, gguf: gguf_files.GgufFile) -> None:
        self.gguf = gguf
        self.block_weights = gguf_files.block_layers(gguf)

    def __enter__(self) -> "_GgufTensors":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.gguf.tensors)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.gguf.tensor(key) if key in self.block_weights else self.gguf.dequantized(key)


def open_tensors(header: Header):
    """A context manager whose `get_tensor(key)` reads one tensor of the file `header` describes."""
    if header.gguf is not None:
        return _GgufTensors(header.gguf)
    from safetensors import safe_open
    return safe_open(header.path, framework="pt", device="cpu")


def _gguf_header(path: str) -> Header:
    gguf = gguf_files.read_gguf(path)
    blocks = gguf_files.block_layers(gguf)
    tensors = {}
    for key, entry in gguf.tensors.items():
        if key in blocks:
            tensors[key] = TensorInfo("U8", entry.stored_shape)
        else:  # floats as stored; a block-typed tensor that is not a layer weight loads decoded to float32
            tensors[key] = TensorInfo(entry.type_name if not entry.quantized else "F32", entry.shape)
    return Header(path, gguf.text_metadata(), tensors, gguf)


@dataclass
class LoadedModel:
    """A loaded model: its architecture name, module, recovered config and the file's metadata."""
    kind: str
    model: nn.Module
    config: object
    metadata: dict[str, str] = field(default_factory=dict)
    path: str = ""


# Reading -----------------------------------------------------------------------------------------

def _refuse_non_safetensors(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(16)
    name = os.path.basename(path)
    # A safetensors file is recognised first: its 8-byte header length can itself begin with b"\x80" or b"PK".
    if len(head) >= 9 and head[8:9] == b"{" and 0 < struct.unpack("<Q", head[:8])[0] <= os.path.getsize(path) - 8:
        return
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise ValueError(f"{name} is a pickle / PyTorch checkpoint ({'zip archive' if head[:2] == b'PK' else 'pickle stream'}); "
                         "Weft loads only .safetensors files, which cannot run code. Convert it to safetensors first.")
    if len(head) < 8:
        raise ValueError(f"{name} is too short to be a safetensors file ({len(head)} bytes)")
    header_len = struct.unpack("<Q", head[:8])[0]
    if header_len <= 0 or header_len > os.path.getsize(path) - 8 or head[8:9] != b"{":
        raise ValueError(f"{name} is not a safetensors file (no JSON header); Weft loads only .safetensors files")


def read_header(path: str) -> Header:
    """The metadata and tensor entries (dtype, shape) of a safetensors or GGUF file, without reading tensor data."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"model file not found: {path}")
    if gguf_files.is_gguf(path):
        return _gguf_header(path)
    _refuse_non_safetensors(path)
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        text = f.read(header_len)
    header = _parse_header(path, text)
    try:  # the library's own checks (offsets, dtypes), with its message tied to the file
        from safetensors import SafetensorError, safe_open
        with safe_open(path, framework="pt", device="cpu"):
            pass
    except SafetensorError as exc:
        raise ValueError(f"{os.path.basename(path)}: not a valid safetensors file ({exc})") from None
    return header


def _parse_header(path: str, text: bytes) -> Header:
    """The header's JSON checked entry by entry: a malformed one is a ValueError naming the file and
    the entry, never a raw KeyError, TypeError or RecursionError."""
    name = os.path.basename(path)
    try:
        raw = json.loads(text)
    except RecursionError:
        raise ValueError(f"{name}: the safetensors header is JSON nested far too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{name}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: the safetensors header is a JSON {type(raw).__name__}, not an object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{name}: the safetensors header's __metadata__ is not a map of strings to strings")
    tensors = {}
    for key, entry in raw.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if not isinstance(dtype, str) or not isinstance(shape, list) \
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{name}: tensor {key[:200]!r} in the safetensors header needs a \"dtype\" string and "
                             f"a \"shape\" list of sizes; found {json.dumps(entry)[:200]}")
        tensors[key] = TensorInfo(dtype, tuple(shape))
    return Header(path, dict(metadata), tensors)


def load_state_dict(path: str, *, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors or GGUF file (all, or `keys`), read one by one. Refuses pickle files.

    A GGUF file's block-typed tensors come decoded, as float32 values of their shape.
    """
    header = read_header(path)
    if header.gguf is not None:
        return {key: header.gguf.dequantized(key) for key in (keys if keys is not None else header.gguf.tensors)}
    out = {}
    with open_tensors(header) as f:
        for key in (keys if keys is not None else f.keys()):
            out[key] = f.get_tensor(key)
    return out


# Weight normalisation ----------------------------------------------------------------------------

# How original (training) checkpoints store a weight-normalised layer: a gain and a direction tensor, in
# torch's old `weight_norm` spelling or its parametrization spelling. Weft folds them into the plain
# weight at load, so the model itself never carries the reparametrisation.
WEIGHT_NORM_SPELLINGS = ((".weight_g", ".weight_v"),
                         (".parametrizations.weight.original0", ".parametrizations.weight.original1"))


def split_weight_norm(file_keys: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Remove weight-norm pairs from file_keys (model key -> file key); return {weight key: (gain key, direction key)}.

    A gain without its direction (or the reverse) is refused naming the key.
    """
    folded: dict[str, tuple[str, str]] = {}
    for gain_suffix, direction_suffix in WEIGHT_NORM_SPELLINGS:
        for key in [k for k in file_keys if k.endswith(gain_suffix) or k.endswith(direction_suffix)]:
            if key not in file_keys:
                continue
            layer = key[:-len(gain_suffix)] if key.endswith(gain_suffix) else key[:-len(direction_suffix)]
            gain, direction = layer + gain_suffix, layer + direction_suffix
            if gain not in file_keys or direction not in file_keys:
                present = gain if gain in file_keys else direction
                raise ValueError(f"weight-normalised layer {layer!r} stores {file_keys[present]!r} without its "
                                 f"{'direction' if present == gain else 'gain'} tensor")
            if layer + ".weight" in file_keys:
                raise ValueError(f"layer {layer!r} stores both a plain weight and a weight-norm gain/direction pair")
            folded[layer + ".weight"] = (file_keys.pop(gain), file_keys.pop(direction))
    return folded


def fold_weight_norm(gain: torch.Tensor, direction: torch.Tensor, what: str = "layer") -> torch.Tensor:
    """The plain weight of a weight-normalised layer: gain * direction / ||direction||, in float32.

    As torch.nn.utils.weight_norm defines it, the norm runs over every dim where the gain has size 1 (so a
    gain of shape (C, 1, 1) normalises each slice along dim 0; a single-element gain normalises the whole tensor).
    """
    v = direction.float()
    g = gain.float()
    if g.numel() == 1:
        return v * (g.reshape(()) / v.norm())
    if g.dim() != v.dim() or any(gs not in (1, vs) for gs, vs in zip(g.shape, v.shape)):
        raise ValueError(f"{what}: weight-norm gain of shape {list(g.shape)} does not fit its direction of shape "
                         f"{list(v.shape)} (expected size 1 or the direction's size in every dim)")
    dims = [d for d in range(v.dim()) if g.shape[d] == 1]
    return v * (g / v.norm(dim=dims, keepdim=True))


# Fused qkv row order -------------------------------------------------------------------------------

# The H3 transformer fuses q, k and v into one `attn.qkv_proj` weight. Every published single-file
# checkpoint stacks them ([all q rows; all k rows; all v rows]); the MiniMaxAI training shards interleave
# them per head ([head 0: q k v, head 1: q k v, ...]). Keys and shapes are identical, so the file cannot
# tell: a file merged from those shards by hand must say so, through `qkv_layout` in its safetensors
# metadata or the loader's `qkv_layout` argument.
QKV_LAYOUTS = ("stacked", "interleaved")
QKV_LAYOUT_METADATA = "qkv_layout"
_QKV_KEY = re.compile(r"^(blocks|token_refiner\.blocks)\.\d+\.attn\.qkv_proj\.weight$")


def resolve_qkv_layout(requested: str | None, metadata: dict[str, str], name: str) -> str:
    """The fused-qkv row order to read: the caller's, the file's `qkv_layout` metadata, or "stacked"; conflicts refused."""
    declared = metadata.get(QKV_LAYOUT_METADATA)
    for value, source in ((requested, "the qkv_layout option"), (declared, f"{name}'s {QKV_LAYOUT_METADATA} metadata")):
        if value is not None and value not in QKV_LAYOUTS:
            raise ValueError(f"{source} is {value!r}; expected one of {', '.join(QKV_LAYOUTS)}")
    if requested is not None and declared is not None and requested != declared:
        raise ValueError(f"{name} declares its fused qkv rows {declared}, but the qkv_layout option asks for "
                         f"{requested}; drop the option or fix the file's metadata")
    return requested or declared or "stacked"


def stack_interleaved_qkv(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head: q k v, ...] -> [q of every head; k ...; v ...] (the order Weft's attention reads)."""
    rows, cols = weight.shape
    if rows % (3 * heads):
        raise ValueError(f"fused qkv weight of {rows} rows does not split into q, k and v for {heads} heads")
    return weight.reshape(heads, 3, rows // (3 * heads), cols).transpose(0, 1).reshape(rows, cols)


# Detection ---------------------------------------------------------------------------------------

def _stores_weight(tensors: dict, key: str) -> bool:
    # A marker weight may be stored plainly or weight-normalised (original training checkpoints).
    if key in tensors:
        return True
    layer = key[:-len(".weight")] if key.endswith(".weight") else None
    return layer is not None and any(layer + direction in tensors for _, direction in WEIGHT_NORM_SPELLINGS)


def canonical_keys(keys) -> dict[str, str]:
    """{key under the name Weft's models use: key in the file}; only other spellings of a family's keys differ."""
    from models.text.qwen3vl import released_key
    return {released_key(key): key for key in keys}


def detect(header: Header) -> tuple[str, str]:
    """(architecture, key prefix) of a checkpoint, recognised by its marker keys; ValueError when unknown."""
    names = canonical_keys(header.tensors)
    for kind, (first, second) in ARCHITECTURES.items():
        for key in names:
            if key.endswith(first):
                prefix = key[:-len(first)]
                if _stores_weight(names, prefix + second) and (not prefix or prefix.endswith(".")):
                    return kind, prefix
    sample = ", ".join(sorted(header.tensors)[:6]) or "no tensors"
    if header.gguf is not None and any(key.startswith(("blk.", "token_embd.")) for key in header.tensors):
        raise ValueError(f"{os.path.basename(header.path)} is a GGUF file with llama.cpp's tensor names (blk.N...); "
                         "Weft reads GGUF conversions that keep the checkpoint's own names (as the H3 GGUF files "
                         "made for ComfyUI and stable-diffusion.cpp do)")
    raise ValueError(f"{os.path.basename(header.path)}: unknown architecture (first keys: {sample}); "
                     f"supported: {SUPPORTED_TEXT}")


def _check_quantisation(header: Header, keys: list[str]) -> None:
    name = os.path.basename(header.path)
    for key in keys:
        if any(marker in key for marker in QUANT_KEY_MARKERS):
            raise ValueError(f"{name} is quantised (found key {key!r}) without a ComfyUI quantization marker for "
                             f"that layer; Weft reads layers marked by `<layer>.comfy_quant`, the "
                             f"`_quantization_metadata` header or `scaled_fp8` (formats: {', '.join(SUPPORTED_FORMATS)}); "
                             f"bitsandbytes and GPTQ files are not supported")
        dtype = header.tensors[key].dtype
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: tensor {key!r} has dtype {dtype}, which is not supported (quantised "
                             f"or integer weights); supported dtypes: {', '.join(SUPPORTED_DTYPES)}")


# Config recovery ---------------------------------------------------------------------------------

def _count(shapes: dict[str, tuple], pattern: str) -> int:
    rx = re.compile(pattern)
    found = {int(m.group(1)) for k in shapes for m in [rx.match(k)] if m}
    return max(found) + 1 if found else 0


def _need(shapes: dict[str, tuple], key: str, what: str) -> tuple[int, ...]:
    if key not in shapes:
        raise ValueError(f"{what} checkpoint lacks {key!r}")
    return shapes[key]


def transformer_config(shapes: dict[str, tuple]):
    """H3TransformerConfig recovered from (unprefixed) tensor shapes."""
    from models.h3.transformer import H3TransformerConfig
    what = "H3 transformer"
    hidden, patch_dim = _need(shapes, "video_patch_proj.weight", what)
    _, audio_ch = _need(shapes, "audio_patch_proj.weight", what)
    _, text_dim = _need(shapes, "condition_proj.weight", what)
    head_dim = _need(shapes, "blocks.0.attn.q_norm.weight", what)[0]
    inner = _need(shapes, "blocks.0.attn.qkv_proj.weight", what)[0] // 3
    ffn = _need(shapes, "blocks.0.mlp.fc2.weight", what)[1]
    rope_n = _need(shapes, "rope.inv_freq", what)[0]
    if patch_dim % 4:
        raise ValueError(f"{what}: video_patch_proj takes {patch_dim} values, not a 1x2x2 patch of whole channels")
    if inner % head_dim:
        raise ValueError(f"{what}: attention width {inner} is not a multiple of head_dim {head_dim}")
    curve = None
    if "adaln_t_table" in shapes:
        curve, t_embed = shapes["adaln_t_table"]
        t_freq, t_hidden = H3TransformerConfig.time_freq_dim, H3TransformerConfig.time_hidden_size
    else:
        t_hidden, t_freq = _need(shapes, "time_embedder.proj_in.weight", what)
        t_embed = _need(shapes, "time_embedder.proj_out.weight", what)[0]
    return H3TransformerConfig(
        hidden_size=hidden, num_layers=_count(shapes, r"blocks\.(\d+)\."),
        refiner_layers=_count(shapes, r"token_refiner\.blocks\.(\d+)\."), num_heads=inner // head_dim,
        head_dim=head_dim, ffn_size=ffn, video_channels=patch_dim // 4, audio_channels=audio_ch, text_dim=text_dim,
        time_freq_dim=t_freq, time_hidden_size=t_hidden, time_embed_dim=t_embed, rope_freqs_per_axis=rope_n,
        adaln_curve_points=curve, gate_compress="blocks.0.attn.to_gate_compress.weight" in shapes)


def video_vae_config(shapes: dict[str, tuple]):
    """VideoVAEConfig recovered from (unprefixed) tensor shapes."""
    from models.h3.video_vae import VideoVAEConfig
    what = "H3 video VAE"
    default = VideoVAEConfig()
    base = _need(shapes, "encoder.conv_in.weight", what)[0]
    levels = _count(shapes, r"encoder\.down\.(\d+)\.")
    res_blocks = tuple(_count(shapes, rf"encoder\.down\.{i}\.block\.(\d+)\.") for i in range(levels))
    mult = tuple(_need(shapes, f"encoder.down.{i}.block.0.conv1.weight", what)[0] // base for i in range(levels))
    has_down = tuple(f"encoder.down.{i}.downsample.conv.weight" in shapes for i in range(levels))
    expected_down = tuple(s * t > 1 for s, t in zip(default.space_down, default.time_down))
    if has_down != expected_down:
        raise ValueError(f"{what}: downsampling at levels {[i for i, d in enumerate(has_down) if d]} does not match the "
                         f"supported layout (levels {[i for i, d in enumerate(expected_down) if d]}, f16 t4)")
    dim, latent = _need(shapes, "decoder.x_embedder.weight", what)
    if dim % default.decoder_head_dim:
        raise ValueError(f"{what}: decoder width {dim} is not a multiple of the head size {default.decoder_head_dim}")
    ffn = _need(shapes, "decoder.transformer_blocks.0.ff.w2.weight", what)[1]
    return replace(default, latent_channels=latent, base_channels=base, channel_mult=mult, res_blocks=res_blocks,
                   image_channels=_need(shapes, "encoder.conv_in.weight", what)[1],
                   decoder_layers=_count(shapes, r"decoder\.transformer_blocks\.(\d+)\."),
                   decoder_heads=dim // default.decoder_head_dim, decoder_ffn_mult=ffn // dim,
                   register_tokens=_need(shapes, "decoder.register_tokens", what)[1])


def audio_vae_config(shapes: dict[str, tuple]):
    """AudioVAEConfig recovered from (unprefixed) tensor shapes."""
    from models.h3.audio_vae import AudioVAEConfig
    what = "H3 audio VAE"
    default = AudioVAEConfig()
    enc_dim = _need(shapes, "encoder.block.0.weight", what)[0]
    latent_dim = _need(shapes, "dec_in_proj.weight", what)[0]
    channels = _need(shapes, "mean_proj.weight", what)[0]
    decoder_dim = _need(shapes, "decoder.conv_pre.weight", what)[0]
    stages = _count(shapes, r"decoder\.ups\.(\d+)\.")
    blocks = _count(shapes, r"decoder\.resblocks\.(\d+)\.")
    if stages != len(default.upsample_rates) or blocks % stages:
        raise ValueError(f"{what}: {stages} upsampling stages and {blocks} residual blocks; supported: "
                         f"{len(default.upsample_rates)} stages (rates {default.upsample_rates}, hop 800)")
    per_stage = blocks // stages
    kernels = tuple(_need(shapes, f"decoder.resblocks.{k}.convs1.0.weight", what)[2] for k in range(per_stage))
    up_kernels = tuple(_need(shapes, f"decoder.ups.{i}.0.weight", what)[2] for i in range(stages))
    dilations = _count(shapes, r"decoder\.resblocks\.0\.convs1\.(\d+)\.")
    if not 1 <= dilations <= len(default.resblock_dilations):
        raise ValueError(f"{what}: residual blocks with {dilations} dilated convs; supported: 1 to "
                         f"{len(default.resblock_dilations)} (dilations {default.resblock_dilations})")
    return replace(default, encoder_dim=enc_dim, latent_dim=latent_dim, latent_channels=channels,
                   decoder_dim=decoder_dim, resblock_kernels=kernels, upsample_kernels=up_kernels,
                   resblock_dilations=default.resblock_dilations[:dilations])


def text_encoder_config(shapes: dict[str, tuple]):
    """TextEncoderConfig recovered from (unprefixed) tensor shapes."""
    from models.h3.text_encoder import TextEncoderConfig
    what = "H3 text encoder"
    vocab, hidden = _need(shapes, "embed_tokens.weight", what)
    head_dim = _need(shapes, "layers.0.attn.q_norm.weight", what)[0]
    inner = _need(shapes, "layers.0.attn.qkv_proj.weight", what)[0] // 3
    return TextEncoderConfig(vocab_size=vocab, hidden_size=hidden, num_layers=_count(shapes, r"layers\.(\d+)\."),
                             num_heads=inner // head_dim, head_dim=head_dim,
                             ffn_size=_need(shapes, "layers.0.mlp.fc2.weight", what)[1])


def fun_control_config(shapes: dict[str, tuple], metadata: dict[str, str]):
    """FunControlConfig recovered from (unprefixed) tensor shapes and the file's metadata."""
    from models.h3 import fun_control
    for key in fun_control.DETECTION_KEYS:
        _need(shapes, key, "H3 Fun ControlNet patch")
    return fun_control.fun_control_config(shapes, metadata)


def _builders():
    from models.h3.audio_vae import AudioVAE
    from models.h3.fun_control import FunControlNet
    from models.h3.text_encoder import TextEncoder
    from models.h3.transformer import H3Transformer
    from models.h3.video_vae import VideoVAE
    from models.text.qwen3vl import Qwen3VL, config_from_shapes
    return {
        "h3_transformer": (transformer_config, H3Transformer),
        "h3_video_vae": (video_vae_config, VideoVAE),
        "h3_audio_vae": (audio_vae_config, AudioVAE),
        "h3_text_encoder": (text_encoder_config, TextEncoder),
        "qwen3vl": (config_from_shapes, Qwen3VL),
        "h3_fun_control": (fun_control_config, FunControlNet),
    }


def _unused_key(kind: str, key: str, config: object) -> bool:
    """True for a tensor the file may carry that the model built from `config` does not use."""
    ignored = IGNORED_KEYS.get(kind)
    if ignored is not None and ignored.match(key):
        return True
    if kind == "qwen3vl":
        from models.text.qwen3vl import unused_key
        return unused_key(key, config)
    return False


# Loading -----------------------------------------------------------------------------------------

def _float32_key(kind: str, key: str, config: object = None) -> bool:
    if kind == "h3_transformer":
        from models.h3.transformer import FLOAT32_PREFIXES
        # Curve-form (pruned) checkpoints store their small AdaLN projections in float16; they run in
        # float32, as the reference runs them, since the whole modulation of every block flows from them.
        curve = getattr(config, "adaln_curve_points", None) is not None
        return key.startswith(FLOAT32_PREFIXES) or (curve and ".adaln_proj." in f".{key}")
    if kind == "h3_fun_control":
        # The hint projection runs in float32, and curve-form modulation too (as in the base model).
        return key.startswith("control_proj_in.") or (getattr(config, "curve_form", False) and ".adaln_proj." in key)
    # VAEs and statistics buffers: normalisation statistics stay float32.
    return key in ("latents_mean", "latents_std")


def _quantize_modules(model: nn.Module, plan: QuantPlan, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
                      compute_dtype: torch.dtype, where: str) -> None:
    """Replace each layer `plan` names (built on the meta device) by its quantized twin shaped after the file.

    `shapes` and `dtypes` are by file key; each layer's format checks its stored tensors against
    the layer's (out, in) features before the twin is built.
    """
    for layer, quant in plan.layers.items():
        try:
            module = model.get_submodule(layer)
        except AttributeError:
            raise ValueError(f"{where}: quantization marker for {layer!r}, which this model does not have") from None
        fmt = quant.stored_format
        sources = plan.sources[layer]
        tensor_shapes = {leaf: (tuple(shapes[key]), STORED_DTYPES[dtypes[key]]) for leaf, key in sources.items()}
        if isinstance(module, nn.Linear):
            fmt.check_stored(layer, quant, sources, module.out_features, module.in_features, shapes, dtypes, where)
            twin = QuantizedLinear(module.in_features, module.out_features, quant, bias=module.bias is not None,
                                   tensor_shapes=tensor_shapes, compute_dtype=compute_dtype, device="meta")
        elif isinstance(module, nn.Embedding):
            if not fmt.embeddable:
                raise ValueError(f"{where}: embedding {layer!r} is stored as {fmt.name}; quantized embedding "
                                 f"tables are read in {', '.join(EMBEDDABLE_FORMATS)}")
            fmt.check_stored(layer, quant, sources, module.num_embeddings, module.embedding_dim, shapes, dtypes, where)
            twin = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, quant,
                                      padding_idx=module.padding_idx, tensor_shapes=tensor_shapes,
                                      compute_dtype=compute_dtype, device="meta")
        else:
            raise ValueError(f"{where}: layer {layer!r} is marked {fmt.name}, but it is a "
                             f"{type(module).__name__}; only Linear and Embedding layers are read quantized")
        parent_name, _, child = layer.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, twin)


def _curve_affine(header: Header, prefix: str, table: torch.Tensor):
    """A curve-form H3 DiT's pruning affine (models/h3/transformer.py's adapter_input_affines), or why there is none.

    Read from the checkpoint's own `adaln_basis` / `adaln_mean`, else from `<file name>.adaln_affine.safetensors`,
    else from `adaln_affine.safetensors` beside it. A side file that also holds the curve table (`adaln_t_table` or
    `time_embedder.table`) is used only when that table equals the model's, so one made for another pruning is
    never applied. Loading never fails for it: what is missing or wrong is said when an adapter needs it.
    """
    from safetensors import SafetensorError, safe_open

    from models.adapters.base import InputAffine, NoInputAffine
    from models.h3.transformer import AFFINE_KEYS, AFFINE_SIDECAR
    narrow = int(table.shape[1])
    folder, file_name = os.path.split(header.path)
    stem = file_name[:-len(".safetensors")] if file_name.endswith(".safetensors") else file_name
    candidates = [(header.path, prefix, False), (os.path.join(folder, f"{stem}.{AFFINE_SIDECAR}"), "", True),
                  (os.path.join(folder, AFFINE_SIDECAR), "", True)]
    problems = []
    for path, key_prefix, side_file in candidates:
        if side_file and not os.path.isfile(path):
            continue
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                keys = set(f.keys())
                basis_key, mean_key = (key_prefix + k for k in AFFINE_KEYS)
                if basis_key not in keys or mean_key not in keys:
                    if side_file:
                        problems.append(f"{os.path.basename(path)} lacks {' or '.join(AFFINE_KEYS)}")
                    continue
                basis, mean = f.get_tensor(basis_key).float(), f.get_tensor(mean_key).float()
                stored_table = next((f.get_tensor(k) for k in ("adaln_t_table", "time_embedder.table") if k in keys
                                     and side_file), None)
        except (SafetensorError, OSError) as error:
            problems.append(f"{os.path.basename(path)} is not a readable safetensors file ({error})")
            continue
        name = os.path.basename(path)
        if basis.dim() != 2 or basis.shape[0] != narrow or mean.shape != (basis.shape[1],):
            problems.append(f"{name} holds adaln_basis {list(basis.shape)} and adaln_mean {list(mean.shape)}; this "
                            f"model needs ({narrow}, full width) and (full width,)")
            continue
        if stored_table is not None and not torch.equal(stored_table.float(), table.float().cpu()):
            problems.append(f"{name} was made for another pruning (its curve table differs from this model's)")
            continue
        return InputAffine(basis.contiguous(), mean.contiguous(), name)
    reason = (f"moving such an entry onto the pruned model needs the pruning's basis and mean (tensors "
              f"{AFFINE_KEYS[0]} ({narrow}, full width) and {AFFINE_KEYS[1]} (full width)), which {file_name} does "
              f"not carry; put them in '{stem}.{AFFINE_SIDECAR}' or '{AFFINE_SIDECAR}' beside it (the pruned bf16 "
              "release holds them), or use an adapter made for the pruned model")
    if problems:
        reason += f" ({'; '.join(problems)})"
    return NoInputAffine(narrow, None, reason)


def load_model(path: str, *, expect: str | tuple[str, ...] | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", qkv_layout: str | None = None) -> LoadedModel:
    """Load an H3 model from a safetensors file: detect it, recover its config, check every shape, fill the weights.

    expect: the architecture(s) the caller accepts (refused otherwise, naming what was found). dtype: the
    compute dtype of the weights (default: the file's dtype for float formats, float8 upcast to bfloat16;
    for a GGUF file the compute device's dtype, `memory.compute_dtype()`: see models/gguf.py);
    float32 islands (patch projections, time embedding, output heads, latent statistics) stay float32.
    qkv_layout: the H3 transformer's fused qkv row order, "stacked" (every published single file) or
    "interleaved" (a file merged by hand from the MiniMaxAI shards); default: the file's `qkv_layout`
    metadata, else "stacked".
    """
    header = read_header(path)
    name = os.path.basename(header.path)
    kind, prefix = detect(header)
    layout = resolve_qkv_layout(qkv_layout, header.metadata, name)
    if layout != "stacked" and kind != "h3_transformer":
        raise ValueError(f"{name} is a {kind.replace('_', ' ')}; a qkv layout applies only to the H3 transformer")
    if expect is not None:
        allowed = (expect,) if isinstance(expect, str) else tuple(expect)
        if kind not in allowed:
            raise ValueError(f"{name} is a {kind.replace('_', ' ')} checkpoint, but a {' or '.join(a.replace('_', ' ') for a in allowed)} "
                             "is needed here")
    names = canonical_keys(header.tensors)
    file_keys = {k[len(prefix):]: v for k, v in names.items() if k.startswith(prefix)}
    if header.gguf is not None:  # layers are marked by the file's tensor types
        plan = gguf_files.quant_plan(header.gguf, prefix, lambda key: next(iter(canonical_keys([key]))))
    else:
        with open_tensors(header) as f:
            plan = read_plan(list(header.tensors), prefix, header.metadata, f.get_tensor, name)
    # Quantized layers named in another spelling go by the model's names too.
    respelled = {layer: next(iter(canonical_keys([prefix + layer])))[len(prefix):] for layer in plan.layers}
    plan.layers = {respelled[layer]: quant for layer, quant in plan.layers.items()}
    plan.sources = {respelled[layer]: sources for layer, sources in plan.sources.items()}
    # Quantized layers' codes and scales are checked against their format (models/quant/formats/);
    # their markers are read, not loaded; the legacy scale names are read under the current ones.
    stored_keys = {key for sources in plan.sources.values() for key in sources.values()}
    file_keys = {k: v for k, v in file_keys.items() if v not in plan.marker_keys and v not in stored_keys}
    _check_quantisation(header, list(file_keys.values()))
    folded = split_weight_norm(file_keys)
    for layer, sources in plan.sources.items():
        for leaf, key in sources.items():
            file_keys[f"{layer}.{leaf}"] = key
    shapes = {k: header.tensors[v].shape for k, v in file_keys.items()}
    shapes.update({k: header.tensors[direction].shape for k, (_, direction) in folded.items()})
    shapes.update({f"{layer}.weight": quant.stored_format.dense_shape(shapes[f"{layer}.weight"])
                   for layer, quant in plan.layers.items()})
    config_fn, cls = _builders()[kind]
    config = config_fn(shapes, header.metadata) if kind in CONFIG_READS_METADATA else config_fn(shapes)
    for layer in [layer for layer in plan.layers if _unused_key(kind, f"{layer}.weight", config)]:
        del plan.layers[layer], plan.sources[layer]
    file_keys = {k: v for k, v in file_keys.items() if not _unused_key(kind, k, config)}

    with torch.device("meta"):
        model = cls(config)
    if dtype is None and header.gguf is not None:
        dtype = compute_dtype()  # see "The compute dtype" in models/gguf.py
    elif dtype is None:
        float_dtypes = [header.tensors[v].dtype for v in file_keys.values() if v not in stored_keys]
        main = max(set(float_dtypes), key=float_dtypes.count) if float_dtypes else "F32"
        dtype = torch.bfloat16 if main in FLOAT8 else SUPPORTED_DTYPES[main]
    if plan.layers:
        _quantize_modules(model, plan, {v: header.tensors[v].shape for v in stored_keys},
                          {v: header.tensors[v].dtype for v in stored_keys}, dtype, name)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    unexpected = [k for k in list(file_keys) + list(folded) if k not in expected and not _unused_key(kind, k, config)]
    missing = [k for k in expected if k not in file_keys and k not in folded]
    if missing:
        raise ValueError(f"{name}: {kind} checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise ValueError(f"{name}: unexpected tensor(s) for a {kind} with the recovered config: "
                         f"{', '.join(prefix + k for k in unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    for key, shape in expected.items():
        found = header.tensors[file_keys[key] if key in file_keys else folded[key][1]].shape
        if tuple(found) != shape:
            raise ValueError(f"{name}: tensor {prefix + key!r} has shape {list(found)}, expected {list(shape)} "
                             f"for the recovered {kind} config")

    state = {}
    with open_tensors(header) as f:
        for key in expected:
            if key in folded:
                gain, direction = folded[key]
                tensor = fold_weight_norm(f.get_tensor(gain), f.get_tensor(direction), f"{name}: {prefix + key}")
            else:
                tensor = f.get_tensor(file_keys[key])
                if layout == "interleaved" and _QKV_KEY.match(key):
                    if file_keys[key] in stored_keys:
                        raise ValueError(f"{name}: {prefix + key} is quantized; interleaved qkv rows are read only from "
                                         "float files (the MiniMaxAI shards); re-merge them unquantized")
                    tensor = stack_interleaved_qkv(tensor, config.num_heads)
                if file_keys[key] in stored_keys:  # quantized codes and scales keep their stored dtypes
                    state[key] = tensor.to(device=device)
                    continue
            target = torch.float32 if _float32_key(kind, key, config) else dtype
            state[key] = tensor.to(device=device, dtype=target)
    model.load_state_dict(state, assign=True)
    # Non-persistent buffers (RoPE frequencies, resampling filters, pixel statistics) are recomputed.
    for module in model.modules():
        if hasattr(module, "make_buffers"):
            with torch.device(device):
                module.make_buffers()
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(f"{name}: internal error, tensors left unloaded: {', '.join(leftover[:5])}")
    model.eval().requires_grad_(False)
    if kind == "h3_transformer" and config.adaln_curve_points is not None:
        model.adaln_affine = _curve_affine(header, prefix, model.adaln_t_table)
    if kind == "h3_video_vae":
        model.t1_direct = header.metadata.get("h3_t1_direct", "").strip().lower() in ("1", "true", "yes")
    return LoadedModel(kind, model, config, header.metadata, header.path)
