"""GGUF files: the container read and written without the `gguf` package, and the quantized layers they mark.

The container (version 2 and 3, little-endian): the magic `GGUF`, a uint32 version, a uint64
tensor count and a uint64 count of metadata entries; each entry a string key (uint64 length +
UTF-8 bytes), a uint32 value type and the value (scalars, strings, or an array: element type,
uint64 count, elements); then per tensor its name, a uint32 count of dimensions, the dimensions as
uint64 (innermost first, so the torch shape is their reverse), a uint32 ggml type and a uint64
offset into the data section, which starts at the next multiple of `general.alignment` (32 unless
the file says otherwise). A tensor whose torch shape has more than the dimensions ggml keeps (a
Conv3d weight) carries it in `comfy.gguf.orig_shape.<name>`, an int32 array, as ComfyUI-GGUF writes.

What Weft reads (`read_gguf`, `GgufFile.tensor`): F32, F16 and BF16 tensors become float tensors
of their shape; the block types of kernels/gguf_blocks.py stay as the file's bytes, a uint8 tensor
(rows, bytes per row), and the 2-D `.weight` tensors among them become quantized layers
(`quant_plan`, the `QuantPlan` models/quant/markers.py builds for safetensors files); any other
block-typed tensor (a bias, a norm, a Conv3d weight) is decoded to float32 once, at load. Other
ggml types (the IQ and ternary types, Q8_1, Q8_K, integers) are refused naming the tensor.

The H3 GGUF files these readers are for (facts from public notes, no real file is read here):
  - unsloth/MiniMax-H3-GGUF publishes the pruned DiT (`minimax_h3_fl2va_pruned-Q8_0.gguf`,
    `minimax_h3_ref2va_pruned-Q4_K.gguf`, 11,381,096,544 bytes at revision d629413c) and the
    Qwen3-VL encoder (`qwen3vl_32b_minimax_h3-Q2_K_M.gguf`, `-Q4_K_M.gguf`) in the
    stable-diffusion.cpp layout: no metadata at all (not even `general.architecture`) and the
    original checkpoint names: the DiT's keys as the released safetensors has them
    (`blocks.N.attn.qkv_proj.weight`, ...), the encoder's Hugging Face names (`model.layers.N.`,
    the vision tower in the same file, 902 tensors), not llama.cpp's `blk.N.` names
    [genvideo README of the Ref2VA install; an H3 deployment log, notes 74-75].
  - Community repacks set `general.architecture` to a name ComfyUI-GGUF's list accepts ("wan" for
    Abiray/MiniMax-H3-GGUF; "ltx2" elsewhere) or add "minimax_h3"; the names stay the same.
So Weft detects the architecture by tensor names as it does for safetensors (models/loading.py) and
ignores `general.architecture`. llama.cpp-named text encoders (`blk.N.attn_q`, a separate mmproj
file for the vision tower) are not read: the error says so.

The compute dtype. A GGUF file's float tensors are its small ones (norms, biases, the layers left
unquantized), mostly F32 because the converters keep them so; taking the model's dtype from them, as
from a safetensors file's weights, would run an H3 DiT in float32 on a GPU. ComfyUI-GGUF does not: its
layers are ComfyUI's manual-cast layers (`GGMLOps` derives from `comfy.ops.manual_cast`), which decode
and cast every weight to the dtype of the activations at each op, and ComfyUI picks that dtype for the
device as for any diffusion model (`model_management.unet_dtype`: float16 or bfloat16 where the GPU
runs it well, float32 on the CPU). Weft does the same through its one place for that choice: a GGUF
model computes in `memory.compute_dtype()` (bfloat16 on a CUDA card that supports it, else float16;
float16 on Apple MPS; float32 on the CPU); its block layers decode in float32 and round once to it, its
float tensors are cast to it, and the float32 islands (patch projections, time embedding, output heads)
stay float32 as in every H3 model. A model loaded for one device and placed on another
(`SelectModelDevice`) keeps the dtype it was loaded with.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

import torch

from kernels.gguf_blocks import BLOCK_SIZES, decode_blocks
from models.quant.formats import LayerQuant
from models.quant.formats.gguf import GGUF_BY_TYPE
from models.quant.markers import QuantPlan

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ORIG_SHAPE_PREFIX = "comfy.gguf.orig_shape."  # provenance: interface (ComfyUI-GGUF's metadata key)
# ggml's type ids of the types Weft reads.
FLOAT_TYPES = {0: ("F32", torch.float32), 1: ("F16", torch.float16), 30: ("BF16", torch.bfloat16)}
BLOCK_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K",
               13: "Q5_K", 14: "Q6_K"}
TYPE_IDS = {**{name: code for code, (name, _) in FLOAT_TYPES.items()}, **{name: code for code, name in BLOCK_TYPES.items()}}
MAX_DIMS = 4          # ggml keeps at most four dimensions per tensor
MAX_NAME_BYTES = 1 << 16

# Metadata value types: id -> struct format (None: string, array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GgufTensor:
    """One tensor entry: its ggml type name, torch shape, and where its bytes are."""

    name: str
    type_name: str                  # "F32", "F16", "BF16" or a block type ("Q4_K", ...)
    shape: tuple[int, ...]          # the torch shape of the values (orig_shape applied)
    offset: int                     # absolute position of its bytes in the file
    nbytes: int

    @property
    def quantized(self) -> bool:
        """Whether the bytes are blocks (kept as uint8 rows) rather than floats."""
        return self.type_name in BLOCK_SIZES

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of what `GgufFile.tensor` returns: the values' shape, or (rows, bytes per row) for blocks."""
        if not self.quantized:
            return self.shape
        block_values, block_bytes = BLOCK_SIZES[self.type_name]
        rows = 1
        for size in self.shape[:-1]:
            rows *= size
        return rows, self.shape[-1] // block_values * block_bytes


@dataclass
class GgufFile:
    """A GGUF file's metadata and tensor entries, read without loading tensor data."""

    path: str
    version: int
    metadata: dict[str, object] = field(default_factory=dict)
    tensors: dict[str, GgufTensor] = field(default_factory=dict)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`: floats in its own dtype and shape, or a block type's uint8 rows."""
        entry = self.tensors[name]
        with open(self.path, "rb") as f:
            f.seek(entry.offset)
            raw = f.read(entry.nbytes)
        if len(raw) != entry.nbytes:
            raise ValueError(f"{os.path.basename(self.path)}: tensor {name!r} ends past the end of the file")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if entry.quantized:
            return data.view(entry.stored_shape)
        dtype = next(dt for n, dt in FLOAT_TYPES.values() if n == entry.type_name)
        return data.view(dtype).view(entry.shape)

    def dequantized(self, name: str) -> torch.Tensor:
        """The tensor `name` as float values of its shape (block types decoded to float32)."""
        entry = self.tensors[name]
        values = self.tensor(name)
        return decode_blocks(entry.type_name, values).view(entry.shape) if entry.quantized else values

    def text_metadata(self) -> dict[str, str]:
        """The metadata as strings (strings as they are, other values as JSON), as a safetensors header holds it."""
        return {key: value if isinstance(value, str) else json.dumps(value) for key, value in self.metadata.items()
                if not key.startswith(ORIG_SHAPE_PREFIX)}


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether the file starts with the GGUF magic."""
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


class _Reader:
    """Bounded little-endian reads from a file: every length is checked against what is left."""

    def __init__(self, f: BinaryIO, size: int, name: str) -> None:
        self.f, self.size, self.name = f, size, name

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.name} is not a readable GGUF file: {what}")

    def take(self, count: int) -> bytes:
        if count < 0 or count > self.size - self.f.tell():
            raise self.fail(f"a field of {count} bytes runs past the end of the file")
        return self.f.read(count)

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        if length > self.size:
            raise self.fail(f"a string of {length} bytes is longer than the file")
        raw = self.take(length)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string is not UTF-8") from None

    def value(self, kind: int, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth < 2:
            element, count = self.scalar("<I"), self.scalar("<Q")
            if count > self.size - self.f.tell():  # every element takes at least one byte
                raise self.fail(f"an array of {count} elements is longer than the file")
            return [self.value(element, depth + 1) for _ in range(count)]
        raise self.fail(f"unknown metadata value type {kind}")


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """The metadata and tensor entries of a GGUF file; ValueError naming the file for anything malformed or unread."""
    path = os.fspath(path)
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        reader = _Reader(f, size, name)
        if reader.take(4) != MAGIC:
            raise reader.fail("it does not start with GGUF")
        version = reader.scalar("<I")
        if version not in (2, 3):
            raise reader.fail(f"version {version}; Weft reads GGUF versions 2 and 3")
        tensor_count, entry_count = reader.scalar("<Q"), reader.scalar("<Q")
        if tensor_count > size or entry_count > size:
            raise reader.fail(f"it declares {tensor_count} tensors and {entry_count} metadata entries")
        metadata: dict[str, object] = {}
        for _ in range(entry_count):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        infos = []
        for _ in range(tensor_count):
            tensor_name = reader.string()
            dims = reader.scalar("<I")
            if not 1 <= dims <= MAX_DIMS:
                raise reader.fail(f"tensor {tensor_name!r} has {dims} dimensions")
            ne = [reader.scalar("<Q") for _ in range(dims)]
            infos.append((tensor_name, ne, reader.scalar("<I"), reader.scalar("<Q")))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
            raise reader.fail(f"general.alignment is {alignment!r}, not a power of two")
        data_start = -(-f.tell() // alignment) * alignment
    gguf = GgufFile(path, version, metadata)
    for tensor_name, ne, type_id, offset in infos:
        gguf.tensors[tensor_name] = _entry(name, tensor_name, ne, type_id, data_start + offset, size, metadata)
    return gguf


def _entry(name: str, tensor_name: str, ne: list[int], type_id: int, offset: int, size: int,
           metadata: dict[str, object]) -> GgufTensor:
    if type_id in FLOAT_TYPES:
        type_name, dtype = FLOAT_TYPES[type_id]
        block_values, block_bytes = 1, torch.empty((), dtype=dtype).element_size()
    elif type_id in BLOCK_TYPES:
        type_name = BLOCK_TYPES[type_id]
        block_values, block_bytes = BLOCK_SIZES[type_name]
    else:
        raise ValueError(f"{name}: tensor {tensor_name!r} has ggml type {type_id}; Weft reads F32, F16, BF16 and "
                         f"{', '.join(BLOCK_TYPES.values())}")
    if ne[0] % block_values:
        raise ValueError(f"{name}: tensor {tensor_name!r} has rows of {ne[0]} values, not whole {type_name} blocks "
                         f"of {block_values}")
    count = 1
    for extent in ne:
        count *= extent
    nbytes = count // block_values * block_bytes
    if offset + nbytes > size:
        raise ValueError(f"{name}: tensor {tensor_name!r} ({nbytes} bytes at offset {offset}) runs past the end of "
                         f"the file ({size} bytes)")
    shape = tuple(reversed(ne))
    declared = metadata.get(ORIG_SHAPE_PREFIX + tensor_name)
    if declared is not None:
        if not isinstance(declared, list) or not all(isinstance(v, int) and v > 0 for v in declared):
            raise ValueError(f"{name}: {ORIG_SHAPE_PREFIX}{tensor_name} is {declared!r}, not a list of sizes")
        elements = 1
        for extent in declared:
            elements *= extent
        if elements != count or (type_name in BLOCK_SIZES and declared[-1] % block_values):
            raise ValueError(f"{name}: {ORIG_SHAPE_PREFIX}{tensor_name} is {declared}, which does not hold the "
                             f"{count} values of {tensor_name!r} in whole rows")
        shape = tuple(declared)
    return GgufTensor(tensor_name, type_name, shape, offset, nbytes)


def block_layers(gguf: GgufFile) -> dict[str, GgufTensor]:
    """The tensors that stay block-stored as a quantized layer's weight: 2-D `.weight` tensors of a block type."""
    return {key: t for key, t in gguf.tensors.items() if t.quantized and key.endswith(".weight") and len(t.shape) == 2}


def quant_plan(gguf: GgufFile, prefix: str, respell) -> QuantPlan:
    """The quantized layers of a GGUF file for a model under `prefix`: one per block-stored `.weight`.

    `respell(key)` gives a file key under the model's name (other spellings of the same family).
    """
    plan = QuantPlan()
    for key, entry in block_layers(gguf).items():
        named = respell(key)
        if not named.startswith(prefix):
            continue
        layer = named[len(prefix):-len(".weight")]
        plan.layers[layer] = LayerQuant(GGUF_BY_TYPE[entry.type_name].arithmetic)
        plan.sources[layer] = {"weight": key}
    return plan


# Writing -------------------------------------------------------------------------------------

def _pack_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(value) -> bytes:
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<Iq", 11, value) if value < 0 else struct.pack("<IQ", 10, value)
    if isinstance(value, float):
        return struct.pack("<Id", 12, value)
    if isinstance(value, str):
        return struct.pack("<I", _STRING) + _pack_string(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return struct.pack("<IIQ", _ARRAY, 5, len(value)) + b"".join(struct.pack("<i", v) for v in value)
    raise TypeError(f"GGUF metadata values written here are bool, int, float, str or a list of int32, "
                    f"not {type(value).__name__}")


def gguf_bytes(tensors: dict[str, tuple[str, torch.Tensor]], metadata: dict[str, object] | None = None) -> bytes:
    """The bytes of a GGUF (version 3) file holding `tensors[name] = (type name, values)`.

    Float types take a float tensor of any shape; block types take float rows (..., K) and are
    encoded here (models/quant/formats/gguf.py: the 32-value types). A tensor of more than four
    dimensions is stored with its leading dimensions merged and its shape in
    `comfy.gguf.orig_shape.<name>`, as ComfyUI-GGUF does. `metadata` values are bool, int, float,
    str or a list of ints (written as int32).
    """
    from models.quant.formats.gguf import encode_blocks

    entries = dict(metadata or {})
    payloads: list[tuple[str, list[int], int, bytes]] = []
    for name, (type_name, values) in tensors.items():
        if type_name not in TYPE_IDS:
            raise ValueError(f"cannot write GGUF type {type_name!r}; types: {', '.join(TYPE_IDS)}")
        if values.dim() == 0:
            values = values.reshape(1)
        if values.dim() > MAX_DIMS:
            entries[ORIG_SHAPE_PREFIX + name] = list(values.shape)
            values = values.reshape(-1, *values.shape[values.dim() - MAX_DIMS + 1:])
        if type_name in BLOCK_SIZES:
            raw = encode_blocks(type_name, values.reshape(-1, values.shape[-1])).numpy().tobytes()
        else:
            dtype = next(dt for n, dt in FLOAT_TYPES.values() if n == type_name)
            raw = values.detach().to("cpu", dtype).contiguous().view(torch.uint8).numpy().tobytes()
        payloads.append((name, list(reversed(values.shape)), TYPE_IDS[type_name], raw))
    head = bytearray(MAGIC + struct.pack("<IQQ", 3, len(payloads), len(entries)))
    for key, value in entries.items():
        head += _pack_string(key) + _pack_value(value)
    offset = 0
    for name, ne, type_id, raw in payloads:
        head += _pack_string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        head += struct.pack("<IQ", type_id, offset)
        offset += -(-len(raw) // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
    parts = [bytes(head), bytes(-len(head) % DEFAULT_ALIGNMENT)]
    for _, _, _, raw in payloads:
        parts += [raw, bytes(-len(raw) % DEFAULT_ALIGNMENT)]
    return b"".join(parts)


def write_gguf(path: str | os.PathLike, tensors: dict[str, tuple[str, torch.Tensor]],
               metadata: dict[str, object] | None = None) -> None:
    """Write `gguf_bytes(tensors, metadata)` to `path`."""
    with open(path, "wb") as f:
        f.write(gguf_bytes(tensors, metadata))
