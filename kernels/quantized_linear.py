"""The unified Linear on a quantized weight: `residual + residual_scale * (prologue(x) @ W.T + bias)`.

kernels/linear.py's `linear` hands every call whose weight is a `QuantizedWeight` to this op. Its
backends, in priority order:
  dequantized    the CPU's product for every stored format (int8, float8, nvfp4, mxfp8, the GGUF block
                 types): the weight decoded (kernels/quantized.py's decoder of its format, the same
                 arithmetic as the reference's) into one reused float32 buffer per thread (it grows to
                 the largest layer), multiplied by the float32 activation through the float Linear's
                 own backend choice (kernels/linear.py), the result rounded once to the output dtype.
                 The activation rule is the reference's, in float32: prologue, then nvfp4's
                 `pre_quant_scale`; a convrot layer rotates the activation instead of the weight
                 (`rotate_rows_factored`). Inference only; CPU only.
  int8_compiled  the int8 product below with its two elementwise stages each fused by torch.compile
                 (prologue, pre-scale, rotation and per-token quantization; rescale and epilogue),
                 once per shape class; chosen automatically for products large enough to repay it.
  int8           int8 weights (rotated or not): the activation is rotated online by the same
                 block-diagonal Hadamard as the weight, quantized per token (row scale = max |x| / 127),
                 multiplied with int32 accumulation (`torch._int_mm`) and rescaled by row scale x
                 weight row scale in float32. CPU and CUDA.
  fp8            float8 weights on a CUDA device with float8 matrix units (compute capability 8.9+):
                 the activation is cast to float8-e4m3 with the layer's `input_scale` (1.0 without
                 one, clamped to +-448) and multiplied by `torch._scaled_mm`.
  eager          the reference for every format: dequantize the weight (kernels/quantized.py) to x's
                 dtype, then the float Linear's eager reference. On CUDA, what has no native product on
                 the device (nvfp4, mxfp8, GGUF, float8 below 8.9) runs this; layers marked
                 `full_precision` run only this, on every device.
An nvfp4 layer's `pre_quant_scale` multiplies the input (after the prologue) on every path.

Why every format decodes on the CPU, and int8 keeps `torch._int_mm` on CUDA. A CPU without native
bfloat16 arithmetic (AVX2, no AVX512-BF16 or AMX) emulates the bfloat16 product the reference runs,
several times slower than the float32 one, while decoding a weight costs a few percent of the float32
product: bench/quantized.py's "decode" section measures eager, the decode alone and this backend per
format at the H3 step's shapes. For int8 the other candidates were slower or inexact at those shapes
(one thread, 1,060 tokens, 1344 -> 5376 and 3584 -> 1344, AVX2 AMD EPYC): `torch._int_mm` took about 25x
this backend's time, `torch._weight_int8pack_mm` 2.5x (bfloat16 activation) to 37x (float32), and
oneDNN's own int8 product (`onednn::qlinear_pointwise`, prepacked weight), though 0.4x, sums pairs of
products in 16 bits on this CPU, which saturates for 8-bit activations (9.7% error) and is exact only
for 7-bit ones (1.8% error against the float product, twice the activation rounding of the int8 product
on CUDA), so it is not used. On CUDA `torch._int_mm` runs on int8 tensor cores and stays the choice.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from kernels import compiled as _compiled
from kernels.linear import LINEAR as float_linear
from kernels.linear import _flatten_epilogue, apply_prologue, flatten_residual_scale, linear_eager
from kernels.prologues import Prologue
from kernels.quantized import (DECODERS, FLOAT8_FORMATS, QuantizedWeight, WeightFormat, hadamard, rotate_rows,
                               rotate_rows_factored)
from kernels.registry import KernelRegistry

INT8_MAX = 127.0
FLOAT8_E4M3_MAX = 448.0


def _finish(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
            residual_scale: torch.Tensor | float | None, out_dtype: torch.dtype) -> torch.Tensor:
    """float32 product rows -> bias, scale and residual added in float32, rounded once to the output dtype."""
    # `y` is a fresh float32 tensor of the output's shape, so the epilogue works in place.
    if bias is not None:
        y.add_(bias.float())
    if residual_scale is not None:
        y.mul_(residual_scale.float() if isinstance(residual_scale, torch.Tensor) else float(residual_scale))
    if residual is not None:
        y = y.add_(residual.float()) if residual.shape == y.shape else residual.float() + y
    return y.to(residual.dtype if residual is not None else out_dtype)


def product_input(x: torch.Tensor, weight: QuantizedWeight, prologue: Prologue | str | None,
                  prologue_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """What the stored weight multiplies: the prologue's output, times the per-column pre-scale if the weight has one."""
    h = apply_prologue(x, prologue, prologue_weight, eps)
    if weight.pre_quant_scale is not None:
        h = h * weight.pre_quant_scale.to(h.dtype)
    return h


def quantized_linear_eager(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                           prologue: Prologue | str | None = None,
                           prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
                           residual: torch.Tensor | None = None,
                           residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """The reference: the weight dequantized to x's dtype, then the float Linear's eager reference."""
    h = product_input(x, weight, prologue, prologue_weight, eps)
    return linear_eager(h, weight.dequantize(x.dtype), bias, residual=residual, residual_scale=residual_scale)


# ----------------------------------------------------------------------------------------------
# int8 backend

def quantize_rows_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (M, K) floats -> int8 codes (M, K) and float32 row scales (M, 1)."""
    # The row maximum is exact in any float dtype; the division promotes to float32 in the same pass.
    largest = torch.linalg.vector_norm(rows, ord=float("inf"), dim=-1, keepdim=True)
    scale = (largest.float() / INT8_MAX).clamp_(min=1e-30)
    # |rows / scale| <= 127 by construction, so rounding needs no clamp.
    return torch.div(rows, scale).round_().to(torch.int8), scale


def int8_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """int32 (M, N) = int8 a (M, K) @ int8 b_t.T, with b_t (N, K); pads M where CUDA needs more than 16 rows."""
    rows = a.shape[0]
    if a.is_cuda and rows <= 16:
        a = F.pad(a, (0, 0, 0, 32 - rows))
    return torch._int_mm(a, b_t.t())[:rows]


def _int8_check(x, weight, bias=None, **_options) -> str | None:
    if not isinstance(weight, QuantizedWeight) or weight.format is not WeightFormat.INT8:
        return "the weight is not int8_tensorwise"
    if weight.full_precision:
        return "the layer is marked full_precision_matrix_mult"
    if x.device.type not in ("cpu", "cuda"):
        return f"torch._int_mm does not run on {x.device.type}"
    if weight.data.device != x.device:
        return "the weight and x are on different devices"
    if x.device.type == "cuda":
        out_features, in_features = weight.shape
        if in_features % 8 or out_features % 8:
            return f"torch._int_mm on CUDA needs widths that are multiples of 8, got {tuple(weight.shape)}"
    return None


def quantized_linear_int8(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                          prologue: Prologue | str | None = None,
                          prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
                          residual: torch.Tensor | None = None,
                          residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """int8 x int8 -> int32 product of the per-token quantized (rotated) activation and the stored codes."""
    h = product_input(x, weight, prologue, prologue_weight, eps)
    if weight.rotation_group:
        h = rotate_rows(h, weight.rotation_group)
    out_features = weight.shape[0]
    rows = h.reshape(-1, h.shape[-1])
    codes, row_scale = quantize_rows_int8(rows)
    acc = int8_matmul(codes, weight.data)  # (M, N) int32
    weight_scale = weight.scale.float().reshape(1, -1)  # (1, N) or (1, 1)
    y = torch.mul(acc, row_scale).mul_(weight_scale)  # float32 (M, N)
    out = y.reshape(*x.shape[:-1], out_features)
    return _finish(out, bias, residual, residual_scale, x.dtype)


# ----------------------------------------------------------------------------------------------
# int8, compiled

def _int8_activation_graph(x2: torch.Tensor, prologue_weight: torch.Tensor | None,
                           pre_quant_scale: torch.Tensor | None, rotation: torch.Tensor | None,
                           prologue: Prologue | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K') rows -> int8 codes (M, K) and float32 row scales (M, 1): what the int8 backend does before the product."""
    h = apply_prologue(x2, prologue, prologue_weight, eps)
    if pre_quant_scale is not None:
        h = h * pre_quant_scale.to(h.dtype)
    if rotation is not None:
        group = rotation.shape[0]
        h = torch.matmul(h.reshape(h.shape[0], -1, group), rotation.T).reshape(h.shape[0], -1)
    hf = h.float()
    scale = (hf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=1e-30)
    return torch.round(hf / scale).to(torch.int8), scale


def _int8_rescale_graph(acc: torch.Tensor, row_scale: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, residual: torch.Tensor | None, scale: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """int32 (M, N) -> the output rows: rescale, bias, residual scale and residual in float32, rounded once."""
    y = acc.float() * row_scale * weight_scale
    if bias is not None:
        y = y + bias.float()
    if scale is not None:
        y = y * scale.float()
    if residual is not None:
        y = residual.float() + y
    return y.to(out_dtype)


_activation_compiler = _compiled.ShapeClassCompiler(_int8_activation_graph)
_rescale_compiler = _compiled.ShapeClassCompiler(_int8_rescale_graph)


def _int8_compiled_check(x, weight, bias=None, *, prologue=None, prologue_weight=None, eps=1e-6, residual=None,
                         residual_scale=None) -> str | None:
    reason = _int8_check(x, weight, bias)
    if reason is not None:
        return reason
    scale = residual_scale if isinstance(residual_scale, torch.Tensor) else None
    return _compiled.decline_reason([x, bias, prologue_weight, residual, scale, weight.pre_quant_scale])


def _int8_compiled_worthwhile(x, weight, bias=None, **_options) -> str | None:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return _compiled.worthwhile(rows * weight.shape[0] * weight.shape[1])


def quantized_linear_int8_compiled(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                                   prologue: Prologue | str | None = None,
                                   prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
                                   residual: torch.Tensor | None = None,
                                   residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """The int8 backend with its activation and output stages compiled (see the module docstring)."""
    prologue = Prologue.parse(prologue)
    out_features, in_features = weight.shape
    rows = x.numel() // x.shape[-1]
    out_shape = (*x.shape[:-1], out_features)
    x2 = x.reshape(rows, x.shape[-1])
    group = weight.rotation_group
    rotation = hadamard(group, device=x.device, dtype=x.dtype) if group else None
    pre = weight.pre_quant_scale
    key = (prologue, x.shape[-1], in_features, group, x.dtype, x.device.type, prologue_weight is not None,
           pre is not None, float(eps), rows == 1)
    codes, row_scale = _activation_compiler.run(key, x2, prologue_weight, pre, rotation, prologue, float(eps))
    acc = int8_matmul(codes, weight.data)  # (M, N) int32
    residual2, residual_kind = _flatten_epilogue(residual, out_shape, rows)
    scale, scale_kind = flatten_residual_scale(residual_scale, out_shape, rows, x.device)
    out_dtype = residual.dtype if residual is not None else x.dtype
    weight_scale = weight.scale.float().reshape(1, -1)
    key = (out_features, weight_scale.shape[1] == 1, bias is not None, residual_kind,
           residual.dtype if residual is not None else None, scale_kind, out_dtype, x.device.type, rows == 1)
    y = _rescale_compiler.run(key, acc, row_scale, weight_scale, bias, residual2, scale, out_dtype)
    return y.reshape(out_shape)


# ----------------------------------------------------------------------------------------------
# dequantized (the CPU's choice, every format)

_scratch = threading.local()  # per thread: the float32 buffer weights are decoded into


def decode_into_buffer(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight (N, K) in the stored frame (for convrot: rotated), decoded into this thread's reused buffer.

    The buffer grows to the largest layer decoded so far (at its stored, possibly padded, shape) and
    is overwritten by the next call on the same thread: the result is valid until then, and never
    handed out beyond one product. Block formats whose columns are padded give a strided view.
    """
    rows, cols = weight.stored_shape
    count = rows * cols
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < count or buffer.device != weight.data.device:
        buffer = _scratch.buffer = torch.empty(count, dtype=torch.float32, device=weight.data.device)
    decoded = weight.decode_stored(buffer[:count].view(rows, cols))
    out_features, in_features = weight.shape
    return decoded if (rows, cols) == (out_features, in_features) else decoded[:out_features, :in_features]


def _dequantized_check(x, weight, bias=None, **_options) -> str | None:
    if not isinstance(weight, QuantizedWeight) or weight.format not in DECODERS:
        return "the weight is not in a format with a decoder"
    if weight.full_precision:
        return "the layer is marked full_precision_matrix_mult"
    if x.device.type != "cpu" or weight.data.device.type != "cpu":
        return "the dequantizing product serves the CPU (on CUDA the formats' own products and the reference run)"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"x dtype {x.dtype} is not one the float32 product can stand in for"
    if torch.is_grad_enabled() and x.requires_grad:
        return "x requires grad; the decoded weight lives in a reused buffer (inference only)"
    return None


def quantized_linear_dequantized(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                                 *, prologue: Prologue | str | None = None,
                                 prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
                                 residual: torch.Tensor | None = None,
                                 residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """The float32 product on the weight decoded into the thread's buffer; a convrot layer rotates the activation."""
    h = x.float()
    if weight.pre_quant_scale is not None or weight.rotation_group:
        h = product_input(h, weight, prologue, prologue_weight, eps)
        prologue = prologue_weight = None
    if weight.rotation_group:
        # x @ W.T = rotate(x) @ stored.T (the rotation is symmetric and its own inverse), and rotating
        # the M activation rows costs less than rotating the N weight rows whenever M < N.
        h = rotate_rows_factored(h, weight.rotation_group)
    y = float_linear(h, decode_into_buffer(weight), bias.float() if bias is not None else None,
                     prologue=prologue, prologue_weight=prologue_weight, eps=eps, residual=residual,
                     residual_scale=residual_scale)
    return y if residual is not None else y.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# float8 backend

def _fp8_available() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 9):
        return "the CUDA device has no float8 matrix units (compute capability below 8.9)"
    return None


def _fp8_check(x, weight, bias=None, **_options) -> str | None:
    if not isinstance(weight, QuantizedWeight) or weight.format not in FLOAT8_FORMATS:
        return "the weight is not float8"
    if weight.full_precision:
        return "the layer is marked full_precision_matrix_mult"
    if x.device.type != "cuda" or weight.data.device != x.device:
        return "x and the weight must both be on the CUDA device"
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return "the CUDA device has no float8 matrix units (compute capability below 8.9)"
    out_features, in_features = weight.shape
    if in_features % 16 or out_features % 16:
        return f"torch._scaled_mm needs widths that are multiples of 16, got {tuple(weight.shape)}"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"x dtype {x.dtype} is not a float dtype _scaled_mm writes"
    return None


def quantized_linear_fp8(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                         prologue: Prologue | str | None = None,
                         prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
                         residual: torch.Tensor | None = None,
                         residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """float8-e4m3 activation (scaled by input_scale, else 1) times the float8 weight through torch._scaled_mm."""
    h = product_input(x, weight, prologue, prologue_weight, eps)
    rows = h.reshape(-1, h.shape[-1])
    input_scale = (weight.input_scale.float().reshape(()) if weight.input_scale is not None
                   else torch.ones((), dtype=torch.float32, device=x.device))
    # torch._scaled_mm takes a row-major activation and a column-major weight (the stored rows, transposed).
    codes = (rows.float() / input_scale).clamp_(-FLOAT8_E4M3_MAX, FLOAT8_E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
    y = torch._scaled_mm(codes, weight.data.t(), scale_a=input_scale, scale_b=weight.scale.float().reshape(()),
                         out_dtype=torch.float32)
    out = y.reshape(*x.shape[:-1], weight.shape[0])
    return _finish(out, bias, residual, residual_scale, x.dtype)


# ----------------------------------------------------------------------------------------------
# registry

QUANTIZED_LINEAR = KernelRegistry("quantized_linear")
QUANTIZED_LINEAR.register("eager", quantized_linear_eager)
QUANTIZED_LINEAR.register("fp8", quantized_linear_fp8, check=_fp8_check, available=_fp8_available, before="eager")
QUANTIZED_LINEAR.register("int8", quantized_linear_int8, check=_int8_check, before="fp8")
QUANTIZED_LINEAR.register("int8_compiled", quantized_linear_int8_compiled, check=_int8_compiled_check,
                          available=_compiled.available, worthwhile=_int8_compiled_worthwhile, before="int8")
QUANTIZED_LINEAR.register("dequantized", quantized_linear_dequantized, check=_dequantized_check,
                          before="int8_compiled")


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, **options) -> torch.Tensor:
    """The unified Linear with a quantized weight (arguments checked by kernels/linear.py's `linear`)."""
    return QUANTIZED_LINEAR(x, weight, bias, **options)
