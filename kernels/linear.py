"""The unified Linear: `residual + residual_scale * (prologue(x) @ weight.T + bias)`.

One public function, `linear`, with several backends behind a capability check (kernels/registry.py):
  eager     the reference (`linear_eager`); always runs
  compiled  torch.compile of `_linear_graph`, once per shape class (static for the first token count,
            dynamic from the second); CPU and CUDA
  triton    a Triton kernel with prologue and epilogue fused into the matrix product (kernels/triton_linear.py);
            CUDA with the triton package (CPU tensors only under TRITON_INTERPRET=1, and only when forced)
  onednn    the eager prologue and epilogue around oneDNN's float32 product (`_onednn_linear`); CPU
The float32 product on an AVX-512 CPU goes to oneDNN in both `onednn` and `compiled` (see `_onednn_linear`);
on a CPU without native bfloat16/float16 arithmetic, `compiled` multiplies those dtypes in float32
(see `widened_on_cpu`).

Prologues (kernels/prologues.py, `Prologue` or its value): `rms_norm` (x / rms(x) * prologue_weight, eps),
`swiglu` (silu(first half of x) * second half; x then has twice the weight's input features),
`gelu_tanh`, or None. `residual_scale` is a
scalar, a per-channel vector `(N,)`, or any tensor broadcastable to the output (a per-sample gate).
The epilogue (bias, scale, residual) is computed in float32 and the result has the residual's dtype
(x's dtype without a residual), as a fused kernel accumulating in registers would.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import compiled as _compiled
from kernels import triton_linear as _triton_linear
from kernels.norms import rms_norm
from kernels.prologues import Prologue
from kernels.quantized import QuantizedWeight
from kernels.registry import KernelRegistry, disable_fused_kernels, fused_kernels_enabled  # noqa: F401 (re-exported)



def apply_prologue(x: torch.Tensor, prologue: Prologue | str | None, prologue_weight: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """The prologue alone, as the eager reference computes it."""
    prologue = Prologue.parse(prologue)
    if prologue is None:
        return x
    if prologue is Prologue.RMS_NORM:
        return rms_norm(x, prologue_weight, eps)
    if prologue is Prologue.SWIGLU:
        gate, value = x.chunk(2, dim=-1)
        return F.silu(gate) * value
    return F.gelu(x, approximate="tanh")  # Prologue.GELU_TANH


def linear_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 prologue: Prologue | str | None = None, prologue_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, residual: torch.Tensor | None = None,
                 residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """The reference implementation."""
    y = F.linear(apply_prologue(x, prologue, prologue_weight, eps), weight, bias)
    if residual is None and residual_scale is None:
        return y
    out_dtype = residual.dtype if residual is not None else y.dtype
    yf = y.float()
    if residual_scale is not None:
        yf = yf * (residual_scale.float() if isinstance(residual_scale, torch.Tensor) else float(residual_scale))
    if residual is not None:
        yf = residual.float() + yf
    return yf.to(out_dtype)


def check_arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: Prologue | None,
                    prologue_weight: torch.Tensor | None, residual: torch.Tensor | None,
                    residual_scale: torch.Tensor | float | None) -> None:
    """Raise ValueError naming the shapes when the arguments do not describe one linear op."""
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be (out_features, in_features), got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    x_features = 2 * in_features if prologue is Prologue.SWIGLU else in_features
    if x.dim() < 1 or x.shape[-1] != x_features:
        raise ValueError(f"linear: x of shape {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         f"{' with the swiglu prologue (x needs 2 x in_features)' if prologue is Prologue.SWIGLU else ''}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"linear: bias must be ({out_features},), got shape {tuple(bias.shape)}")
    if prologue is Prologue.RMS_NORM and prologue_weight is not None and tuple(prologue_weight.shape) != (in_features,):
        raise ValueError(f"linear: rms_norm prologue_weight must be ({in_features},), got {tuple(prologue_weight.shape)}")
    if prologue is not Prologue.RMS_NORM and prologue_weight is not None:
        raise ValueError(f"linear: prologue_weight is only used by the rms_norm prologue, not {prologue!r}")
    out_shape = (*x.shape[:-1], out_features)
    for name, tensor in (("residual", residual), ("residual_scale", residual_scale)):
        if isinstance(tensor, torch.Tensor):
            try:
                broadcast = torch.broadcast_shapes(tensor.shape, out_shape)
            except RuntimeError:
                broadcast = None
            if broadcast != torch.Size(out_shape):
                raise ValueError(f"linear: {name} of shape {tuple(tensor.shape)} does not broadcast to the output {out_shape}")


# ----------------------------------------------------------------------------------------------
# oneDNN's float32 product on the CPU

# torch's float32 `mm` on the CPU calls the BLAS it was built with (MKL), which on AMD processors
# runs a path without AVX-512; oneDNN (already inside torch, and what torch's own bfloat16 product
# calls) runs AVX-512 wherever the CPU has it. At the H3 step's shapes it is about twice as fast in
# float32 on the AVX-512 AMD EPYC this was first measured on (bench/dit_step.py), with float32
# rounding only: the summation order differs, not the precision. Where torch runs at AVX2 (no AVX-512)
# both libraries run the same width and MKL's is the faster one: oneDNN took 1.04x-1.12x MKL's time at
# the four Linear shapes of the H3 step (1,060 tokens, 1 and 2 threads; bench/kernels.py's managed
# section), so the backend is used only on CPUs where torch reports AVX-512 (ONEDNN_CAPABILITIES).
# Wrapped as a custom op so that inductor calls it as an opaque kernel inside a compiled graph (its
# own lowering of the mkldnn op expects a prepacked weight). Below ONEDNN_MIN_MACS a product is bound
# by call overhead, not by the kernel.
ONEDNN_MIN_MACS = 1 << 22
ONEDNN_CAPABILITIES = ("AVX512",)  # values of torch.backends.cpu.get_cpu_capability()


@torch.library.custom_op("weft::onednn_linear", mutates_args=())
def _onednn_linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), weight.contiguous(), None, "none", [], "")


@_onednn_linear.register_fake
def _onednn_linear_shape(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x2.new_empty((x2.shape[0], weight.shape[0]))


def _onednn_available() -> str | None:
    if not torch.backends.mkldnn.is_available():
        return "this torch was built without oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch has no mkldnn::_linear_pointwise"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ONEDNN_CAPABILITIES:
        return f"torch runs this CPU at {capability}, where MKL's float32 product is the faster one (no AVX-512)"
    probe = torch.ones(2, 3)
    if not torch.equal(_onednn_linear(probe, torch.ones(4, 3)), torch.full((2, 4), 3.0)):
        return "oneDNN's product gave a wrong result on a probe"
    return None


def onednn_capable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product of x (M, K) and weight (N, K) goes to oneDNN: CPU with AVX-512, float32, oneDNN present."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and _onednn.unavailable_reason() is None)


# A CPU without native bfloat16 (or float16) arithmetic (no AVX512-BF16 / AMX; what oneDNN reports)
# emulates the half-precision product, about 8x slower than the float32 one on an AVX2 EPYC at the H3
# step's shapes. There the compiled graph widens both operands to float32, multiplies in float32 and
# rounds the result once to the input's dtype: the stored tensors stay half precision, and the result
# is the one a native product (float32 accumulation, one rounding) gives, up to summation order.
@functools.lru_cache(maxsize=None)
def _native_half_product(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def widened_on_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product of x and weight runs in float32: both bfloat16/float16 on a CPU without that arithmetic."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and not _native_half_product(x.dtype))


def linear_onednn(x, weight, bias=None, *, prologue=None, prologue_weight=None, eps=1e-6, residual=None,
                  residual_scale=None):
    """The eager reference with its product through oneDNN (float32 on the CPU)."""
    h = apply_prologue(x, prologue, prologue_weight, eps)
    y = _onednn_linear(h.reshape(-1, h.shape[-1]), weight).reshape(*h.shape[:-1], weight.shape[0])
    if bias is not None:
        y = y + bias
    if residual is None and residual_scale is None:
        return y
    yf = y
    if residual_scale is not None:
        yf = yf * (residual_scale.float() if isinstance(residual_scale, torch.Tensor) else float(residual_scale))
    if residual is not None:
        yf = residual.float() + yf
    return yf.to(residual.dtype if residual is not None else y.dtype)


def _onednn_check(x, weight, bias=None, *, prologue=None, prologue_weight=None, eps=1e-6, residual=None,
                  residual_scale=None) -> str | None:
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return "oneDNN's product serves CPU tensors"
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return f"dtype {x.dtype} is not float32 (torch's own bfloat16 product already calls oneDNN)"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "inputs require grad; the oneDNN backend serves inference only"
    return None


def _onednn_worthwhile(x, weight, bias=None, **_options) -> str | None:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    macs = rows * weight.shape[0] * weight.shape[1]
    if macs < ONEDNN_MIN_MACS:
        return f"too small for a second library's call to pay ({macs} multiply-adds < {ONEDNN_MIN_MACS})"
    return None


# ----------------------------------------------------------------------------------------------
# compiled backend

# When the prologue writes an intermediate (swiglu, gelu_tanh, an unfolded rms_norm), the CPU graph
# runs the product in row chunks, so that what one chunk's prologue writes is still in the last-level
# cache when its product reads it, and the residual its epilogue adds goes into an output slice
# that is still cached too: one intermediate buffer, reused by every chunk, never travels to main
# memory. A chunk touches about CHUNK_BYTES (input, intermediate, residual, output); chunks stay
# large enough (MIN_CHUNK_ROWS) for the matrix product to run at full speed, and few enough
# (MAX_CHUNKS) to keep the graph small. Measured on the 2-core AMD EPYC (32 MiB L3) this was tuned
# on, 40 interleaved rounds at 4096 x 1024 x 1024 with a residual: swiglu 1.19x -> 1.07x and
# gelu_tanh 1.19x -> 1.12x a bare product (CPU time). The folded rms_norm writes no intermediate
# (its row scale joins the epilogue) and measured no better chunked (1.07x -> 1.10x): it runs whole.
CHUNK_BYTES = 20 << 20
MIN_CHUNK_ROWS = 256
MAX_CHUNKS = 16


def row_chunks(rows: int, x_features: int, in_features: int, out_features: int, element_size: int,
               device_type: str) -> int:
    """How many row chunks the compiled graph splits `rows` tokens into (1 = unchunked)."""
    if device_type != "cpu" or rows < 2 * MIN_CHUNK_ROWS:
        return 1
    row_bytes = element_size * (x_features + in_features + 2 * out_features)
    chunk_rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES // row_bytes)
    return max(1, min(MAX_CHUNKS, rows // MIN_CHUNK_ROWS, round(rows / chunk_rows)))


def _linear_rows(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 prologue_weight: torch.Tensor | None, residual2: torch.Tensor | None,
                 scale: torch.Tensor | None, prologue: Prologue | None, eps: float, fold_rms: bool,
                 out_dtype: torch.dtype, onednn: bool, widen: bool = False) -> torch.Tensor:
    """One chunk of rows: x2 (m, K) -> (m, N); with fold_rms the weight already holds the norm's weight."""
    row_scale = None
    h = x2
    if prologue is Prologue.RMS_NORM:
        if fold_rms:
            xf = x2.float()
            row_scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (m, 1)
        else:
            h = rms_norm(x2, prologue_weight, eps)
    elif prologue is Prologue.SWIGLU:
        gate, value = x2.chunk(2, dim=-1)
        h = F.silu(gate) * value  # (m, K), contiguous
    elif prologue is Prologue.GELU_TANH:
        h = F.gelu(x2, approximate="tanh")
    if widen:
        acc = h.float() @ weight.float().t()  # (m, N) float32 (see widened_on_cpu)
    else:
        acc = _onednn_linear(h, weight) if onednn else h @ weight.t()  # (m, N)
    if row_scale is None and residual2 is None and scale is None:
        return (acc if bias is None else acc + bias).to(out_dtype)
    y = acc.float()
    if row_scale is not None:
        y = y * row_scale
    if bias is not None:
        y = y + bias.float()
    if scale is not None:
        y = y * scale.float()
    if residual2 is not None:
        y = y + residual2.float()
    return y.to(out_dtype)


def _linear_graph(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  prologue_weight: torch.Tensor | None, residual2: torch.Tensor | None, scale: torch.Tensor | None,
                  prologue: Prologue | None, eps: float, fold_rms: bool, out_dtype: torch.dtype,
                  chunks: int = 1, onednn: bool = False, widen: bool = False) -> torch.Tensor:
    """What torch.compile fuses: x2 (M, K) -> (M, N); rearranged so the prologue costs one read of x.

    RMSNorm is linear per row: rms_norm(x) * g @ W.T == rsqrt(mean(x^2)) * (x @ (W * g).T). So the
    norm's weight is folded into the (small) weight matrix, inside the graph (the weight a call
    passes is the one used: nothing is cached across calls), and the per-row scale is applied in the
    epilogue, where it fuses with bias, residual scale and residual into one pass over the output.
    (Not for float16, whose range an un-normalised x @ W could overflow.)
    `chunks` > 1 runs the rows in that many chunks (see CHUNK_BYTES); inductor writes each chunk's
    result straight into its slice of one output and reuses one intermediate buffer for all chunks.
    """
    if prologue is Prologue.RMS_NORM and fold_rms and prologue_weight is not None:
        weight = (weight.float() * prologue_weight.float()).to(weight.dtype)  # (N, K), once for all chunks
    if chunks == 1:
        return _linear_rows(x2, weight, bias, prologue_weight, residual2, scale, prologue, eps, fold_rms, out_dtype,
                            onednn, widen)
    rows = x2.shape[0]
    row_scale_full = scale is not None and scale.dim() == 2  # a per-token gate, chunked with the rows
    outs = []
    for index in range(chunks):
        lo, hi = index * rows // chunks, (index + 1) * rows // chunks
        outs.append(_linear_rows(x2[lo:hi], weight, bias, prologue_weight,
                                 residual2[lo:hi] if residual2 is not None else None,
                                 scale[lo:hi] if row_scale_full else scale, prologue, eps, fold_rms, out_dtype,
                                 onednn, widen))
    return torch.cat(outs)


_linear_compiler = _compiled.ShapeClassCompiler(_linear_graph)


def _flatten_epilogue(tensor: torch.Tensor | None, out_shape: tuple[int, ...], rows: int) -> tuple[torch.Tensor | None, str]:
    """A residual/scale as (N,), () or (M, N) for the compiled graph, and its kind for the shape class."""
    if tensor is None:
        return None, "none"
    channels = out_shape[-1]
    if tensor.numel() == 1:
        return tensor.reshape(()), "scalar"
    if tensor.numel() == channels and tensor.shape[-1] == channels:
        return tensor.reshape(channels), "channel"
    return tensor.expand(out_shape).reshape(rows, channels), "full"


def flatten_residual_scale(residual_scale: torch.Tensor | float | None, out_shape: tuple[int, ...], rows: int,
                           device: torch.device) -> tuple[torch.Tensor | None, str]:
    """The residual scale as a compiled graph takes it, and its kind for the shape class."""
    if isinstance(residual_scale, torch.Tensor):
        return _flatten_epilogue(residual_scale, out_shape, rows)
    if residual_scale is not None:
        # A Python float would be baked into the graph, recompiling for every value.
        return torch.tensor(float(residual_scale), dtype=torch.float32, device=device), "scalar"
    return None, "none"


def _compiled_check(x, weight, bias=None, *, prologue=None, prologue_weight=None, eps=1e-6, residual=None,
                    residual_scale=None) -> str | None:
    scale = residual_scale if isinstance(residual_scale, torch.Tensor) else None
    tensors = [x, weight, bias, prologue_weight, residual, scale]
    if any(t is not None and t.device != x.device for t in tensors):
        return "inputs are on different devices"
    return _compiled.decline_reason(tensors)


def _compiled_worthwhile(x, weight, bias=None, **_options) -> str | None:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return _compiled.worthwhile(rows * weight.shape[0] * weight.shape[1])


def linear_compiled(x, weight, bias=None, *, prologue=None, prologue_weight=None, eps=1e-6, residual=None,
                    residual_scale=None):
    """The fused graph through torch.compile, compiled once per shape class."""
    prologue = Prologue.parse(prologue)
    out_features, in_features = weight.shape
    rows = x.numel() // x.shape[-1]
    out_shape = (*x.shape[:-1], out_features)
    x2 = x.reshape(rows, x.shape[-1])
    residual2, residual_kind = _flatten_epilogue(residual, out_shape, rows)
    scale, scale_kind = flatten_residual_scale(residual_scale, out_shape, rows, x.device)
    if residual_kind == "channel" or residual_kind == "scalar":
        residual2, residual_kind = residual.expand(out_shape).reshape(rows, out_features), "full"
    fold_rms = prologue is Prologue.RMS_NORM and x.dtype != torch.float16
    out_dtype = residual.dtype if residual is not None else x.dtype
    writes_intermediate = prologue in (Prologue.SWIGLU, Prologue.GELU_TANH) or (prologue is Prologue.RMS_NORM
                                                                                and not fold_rms)
    chunks = (row_chunks(rows, x.shape[-1], in_features, out_features, x.element_size(), x.device.type)
              if writes_intermediate else 1)
    onednn = onednn_capable(x2, weight)  # decided here, outside the graph: constants of the shape class
    widen = widened_on_cpu(x2, weight)
    key = (prologue, in_features, out_features, x.dtype, x.device.type, bias is not None,
           prologue_weight is not None, residual_kind, residual.dtype if residual is not None else None,
           scale_kind, float(eps), rows == 1, widen, chunks, onednn)
    # No size is marked dynamic: the first token count of a class compiles a static graph (every
    # loop bound a constant), which is what a denoising loop calling the same shape thousands of
    # times runs. A second, different count makes dynamo recompile the class once with the count
    # symbolic (automatic dynamic shapes), so varying prompt lengths cost one more compile, not one each.
    y = _linear_compiler.run(key, x2, weight, bias, prologue_weight, residual2, scale, prologue, float(eps),
                             fold_rms, out_dtype, chunks, onednn, widen)
    return y.reshape(out_shape)


# ----------------------------------------------------------------------------------------------
# registry

LINEAR = KernelRegistry("linear")
LINEAR.register("eager", linear_eager)
_onednn = LINEAR.register("onednn", linear_onednn, check=_onednn_check, available=_onednn_available,
                          worthwhile=_onednn_worthwhile, before="eager")
LINEAR.register("compiled", linear_compiled, check=_compiled_check, available=_compiled.available,
                worthwhile=_compiled_worthwhile, before="eager")
# The hand-written kernel first: on CUDA it fuses what the compiled graph leaves to inductor; on
# a machine without CUDA it is unavailable (or interpreter-only) and never chosen automatically.
LINEAR.register("triton", _triton_linear.linear_triton, check=_triton_linear.check,
                available=_triton_linear.available, worthwhile=_triton_linear.worthwhile, before="compiled")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           prologue: Prologue | str | None = None, prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
           residual: torch.Tensor | None = None, residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """`residual + residual_scale * (prologue(x) @ weight.T + bias)` (see module docstring).

    `weight` may be a kernels.quantized.QuantizedWeight: the call then goes to the quantized
    backends (kernels/quantized_linear.py), whose reference is dequantize-then-`linear_eager`.
    """
    key = None
    if type(weight) is torch.Tensor or type(weight) is torch.nn.Parameter:
        # A call shaped like one already checked and dispatched runs the backend chosen then (see
        # call_key); inside a compiled region the op is traced, never looked up.
        key = None if torch.compiler.is_compiling() else call_key(x, weight, bias, prologue, prologue_weight,
                                                                   residual, residual_scale)
        chosen = LINEAR.remembered(key) if key is not None else None
        if chosen is not None:
            return LINEAR.run_remembered(chosen, key, x, weight, bias, prologue=prologue,
                                         prologue_weight=prologue_weight, eps=eps, residual=residual,
                                         residual_scale=residual_scale)
    try:
        prologue = Prologue.parse(prologue)
    except ValueError as error:
        raise ValueError(f"linear: {error}") from None
    check_arguments(x, weight, bias, prologue, prologue_weight, residual, residual_scale)
    if isinstance(weight, QuantizedWeight):
        from kernels.quantized_linear import quantized_linear  # imports this module: resolved at first call
        return quantized_linear(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                                residual=residual, residual_scale=residual_scale)
    return LINEAR(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                  residual=residual, residual_scale=residual_scale, memo_key=key)


def _tensor_key(tensor: torch.Tensor | None):
    return None if tensor is None else (tensor.shape, tensor.dtype, tensor.device, tensor.requires_grad)


def call_key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: Prologue | str | None,
             prologue_weight: torch.Tensor | None, residual: torch.Tensor | None,
             residual_scale: torch.Tensor | float | None) -> tuple:
    """What `check_arguments` and every backend's check read of a call: shapes, dtypes, devices, grad state.

    Two calls with equal keys pass or fail the argument checks alike and get the same automatic
    backend, so `linear` checks and chooses once per key (the registry's memo). A prologue given as an
    unknown string gets a key too; it is refused when that key is first checked, and never remembered.
    """
    scale = (_tensor_key(residual_scale) if isinstance(residual_scale, torch.Tensor)
             else None if residual_scale is None else float)
    return (_tensor_key(x), _tensor_key(weight), _tensor_key(bias), prologue, _tensor_key(prologue_weight),
            _tensor_key(residual), scale, torch.is_grad_enabled())
