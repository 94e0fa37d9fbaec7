"""What every adapter kind shares: the delta interface, shape fitting, DoRA and full-delta patches.

A `DeltaSource` turns the factors stored in an adapter file into a full weight delta (already
multiplied by its own alpha / rank scale, never by the user's strength). A `WeightPatch` aims one
delta at one parameter of one module, possibly at a row block of it (fused QKV) or with its two
row halves exchanged (diffusers' SwiGLU order), and adds it into a float32 working copy of the
weight. The patcher applies patches on the fly at take time or merges them once; both go through
`WeightPatch.add_into`, so the two give identical weights.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


class DeltaSource(abc.ABC):
    """Factors of one adapter entry; `delta()` rebuilds its full weight delta (scale included)."""

    kind: str = "?"
    scale: float = 1.0
    replaces: bool = False  # the "delta" is a new value for the weight, not an addition to it
    per_step: bool = False  # chosen by the model at each sampler step, never added to a weight (HeadBank)

    @abc.abstractmethod
    def delta_shape(self) -> tuple[int, ...]:
        """Shape of the rebuilt delta, known from the factor shapes without computing it."""

    def check(self) -> str | None:
        """Why the stored factors cannot form a delta, or None when they join."""
        return None

    @abc.abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored factors by role."""

    @abc.abstractmethod
    def compute(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The delta from float32 `factors` (same roles as `tensors()`), times `scale`."""

    def add_scaled(self, region: torch.Tensor, alpha: float, swap_halves: bool) -> bool:
        """Add `alpha` times the delta into float32 `region` without building the delta, if this kind can.

        Returns False when it cannot (the caller then builds the delta with `delta()`). LoRA (one
        addmm) and linear LoKr (one broadcast multiply-add) can, which keeps on-the-fly application
        to a single pass over the weight.
        """
        return False

    def delta(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The full float32 delta on `device`, scaled by the adapter's own alpha / rank."""
        # Factors are moved per call rather than cached per device: they are small next to the
        # weight that is moving anyway, and a cache would pin a copy of a `diff` on the device.
        factors = {role: t.to(device=device, dtype=torch.float32) for role, t in self.tensors().items()}
        return self.compute(factors)

    # -- the low-rank side path: the delta's product with an activation, without the weight ------

    def side_product(self, h: torch.Tensor, alpha: float) -> torch.Tensor:
        """`alpha` times h @ delta.T for a Linear's input rows h (..., in): (..., out), in h's dtype.

        The delta is never added to a weight: a quantized layer keeps its own product and adds this
        beside it. This default builds the delta and multiplies by it, which is exact for every kind
        with a matrix delta; the low-rank kinds override it with products through their factors.
        """
        delta = self.compute(side_factors(self, h.device, h.dtype))
        return torch.nn.functional.linear(h, delta.reshape(delta.shape[0], -1)) * alpha

    def delta_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the delta (scale included): (*ids.shape, columns), in `dtype`, on ids' device.

        The side path of an embedding table: the looked-up rows of a quantized table get these added,
        so the table is never dequantized. This default builds the whole delta; the factored kinds
        override it with the rows of their factors alone.
        """
        delta = self.compute(side_factors(self, ids.device, dtype))
        return delta.reshape(delta.shape[0], -1)[ids]


@dataclass
class StoredValue(DeltaSource):
    """An entry stored as one whole tensor, `value`, used as it is (no factors, no alpha)."""

    value: torch.Tensor

    def delta_shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"value": self.value}

    def compute(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        return factors["value"]


@dataclass
class Replacement(StoredValue):
    """A stored replacement (`set_weight`, `set_bias`): the weight becomes this tensor, whatever the strength.

    As in ComfyUI, a replacement ignores the strength (any non-zero strength sets it) and lands where it
    stands in the patch order, so deltas stacked after it add to the new value.
    """

    kind: str = "set"
    scale: float = 1.0
    replaces: bool = True


@dataclass
class HeadBank(StoredValue):
    """A stack of `heads` replacements for one output layer (a PDD bank: models/h3/pdd.py); the model blends
    the heads a sampler step covers at each step, so it is never added into a weight or merged."""

    heads: int  # `value` is (heads * out, in) for a weight, (heads * out,) for a bias
    kind: str = "head bank"
    scale: float = 1.0
    per_step: bool = True


@dataclass
class FullDelta(DeltaSource):
    """A stored full delta (`diff` for a weight, `diff_b` for a bias): no factors, scale 1."""

    diff: torch.Tensor
    kind: str = "diff"
    scale: float = 1.0

    def delta_shape(self) -> tuple[int, ...]:
        return tuple(self.diff.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"diff": self.diff}

    def compute(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        return factors["diff"]

    def delta_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.diff.reshape(self.diff.shape[0], -1)[ids.to(self.diff.device)].to(ids.device, dtype)


class RankedDelta(DeltaSource):
    """A delta rebuilt from low-rank factors, with the file's optional alpha: its scale is alpha / rank.

    The scale is 1 when the file stores no alpha or the factors have no rank (a LoKr of two whole
    factors). Subclasses give `rank` and an `alpha` field.
    """

    alpha: torch.Tensor | None

    @property
    @abc.abstractmethod
    def rank(self) -> int | None:
        """The rank the alpha is divided by, or None when the factors have none."""

    @property
    def scale(self) -> float:  # type: ignore[override]
        alpha, rank = alpha_value(self.alpha), self.rank
        return 1.0 if alpha is None or rank is None else alpha / rank


def side_factors(source: DeltaSource, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`source`'s factors on `device` in `dtype`, for its side product.

    On the CPU they are converted per call (no copy at all when the file's dtype is the compute
    dtype), so the side path holds nothing beyond the adapter file. On an accelerator the converted
    factors are kept on the source, one set per (device, dtype): moving them every op would cost
    more than the low-rank products themselves. They are small (the file's size in the compute dtype).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return {role: t.to(dtype=dtype) for role, t in source.tensors().items()}
    placed = source.__dict__.setdefault("_placed_factors", {})
    key = (device, dtype)
    if key not in placed:
        placed[key] = {role: t.to(device=device, dtype=dtype) for role, t in source.tensors().items()}
    return placed[key]


def alpha_value(alpha: torch.Tensor | None) -> float | None:
    """A stored alpha tensor (shape () or (1,)) as a float, or None when the file has none."""
    if alpha is None:
        return None
    return float(alpha.reshape(-1)[0].item())


def fits(delta_shape: tuple[int, ...], target_shape: tuple[int, ...]) -> bool:
    """True when a delta of `delta_shape` can be added to a tensor of `target_shape`.

    Equal shapes fit; so does a linear delta (out, in) on a 1x1 convolution (out, in, 1, 1) and
    the reverse, since they hold the same numbers in the same order. Nothing else is reshaped:
    a delta whose shape merely has the right element count is refused, not guessed at.
    """
    if tuple(delta_shape) == tuple(target_shape):
        return True
    if len(delta_shape) < 2 or len(target_shape) < 2:
        return False
    if tuple(delta_shape[:2]) != tuple(target_shape[:2]):
        return False
    return all(d == 1 for d in delta_shape[2:]) and all(d == 1 for d in target_shape[2:])


def dora_axis(dora_scale: torch.Tensor, target_shape: tuple[int, ...]) -> str | None:
    """Which axis a DoRA magnitude normalises over: "out" (one per output row) or "in" (one per input column).

    PEFT stores the magnitude as (out,), kohya/LyCORIS as (1, in, 1...) by default or (out, 1, ...)
    with `wd_on_out`. Returns None when the shape fits neither, so the caller can refuse.
    """
    shape = tuple(dora_scale.shape)
    if len(shape) == 1:
        return "out" if shape[0] == target_shape[0] else None
    if len(target_shape) < 2 or len(shape) > len(target_shape) or not all(d == 1 for d in shape[2:]):
        return None
    if shape[0] == 1 and shape[1] == target_shape[1]:
        return "in"
    if shape[0] == target_shape[0] and shape[1] == 1:
        return "out"
    return None


def dora_apply(weight: torch.Tensor, delta: torch.Tensor, dora_scale: torch.Tensor, axis: str,
               strength: float) -> torch.Tensor:
    """DoRA: `weight + strength * (m * (W + dW) / ||W + dW|| - W)` with the norm along `axis`.

    The norm is taken of the patched weight W + dW (the DoRA definition, as PEFT and LyCORIS do),
    per output row for axis "out" and per input column for axis "in"; `delta` is the full-scale
    delta (alpha / rank applied, strength not), and strength interpolates between W and the
    DoRA weight, so strength 0 is the base and 1 the trained weight.
    """
    patched = weight + delta
    if axis == "out":
        norm = patched.reshape(patched.shape[0], -1).norm(dim=1)
        norm = norm.reshape(patched.shape[0], *[1] * (patched.dim() - 1))
    else:
        norm = patched.transpose(0, 1).reshape(patched.shape[1], -1).norm(dim=1)
        norm = norm.reshape(1, patched.shape[1], *[1] * (patched.dim() - 2))
    magnitude = dora_scale.reshape(norm.shape)
    # eps keeps an all-zero row (a pruned unit) from turning into NaN; float32 eps as DoRA tools use.
    decomposed = patched * (magnitude / (norm + torch.finfo(torch.float32).eps))
    return weight + strength * (decomposed - weight)


@dataclass
class WeightPatch:
    """One delta aimed at `module_name.param_name`, optionally at rows [start, stop) with halves swapped."""

    source: DeltaSource
    module_name: str
    param_name: str  # "weight" or "bias"
    key: str  # the adapter file's key base this came from (for messages)
    rows: tuple[int, int] | None = None  # row block of a fused parameter (q, k or v of qkv_proj)
    swap_halves: bool = False  # the adapter's rows are [value; gate], ours [gate; value]
    dora_scale: torch.Tensor | None = None
    dora_axis: str | None = None
    # True when the entry was mapped onto a module of another form than the one it was trained on (the
    # pruned DiT's AdaLN projection, InputAffine): counted as "projected" in what a loader reports bound.
    projected: bool = False
    row_order: torch.Tensor | None = None  # our row i is the delta's row row_order[i] (head-interleaved qkv)

    def add_into(self, weight: torch.Tensor, strength: float) -> None:
        """Add `strength` times this patch into the float32 tensor `weight`, in place."""
        region = weight if self.rows is None else weight[self.rows[0]:self.rows[1]]
        if self.source.replaces:
            value = self.source.delta(weight.device).reshape(region.shape)
            if self.row_order is not None:
                value = value[self.row_order.to(value.device)]
            if self.swap_halves:
                half = value.shape[0] // 2
                value = torch.cat((value[half:], value[:half]), dim=0)
            region.copy_(value)
            return
        if self.dora_scale is None and self.row_order is None and \
                self.source.add_scaled(region, strength, self.swap_halves):
            return
        delta = self.source.delta(weight.device)
        if delta.shape != region.shape:
            delta = delta.reshape(region.shape)  # only shapes `fits` accepted reach here
        if self.row_order is not None:
            delta = delta[self.row_order.to(delta.device)]
        if self.swap_halves:
            # The swap is its own inverse: bring the delta into our row order.
            half = delta.shape[0] // 2
            delta = torch.cat((delta[half:], delta[:half]), dim=0)
        if self.dora_scale is None:
            region.add_(delta, alpha=strength)
            return
        scale = self.dora_scale.to(device=weight.device, dtype=torch.float32)
        if self.row_order is not None and self.dora_axis == "out":
            scale = scale.reshape(-1)[self.row_order.to(scale.device)].reshape(scale.shape)
        if self.swap_halves and self.dora_axis == "out":
            half = scale.shape[0] // 2
            scale = torch.cat((scale[half:], scale[:half]), dim=0)
        region.copy_(dora_apply(region, delta, scale, self.dora_axis, strength))

    @property
    def runs_beside(self) -> bool:
        """Whether this patch can run on the side path: an additive matrix delta (DoRA rescales the weight
        itself, and a replacement such as `set_weight` is a new weight, not an addition)."""
        return self.param_name == "weight" and self.dora_scale is None and not self.source.replaces \
            and len(self.source.delta_shape()) >= 2 \
            and all(d == 1 for d in self.source.delta_shape()[2:])

    def add_side(self, out: torch.Tensor, h: torch.Tensor, strength: float) -> None:
        """Add `strength` times this patch's delta applied to `h` (..., in) into the Linear output `out` (..., out).

        The side-path twin of `add_into`: the rows of a fused parameter are the output's columns,
        and the [value; gate] swap exchanges the two halves of those columns.
        """
        side = self.source.side_product(h, strength)
        if self.swap_halves:
            half = side.shape[-1] // 2
            side = torch.cat((side[..., half:], side[..., :half]), dim=-1)
        if self.rows is None:
            out.add_(side)
        else:
            out[..., self.rows[0]:self.rows[1]].add_(side)

    @property
    def runs_beside_rows(self) -> bool:
        """Whether this patch can run beside a table lookup (an embedding's side path): an additive delta on the
        whole table, in the table's own row order."""
        return self.runs_beside and self.rows is None and not self.swap_halves and self.row_order is None

    def add_side_rows(self, out: torch.Tensor, ids: torch.Tensor, strength: float) -> None:
        """Add `strength` times rows `ids` of this patch's delta into the looked-up rows `out` (*ids.shape, dim)."""
        out.add_(self.source.delta_rows(ids, out.dtype), alpha=strength)

    def nbytes_factors(self) -> int:
        """Bytes of the stored factors (what on-the-fly application keeps besides the base)."""
        return sum(t.numel() * t.element_size() for t in self.source.tensors().values())


@dataclass(frozen=True)
class InputAffine:
    """A layer whose input is an affine image of a wider one: wide(x) = mean + x @ basis.

    basis (narrow, wide) and mean (wide,), float32. A delta trained for the wide input, dW (out, wide),
    acts on the narrow input as dW @ basis.T (out, narrow) plus the constant dW @ mean (out,), added to
    the bias: dW (mean + x @ basis) = (dW @ basis.T) x + dW @ mean. `source` names where the pair came from.
    """

    basis: torch.Tensor
    mean: torch.Tensor
    source: str

    @property
    def narrow(self) -> int:
        """The layer's own input width."""
        return int(self.basis.shape[0])

    @property
    def wide(self) -> int:
        """The input width of the layer the affine stands in for."""
        return int(self.basis.shape[1])


@dataclass(frozen=True)
class NoInputAffine:
    """A layer whose input stands for a wider one, without the affine that maps them (why it is absent)."""

    narrow: int
    wide: int | None  # the wider width, when known
    reason: str  # what the user can do to supply the affine


@dataclass
class ProjectedDelta(DeltaSource):
    """The weight part of a wide-input delta moved onto the narrow input: `inner` delta @ basis.T."""

    inner: DeltaSource
    affine: InputAffine
    kind: str = "projected"

    @property
    def scale(self) -> float:  # type: ignore[override]
        return self.inner.scale

    def delta_shape(self) -> tuple[int, ...]:
        return (self.inner.delta_shape()[0], self.affine.narrow)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.inner.tensors(), "_basis": self.affine.basis}

    def add_scaled(self, region: torch.Tensor, alpha: float, swap_halves: bool) -> bool:
        # A LoRA moves onto the narrow input through its down factor alone: up @ (down @ basis.T).
        from models.adapters.lora import LoraDelta

        inner = self.inner
        if not isinstance(inner, LoraDelta) or inner.mid is not None or swap_halves or region.dim() != 2:
            return False
        up = inner.up.to(device=region.device, dtype=torch.float32).reshape(inner.up.shape[0], -1)
        down = inner.down.to(device=region.device, dtype=torch.float32).reshape(inner.down.shape[0], -1)
        basis = self.affine.basis.to(device=region.device, dtype=torch.float32)
        region.addmm_(up, down @ basis.T, alpha=alpha * inner.scale)
        return True

    def compute(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        basis = factors.pop("_basis")
        wide = self.inner.compute(factors)
        return wide.reshape(wide.shape[0], -1) @ basis.T


@dataclass
class ProjectedOffset(DeltaSource):
    """The constant part of a wide-input delta, as a bias delta: `inner` delta @ mean."""

    inner: DeltaSource
    affine: InputAffine
    kind: str = "projected offset"

    @property
    def scale(self) -> float:  # type: ignore[override]
        return self.inner.scale

    def delta_shape(self) -> tuple[int, ...]:
        return (self.inner.delta_shape()[0],)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.inner.tensors(), "_mean": self.affine.mean}

    def compute(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        mean = factors.pop("_mean")
        from models.adapters.lora import LoraDelta

        if isinstance(self.inner, LoraDelta) and self.inner.mid is None:
            # up @ (down @ mean): never builds the (out, wide) delta.
            up = factors["up"].reshape(self.inner.up.shape[0], -1)
            down = factors["down"].reshape(self.inner.down.shape[0], -1)
            return (up @ (down @ mean)) * self.inner.scale
        wide = self.inner.compute(factors)
        return wide.reshape(wide.shape[0], -1) @ mean
