"""The unified Linear: `residual + residual_scale * (prologue(x) @ weight.T + bias)`.

One public function, `linear`, with several backends behind a capability check (kernels/registry.py):
  eager     the reference (`linear_eager`); always runs
  compiled  torch.compile of `_linear_graph`, once per shape class (token count dynamic); CPU and CUDA
  triton    a Triton kernel with prologue and epilogue fused into the matrix product (kernels/triton_linear.py);
            CUDA with the triton package only
  kitchen   comfy-kitchen's fused linear, only when `comfy_kitchen` is importable and capable

Prologues: `rms_norm` (x / rms(x) * prologue_weight, eps), `swiglu` (silu(first half of x) * second
half; x then has twice the weight's input features), `gelu_tanh`, or None. `residual_scale` is a
scalar, a per-channel vector `(N,)`, or any tensor broadcastable to the output (a per-sample gate).
The epilogue (bias, scale, residual) is computed in float32 and the result has the residual's dtype
(x's dtype without a residual), as a fused kernel accumulating in registers would.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import compiled as _compiled
from kernels.norms import rms_norm
from kernels.registry import KernelRegistry, disable_fused_kernels, fused_kernels_enabled  # noqa: F401 (re-exported)

PROLOGUES = (None, "rms_norm", "swiglu", "gelu_tanh")


def apply_prologue(x: torch.Tensor, prologue: str | None, prologue_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The prologue alone, as the eager reference computes it."""
    if prologue is None:
        return x
    if prologue == "rms_norm":
        return rms_norm(x, prologue_weight, eps)
    if prologue == "swiglu":
        gate, value = x.chunk(2, dim=-1)
        return F.silu(gate) * value
    if prologue == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown prologue {prologue!r}; expected one of {PROLOGUES}")


def linear_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 prologue: str | None = None, prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 residual: torch.Tensor | None = None,
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


def check_arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: str | None,
                    prologue_weight: torch.Tensor | None, residual: torch.Tensor | None,
                    residual_scale: torch.Tensor | float | None) -> None:
    """Raise ValueError naming the shapes when the arguments do not describe one linear op."""
    if prologue not in PROLOGUES:
        raise ValueError(f"linear: unknown prologue {prologue!r}; expected one of {PROLOGUES}")
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be (out_features, in_features), got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    x_features = 2 * in_features if prologue == "swiglu" else in_features
    if x.dim() < 1 or x.shape[-1] != x_features:
        raise ValueError(f"linear: x of shape {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         f"{' with the swiglu prologue (x needs 2 x in_features)' if prologue == 'swiglu' else ''}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"linear: bias must be ({out_features},), got shape {tuple(bias.shape)}")
    if prologue == "rms_norm" and prologue_weight is not None and tuple(prologue_weight.shape) != (in_features,):
        raise ValueError(f"linear: rms_norm prologue_weight must be ({in_features},), got {tuple(prologue_weight.shape)}")
    if prologue != "rms_norm" and prologue_weight is not None:
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
# compiled backend

def _linear_graph(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  prologue_weight: torch.Tensor | None, residual2: torch.Tensor | None, scale: torch.Tensor | None,
                  prologue: str | None, eps: float, fold_rms: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """What torch.compile fuses: x2 (M, K) -> (M, N); rearranged so the prologue costs one read of x.

    RMSNorm is linear per row: rms_norm(x) * g @ W.T == rsqrt(mean(x^2)) * (x @ (W * g).T). So the
    norm's weight is folded into the (small) weight matrix and the per-row scale is applied in the
    epilogue, where it fuses with bias, residual scale and residual into one pass over the output.
    (Not for float16, whose range an un-normalised x @ W could overflow.)
    """
    row_scale = None
    h = x2
    if prologue == "rms_norm":
        if fold_rms:
            xf = x2.float()
            row_scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (M, 1)
            if prologue_weight is not None:
                weight = (weight.float() * prologue_weight.float()).to(weight.dtype)
        else:
            h = rms_norm(x2, prologue_weight, eps)
    elif prologue == "swiglu":
        gate, value = x2.chunk(2, dim=-1)
        h = F.silu(gate) * value  # (M, K)
    elif prologue == "gelu_tanh":
        h = F.gelu(x2, approximate="tanh")
    acc = h @ weight.t()  # (M, N)
    if row_scale is None and residual2 is None and scale is None:
        return acc if bias is None else acc + bias
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
    out_features, in_features = weight.shape
    rows = x.numel() // x.shape[-1]
    out_shape = (*x.shape[:-1], out_features)
    x2 = x.reshape(rows, x.shape[-1])
    residual2, residual_kind = _flatten_epilogue(residual, out_shape, rows)
    if isinstance(residual_scale, torch.Tensor):
        scale, scale_kind = _flatten_epilogue(residual_scale, out_shape, rows)
    elif residual_scale is not None:
        # A Python float would be baked into the graph, recompiling for every value.
        scale, scale_kind = torch.tensor(float(residual_scale), dtype=torch.float32, device=x.device), "scalar"
    else:
        scale, scale_kind = None, "none"
    if residual_kind == "channel" or residual_kind == "scalar":
        residual2, residual_kind = residual.expand(out_shape).reshape(rows, out_features), "full"
    fold_rms = prologue == "rms_norm" and x.dtype != torch.float16
    out_dtype = residual.dtype if residual is not None else x.dtype
    key = (prologue, in_features, out_features, x.dtype, x.device.type, bias is not None,
           prologue_weight is not None, residual_kind, residual.dtype if residual is not None else None,
           scale_kind, float(eps), rows == 1)
    dynamic = [(x2, 0)]
    if residual2 is not None:
        dynamic.append((residual2, 0))
    if scale_kind == "full":
        dynamic.append((scale, 0))
    y = _linear_compiler.run(key, x2, weight, bias, prologue_weight, residual2, scale, prologue, float(eps),
                             fold_rms, out_dtype, dynamic=dynamic if rows > 1 else [])
    return y.reshape(out_shape)


# ----------------------------------------------------------------------------------------------
# registry

LINEAR = KernelRegistry("linear")
LINEAR.register("eager", linear_eager)
LINEAR.register("compiled", linear_compiled, check=_compiled_check, available=_compiled.available,
                worthwhile=_compiled_worthwhile, before="eager")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           prologue: str | None = None, prologue_weight: torch.Tensor | None = None, eps: float = 1e-6,
           residual: torch.Tensor | None = None, residual_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """`residual + residual_scale * (prologue(x) @ weight.T + bias)` (see module docstring)."""
    check_arguments(x, weight, bias, prologue, prologue_weight, residual, residual_scale)
    return LINEAR(x, weight, bias, prologue=prologue, prologue_weight=prologue_weight, eps=eps,
                  residual=residual, residual_scale=residual_scale)
