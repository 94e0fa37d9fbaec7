"""The `triton` backend of the unified Linear: one Triton kernel with the prologue and epilogue fused in.

Computes `residual + residual_scale * (prologue(x) @ weight.T + bias)` (kernels/linear.py) in one
launch: each program owns a BLOCK_M x BLOCK_N tile of the output, walks K in BLOCK_K steps,
applies the prologue to each x tile in registers right before the tile's dot product, accumulates
in float32, and applies bias, scale and residual to the accumulator before its only store. Neither
the prologue's result nor the bare product ever goes to memory.

Prologues inside the K loop:
  rms_norm   one pass: the row's sum of squares accumulates alongside the products, the tile fed
             to the dot is x * norm_weight, and the accumulator is multiplied by the row's
             rsqrt(mean(x^2) + eps) in the epilogue. The norm is linear per row, so scaling after
             the product equals scaling before it, and x is read once instead of twice (a separate
             first pass for the statistic would read every x row block again per output tile).
             Rounding differs slightly from eager (x * w is rounded to the input dtype before the
             dot, not x / rms * w); in float16 an x * norm_weight beyond 65504 would overflow
             where eager's normalised value would not (norm weights near 1 never get there).
  swiglu     x has 2K features; silu(gate tile) * value tile from the two halves of the row.
  gelu_tanh  0.5 x (1 + tanh(u)) written as x * sigmoid(2u), which needs no tanh primitive.
Epilogue tensors (residual, residual_scale) are read through strides of their broadcast to the
output, viewed as (groups, rows per group, N): a per-channel vector, a per-sample gate (B, 1, N)
and a full (M, N) tensor all load in place, without materialising the broadcast.

Where it runs: CUDA tensors with the triton package, or CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported), which is how the tests check it on a machine
without a GPU. Automatic choice never picks the interpreter (it is thousands of times slower);
it runs when forced (WEFT_KERNEL_BACKEND=triton or backend="triton").
triton is imported only when a call needs it, so this module imports without it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import os
import sys
from typing import Any, Callable

import torch

from kernels.prologues import Prologue
from kernels.registry import BackendUnavailable

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Shape classes whose kernel failed to build or launch -> why; later calls decline at once.
_failures: dict[tuple, str] = {}

# Under the interpreter every program runs as numpy calls one after another: small fixed tiles keep
# a test case at a few programs and exercise the tile edges, with no autotuning launches.
INTERPRET_BLOCKS = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried by the autotuner on CUDA, per shape class
# (token-count bucket, N, K, prologue and epilogue flags, dtypes). Configs a device cannot fit
# (shared memory) are skipped by the autotuner. The last two serve few-token calls (conditioning,
# small batches) where a tall tile would be mostly padding.
CUDA_CONFIGS = (
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 32, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 64, 4, 3),
    (32, 64, 64, 4, 4),
    (16, 64, 128, 4, 3),
)
GROUP_M_CUDA = 8

_TRUTHY = ("1", "true", "on", "yes")


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET)."""
    if "triton" in sys.modules:
        knobs = getattr(sys.modules["triton"], "knobs", None)
        if knobs is not None:
            return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY


def available() -> str | None:
    """Why the triton backend cannot run in this process (None when it can)."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if not interpreting() and not torch.cuda.is_available():
        return ("no CUDA device: the triton kernel runs on CUDA only "
                "(or on CPU tensors under Triton's interpreter, TRITON_INTERPRET=1, for testing)")
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as error:  # a broken install is "not available", with its reason
        return f"triton does not import: {type(error).__name__}: {error}"
    return None


def check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
          prologue: Prologue | str | None = None, prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
          residual: torch.Tensor | None = None,
          residual_scale: torch.Tensor | float | None = None) -> str | None:
    """Why the triton kernel cannot run this call (None when it can)."""
    try:
        Prologue.parse(prologue)
    except ValueError as error:
        return str(error)
    scale = residual_scale if isinstance(residual_scale, torch.Tensor) else None
    named = {"x": x, "weight": weight, "bias": bias, "prologue_weight": prologue_weight, "residual": residual,
             "residual_scale": scale}
    present = {name: t for name, t in named.items() if t is not None}
    if interpreting():
        if x.device.type != "cpu":
            return f"under TRITON_INTERPRET=1 the kernel runs on CPU tensors only, x is on {x.device}"
    elif x.device.type != "cuda":
        return f"x is on {x.device}; the triton kernel runs on CUDA tensors only"
    for name, tensor in present.items():
        if tensor.device != x.device:
            return f"inputs are on different devices ({name} on {tensor.device}, x on {x.device})"
    for name, tensor in present.items():
        if tensor.dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {tensor.dtype}; the triton kernel takes float32/bfloat16/float16"
    if weight.dtype != x.dtype:
        return f"x ({x.dtype}) and weight ({weight.dtype}) differ in dtype; the kernel's dot needs one"
    if weight.dim() != 2 or x.dim() < 1:
        return f"x {tuple(x.shape)} / weight {tuple(weight.shape)} are not (..., K) / (N, K)"
    if x.numel() == 0 or weight.numel() == 0:
        return "empty input (nothing for a kernel to launch over)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in present.values()):
        return "inputs require grad; the triton kernel has no backward (inference only)"
    if torch.compiler.is_compiling():
        return "inside a torch.compile region (the outer compile fuses the eager op)"
    return None


def worthwhile(*_args: Any, **_kwargs: Any) -> str | None:
    """Why automatic choice should pass this backend over (None when it should use it)."""
    if interpreting():
        return "Triton's interpreter (TRITON_INTERPRET=1) is for testing: it runs only when forced"
    return None


def _epilogue_operand(tensor: torch.Tensor, out_shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` broadcast to the output and viewed as (groups, rows per group, N), copied only if it must be."""
    leading = out_shape[:-1]
    rows_per_group = leading[-1] if leading else 1
    groups = math.prod(leading[:-1])
    # expand() gives the broadcast dimensions stride 0; reshape keeps it a view whenever the
    # leading dimensions before the last one merge (always for (N,), (B, 1, N) and dense (..., N)).
    return tensor.expand(out_shape).reshape(groups, rows_per_group, out_shape[-1])


def _dot_precision(dtype: torch.dtype, device_type: str) -> str:
    # Follow torch's own float32 matmul setting, so the backend matches what eager gives on the same
    # GPU (TF32 only where the user allowed it).
    # (ROCm takes only "ieee" on most devices.)
    if (dtype == torch.float32 and device_type == "cuda" and torch.version.hip is None
            and torch.backends.cuda.matmul.allow_tf32):
        return "tf32"
    return "ieee"


@functools.lru_cache(maxsize=None)
def _build_kernel(interpret: bool) -> Callable[..., Any]:
    """The jitted kernel (autotuned on CUDA, fixed small tiles under the interpreter).

    Built on first use, not at import: triton.jit decides at decoration time whether the kernel is
    interpreted or compiled, and a process that never runs it never imports triton.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def fused_linear_kernel(
        x_ptr, w_ptr, bias_ptr, norm_w_ptr, res_ptr, scale_ptr, out_ptr,
        M, N, K, M_BUCKET,
        stride_xm, stride_xk, stride_wn, stride_wk,
        rows_per_group,
        stride_rg, stride_rt, stride_rn,
        stride_sg, stride_st, stride_sn,
        stride_om, stride_on,
        scale_value, eps,
        PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM_WEIGHT: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WIDEN_DOT_OPERANDS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # Programs are numbered so that consecutive ones cover GROUP_M row tiles of the same
        # column band: the weight tiles they share are still in L2 when the next one reads them.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        band = GROUP_M * tiles_n
        first_m = (pid // band) * GROUP_M
        band_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % band) % band_rows
        pid_n = (pid % band) // band_rows

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        rows = offs_m.to(tl.int64)  # row offsets of long sequences overflow int32 elements
        dot_dtype = w_ptr.dtype.element_ty

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            offs_k = k_start + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x_mask = mask_m[:, None] & mask_k[None, :]
            x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
            # Masked lanes load 0, and every prologue maps 0 to 0: padding adds nothing to the dot
            # or to the sum of squares.
            a = tl.load(x_ptrs, mask=x_mask, other=0.0)
            if PROLOGUE == "rms_norm":
                af = a.to(tl.float32)
                sum_sq += tl.sum(af * af, axis=1)
                if HAS_NORM_WEIGHT:
                    norm_w = tl.load(norm_w_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                    af = af * norm_w[None, :]
                a = af.to(dot_dtype)
            elif PROLOGUE == "swiglu":
                gate = a.to(tl.float32)
                value = tl.load(x_ptrs + K * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
                a = (gate * tl.sigmoid(gate) * value).to(dot_dtype)
            elif PROLOGUE == "gelu_tanh":
                af = a.to(tl.float32)
                inner = 0.7978845608028654 * (af + 0.044715 * af * af * af)  # sqrt(2/pi) (x + 0.044715 x^3)
                a = (af * tl.sigmoid(2.0 * inner)).to(dot_dtype)
            w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_K, BLOCK_N) of W.T
            if WIDEN_DOT_OPERANDS:
                # Only under the interpreter, whose tl.dot multiplies bfloat16 bit patterns as integers
                # (triton-lang/triton#11584): widen the (already bf16-rounded) operands to float32, which
                # holds every bf16 value exactly, so the products match a bf16 tensor-core dot.
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)

        if PROLOGUE == "rms_norm":
            acc = acc * tl.rsqrt(sum_sq / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc = acc * scale_value
        out_mask = mask_m[:, None] & mask_n[None, :]
        group = rows // rows_per_group
        within = rows % rows_per_group
        if HAS_SCALE:
            s_ptrs = scale_ptr + group[:, None] * stride_sg + within[:, None] * stride_st + offs_n[None, :] * stride_sn
            acc = acc * tl.load(s_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r_ptrs = res_ptr + group[:, None] * stride_rg + within[:, None] * stride_rt + offs_n[None, :] * stride_rn
            acc += tl.load(r_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)

    if interpret:
        return fused_linear_kernel
    configs = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M_CUDA),
                             num_warps=warps, num_stages=stages)
               for bm, bn, bk, warps, stages in CUDA_CONFIGS]
    # M_BUCKET (the token count rounded up to a power of two) stands in for M in the key, so varying
    # prompt lengths reuse a tuned config instead of autotuning once per length.
    key = ["M_BUCKET", "N", "K", "PROLOGUE", "HAS_BIAS", "HAS_NORM_WEIGHT", "HAS_RESIDUAL", "HAS_SCALE",
           "DOT_PRECISION", "WIDEN_DOT_OPERANDS"]
    return triton.autotune(configs=configs, key=key)(fused_linear_kernel)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  prologue: Prologue | str | None = None, prologue_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, residual: torch.Tensor | None = None,
                  residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """`residual + residual_scale * (prologue(x) @ weight.T + bias)` as one Triton kernel launch."""
    prologue = Prologue.parse(prologue)
    interpret = interpreting()
    kernel = _build_kernel(interpret)
    out_features, in_features = weight.shape
    rows = x.numel() // x.shape[-1]
    out_shape = (*x.shape[:-1], out_features)
    x2 = x.reshape(rows, x.shape[-1])  # a view for any x whose leading dimensions merge; strides go to the kernel
    out_dtype = residual.dtype if residual is not None else x.dtype
    out = torch.empty((rows, out_features), dtype=out_dtype, device=x.device)

    # Absent optional inputs still need a pointer argument; the constexpr flag keeps it unread.
    absent_operand = out
    if residual is not None:
        res3 = _epilogue_operand(residual, out_shape)
        res_strides = res3.stride()
    else:
        res3, res_strides = absent_operand, (0, 0, 0)
    scale_value = 1.0
    scale3, scale_strides = absent_operand, (0, 0, 0)
    if isinstance(residual_scale, torch.Tensor):
        scale3 = _epilogue_operand(residual_scale, out_shape)
        scale_strides = scale3.stride()
    elif residual_scale is not None:
        scale_value = float(residual_scale)
    rows_per_group = out_shape[-2] if len(out_shape) > 1 else 1

    # The kernel takes the prologue as a constexpr string: a Prologue's value, or "none".
    meta = dict(PROLOGUE=prologue.value if prologue is not None else "none", HAS_BIAS=bias is not None,
                HAS_NORM_WEIGHT=prologue is Prologue.RMS_NORM and prologue_weight is not None,
                HAS_RESIDUAL=residual is not None, HAS_SCALE=isinstance(residual_scale, torch.Tensor),
                DOT_PRECISION=_dot_precision(x.dtype, x.device.type),
                WIDEN_DOT_OPERANDS=interpret and x.dtype == torch.bfloat16)
    if interpret:
        meta.update(INTERPRET_BLOCKS)
    # The kernel indexes bias and norm weight with unit stride (both are parameters, contiguous already).
    bias = bias.contiguous() if bias is not None else absent_operand
    norm_weight = prologue_weight.contiguous() if meta["HAS_NORM_WEIGHT"] else absent_operand

    def grid(config: dict) -> tuple[int]:
        return (_cdiv(rows, config["BLOCK_M"]) * _cdiv(out_features, config["BLOCK_N"]),)

    failure_key = (tuple(sorted(meta.items())), in_features, out_features, x.dtype, x.device.type)
    failed = _failures.get(failure_key)
    if failed is not None:
        raise BackendUnavailable(failed)
    try:
        # The launch goes to the current CUDA device: make that x's device.
        with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
            kernel[grid](
                x2, weight, bias, norm_weight, res3, scale3, out,
                rows, out_features, in_features, 1 << max(0, rows - 1).bit_length(),
                x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                rows_per_group,
                *res_strides, *scale_strides,
                out.stride(0), out.stride(1),
                scale_value, float(eps),
                **meta,
            )
    except torch.OutOfMemoryError:
        raise  # the caller's memory, not the kernel's fault: the memory manager deals with it
    except Exception as error:
        # The kernel could not be built or launched for this shape class (a Triton compile error, a
        # device without the resources any config needs): remember it, and let the registry pass
        # the call to the next backend rather than fail the job.
        reason = f"the triton kernel failed for this shape class: {type(error).__name__}: {str(error)[:300]}"
        logger.warning("%s", reason)
        _failures[failure_key] = reason
        raise BackendUnavailable(reason) from error
    return out.reshape(out_shape)
