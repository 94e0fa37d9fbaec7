"""One object per stored weight format: the only place that knows a format's bytes.

Each format Weft reads is one `QuantFormat` (formats/base.py) in a module of its own:
  int8.py    int8_tensorwise, plain or with the "convrot" Hadamard rotation
  float8.py  float8_e4m3fn and float8_e5m2, including the legacy `scaled_fp8` form
  nvfp4.py   nvfp4 (E2M1 codes, e4m3 block scales, a tensor scale)
  mxfp8.py   mxfp8 (e4m3 codes, E8M0 block exponents)
  gguf.py    the GGUF block types (Q8_0 ... Q2_K), one object each, marked by a .gguf file's
             tensor types instead of a marker (models/gguf.py reads those files)
The object knows its marker options (`read_options`, `marker`), its layout (`scales`,
`code_dtypes`, `storage_shape`, `dense_shape`, `scale_elements`, `check_stored`), its encoding
(`encode`), how its stored tensors become the `kernels.quantized.QuantizedWeight` kernels read
(`weight`), its product (`linear`, `embedding`) and what an adapter needs beside it
(`adapter_input`, `linear_patched`). A layer's `LayerQuant.stored_format` is its object.

Who asks: models/quant/markers.py (which layers are quantized, which tensors they carry),
models/loading.py (do the stored tensors fit, what float shape they stand for), models/ops.py
(the quantized layers' weight, product and embedding rows), models/quant/writer.py and
models/patcher.py (encoding). kernels/ hold the arithmetic (decoders, the int8 and float8 products)
under the `WeightFormat` names and import nothing of Weft; a format object pairs its file tensors
with that arithmetic. The import direction is one way: kernels <- models/quant <- models/ops <-
models/loading; nothing here imports models/ops or the loader.

Adding a format is one more module here and one more entry in `_ALL` below, without changing
its callers. The GGUF block types are built that way: each is a `QuantFormat` whose `arithmetic`
is a `WeightFormat` member with its block decoder in kernels' `DECODERS` (the blocks stay as
uint8 rows; `storage_shape` / `dense_shape` translate between blocks and the float (N, K));
`weight` hands the rows to kernels as a QuantizedWeight, so the Linear's eager backend
dequantizes per op. Their layers are marked by the GGUF file's tensor types rather than
`.comfy_quant` (formats that are not `marked` are not named by markers), and models/gguf.py
builds the same `QuantPlan` markers.py builds; loading and ops are unchanged.

The low-rank adapter side path y = Q(W)h + s * B(A h), beside the quantized product instead of
dequantizing W, goes through the object too: `adapter_input` gives h, the activation the stored
weight multiplies (after the prologue and any per-column pre-scale, which a delta on W sees as
well), and `linear` runs Q(W)h with the unified Linear's epilogue, which is linear in an addend:
with residual R and residual scale r, R + r * (Q(W)h + bias + side) is
`linear(x, weight, bias, residual=R + r * side, residual_scale=r)`. ops.QuantizedLinear calls
that (models/patcher.py routes the patches); `linear_patched` (the dequantized weight plus the
deltas) is left for the patches that cannot run beside, DoRA's.
"""
from __future__ import annotations

from kernels.quantized import WeightFormat
from models.quant.formats.base import FORMATS, STORED_DTYPES, LayerQuant, QuantFormat, StoredTensors
from models.quant.formats.float8 import FLOAT8_E4M3FN, FLOAT8_E5M2
from models.quant.formats.gguf import GGUF_FORMATS
from models.quant.formats.int8 import INT8_TENSORWISE
from models.quant.formats.mxfp8 import MXFP8
from models.quant.formats.nvfp4 import NVFP4

# Registration is by this list (its order is the order formats are named in messages).
_ALL = (INT8_TENSORWISE, FLOAT8_E4M3FN, FLOAT8_E5M2, NVFP4, MXFP8, *GGUF_FORMATS)
FORMATS.update((fmt.arithmetic, fmt) for fmt in _ALL)
# The formats a marker may name (the GGUF block types are named by a .gguf file's tensor types instead).
SUPPORTED_FORMATS = tuple(fmt.name for fmt in _ALL if fmt.marked)
EMBEDDABLE_FORMATS = tuple(fmt.name for fmt in _ALL if fmt.embeddable and fmt.marked)

__all__ = ["EMBEDDABLE_FORMATS", "FORMATS", "STORED_DTYPES", "SUPPORTED_FORMATS", "LayerQuant", "QuantFormat", "StoredTensors",
           "format_named"]


def format_named(name: object) -> QuantFormat | None:
    """The format whose marker string is `name`, or None when Weft does not read it from a marker."""
    try:
        fmt = FORMATS.get(WeightFormat(name))
    except ValueError:
        return None
    return fmt if fmt is not None and fmt.marked else None
