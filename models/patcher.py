"""Adapter patches applied at take time, so a patched model never mutates the cached base model.

Contract used by models/memory.py: `apply_patches(module, param_name, tensor)` returns the tensor
with the patches of the currently active patch set applied (or the tensor itself when none is).

A `ModelHandle` is what travels on a MODEL (or CLIP) wire: a base module plus the adapters stacked
on it. `handle.with_adapter(adapter, strength)` returns a new handle sharing the base weights; the
base is never written. A handle runs its patches either on the fly (`with handle.active():` around
the forward; every weight taken through the memory manager gets `base + deltas`) or merged
(`handle.merged()`: the patched modules become private copies holding `base + deltas`, everything
else is shared). Both add the same deltas in the same order in float32, so they agree. A handle's
first `merged_count` adapters are folded into the module it runs (0: it runs the base); adapters
stacked on a merged handle run on the fly on top of its merged copies, and merging such a handle
again rebuilds every merged weight from the base, so roundings never compound.

A patch map is `{id(module): {param_name: [(patch, strength), ...]}}`, where `patch` is a
`WeightPatch` (see models/adapters/base.py) or any callable `(shape, dtype, device) -> delta`.

The side path. A Linear's weight patch may instead run beside the layer's own product: the layer
computes y = W h + sum_i s_i * delta_i h, each delta through its factors (B(A h) for a LoRA, the
Kronecker or Hadamard forms for LoKr and LoHa; `WeightPatch.add_side`), so W is never rebuilt.
A handle sends a Linear weight's patches there (its side map, `{id(module): [(patch, strength),
...]}`, active beside the patch map) when every patch of that weight is an additive matrix delta
(no DoRA; on a table, one on the whole table) and
  - the layer is quantized (ops.QuantizedLinear), whatever the adapter's mode: its product stays
    the quantized one, where the take-time path dequantized W, added the deltas and ran a float
    product every op; or
  - the adapter was stacked in `AdapterMode.BYPASS` (the LoraLoaderBypass nodes), on any Linear.
A quantized embedding table (ops.QuantizedEmbedding) has a side path of its own: the looked-up rows,
dequantized alone, get the same rows of each delta through its factors (`WeightPatch.add_side_rows`:
up[ids] @ down for a LoRA), so a LoRA on a token table never dequantizes the table.
A float Linear's patches from the ordinary loaders stay take-time patches, the faster route there:
with a memory manager holding the patched copy resident they cost nothing per step after the
first (measured 0.96x the base step, against 1.14x for the side path and 1.15x for a patch rebuilt
at every take: bench/adapters.py's float section, rank 64, 512 tokens, CPU; docs/models.md). A strength is read when the product runs, so a handle with another strength
shares everything with this one and reloads nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

import torch
from torch import nn

from kernels.linear import widened_on_cpu
from models.adapters.adapter import Adapter
from models.adapters.base import WeightPatch
from models import step_cache
from models.adapters.keys import MODEL, TEXT_ENCODER

Patch = Union[WeightPatch, Callable[[torch.Size, torch.dtype, torch.device], torch.Tensor]]
PatchMap = dict[int, dict[str, list[tuple[Patch, float]]]]
SideMap = dict[int, list[tuple[WeightPatch, float]]]


class AdapterMode(enum.Enum):
    """Where an adapter's patches run on a float Linear (quantized Linears always use the side path)."""

    AUTO = "auto"      # take-time patches on float layers (LoraLoader, LoraLoaderModelOnly)
    BYPASS = "bypass"  # the side path on every Linear (LoraLoaderBypass, LoraLoaderBypassModelOnly)

# Option of a diffusion-model handle: the block hooks (models/h3/transformer.py's BlockHook) its forward runs.
BLOCK_HOOKS = "block_hooks"

# Option a handle sets while it runs: {id(module): {param name: HeadBank patch}}, the banks of heads a model chooses
# from per sampler step (models/h3/pdd.py); the last adapter stacked with a bank for a layer wins, as a set does.
HEAD_BANKS = "head_banks"
# Option of a diffusion-model handle: its step-skipping patch (models/step_cache.py's StepCacheSettings), at most one.
STEP_CACHE = "step_cache"

# Option of a handle: the torch.device its model runs on (SelectModelDevice, SelectCLIPDevice); absent: the default.
PLACED_DEVICE = "device"

# The patch set of the model handle whose forward is running.
_active: contextvars.ContextVar[PatchMap | None] = contextvars.ContextVar("weft_active_patches", default=None)
# The side-path patches of the model handle whose forward is running.
_active_side: contextvars.ContextVar[SideMap | None] = contextvars.ContextVar("weft_active_side", default=None)
# The options of the model handle whose forward is running (how it attends, for one).
_active_options: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("weft_active_options", default={})


def active_options() -> dict[str, Any]:
    """The options of the model handle whose forward is running (empty outside any handle's `active()`); read-only."""
    return _active_options.get()


@contextlib.contextmanager
def patches_active(patch_map: PatchMap) -> Iterator[None]:
    """Make `patch_map` the patches applied to weights taken during the block."""
    token = _active.set(patch_map)
    try:
        yield
    finally:
        _active.reset(token)


@contextlib.contextmanager
def side_active(side_map: SideMap) -> Iterator[None]:
    """Make `side_map` the side-path patches Linears add beside their product during the block."""
    token = _active_side.set(side_map)
    try:
        yield
    finally:
        _active_side.reset(token)


def side_entries(module: nn.Module) -> list[tuple[WeightPatch, float]]:
    """The active side-path patches of `module`'s weight, in application order ([] when none)."""
    side_map = _active_side.get()
    return side_map.get(id(module), []) if side_map else []


def side_residual(entries: list[tuple[WeightPatch, float]], h: torch.Tensor, out_features: int,
                  residual: torch.Tensor | None, residual_scale: torch.Tensor | float | None) -> torch.Tensor:
    """The residual that makes a Linear's epilogue add the side products: R + r * sum_i s_i * delta_i h.

    The unified Linear computes R + r * (W h + bias), which is linear in its residual, so the side
    products ride in it: `linear(h, W, bias, residual=side_residual(...), residual_scale=r)` is
    R + r * (W h + bias + side). `h` is what the weight multiplies (after the prologue).
    """
    with torch.no_grad():
        # A CPU without half-precision arithmetic emulates it several times slower than float32 (a rank-64
        # side path cost 1.20x the int8 step instead of 1.07x): there every kind's products, and their sum
        # over stacked adapters, run in float32 (the factors are converted per call on the CPU anyway).
        h_side = h.float() if widened_on_cpu(h, h) else h
        side = h_side.new_zeros(*h.shape[:-1], out_features)
        for patch, strength in entries:
            patch.add_side(side, h_side, strength)
        if residual_scale is not None:
            side = side * (residual_scale if isinstance(residual_scale, torch.Tensor) else float(residual_scale))
        if residual is None:
            return side.to(h.dtype)
        return (residual.float() + side.float()).to(residual.dtype)


def active_patch_map() -> PatchMap | None:
    """The active patch map (None outside any handle's `active()`); pass it as `patch_map=` from another thread."""
    return _active.get()


def _entries(module: nn.Module, param_name: str, patch_map: PatchMap | None) -> list[tuple[Patch, float]]:
    patch_map = _active.get() if patch_map is None else patch_map
    if not patch_map:
        return []
    return patch_map.get(id(module), {}).get(param_name, [])


def _patched(tensor: torch.Tensor, entries: list[tuple[Patch, float]], inplace: bool = False) -> torch.Tensor:
    """`tensor` plus every entry's strength * delta, summed in float32 and rounded once to its dtype."""
    with torch.no_grad():
        work = tensor.detach().to(torch.float32, copy=not (inplace and tensor.dtype == torch.float32))
        for patch, strength in entries:
            if isinstance(patch, WeightPatch):
                patch.add_into(work, strength)
            else:
                work += strength * patch(work.shape, torch.float32, work.device).to(torch.float32)
        return work.to(tensor.dtype)


def apply_patches(module: nn.Module, param_name: str, tensor: torch.Tensor, *,
                  patch_map: PatchMap | None = None, inplace: bool = False) -> torch.Tensor:
    """`tensor` plus strength * delta for every active patch of `module.param_name` (identity when none).

    `inplace=True` says the caller owns `tensor` (a fresh copy): a float32 one is then patched in
    place instead of copied once more. The base parameters are never passed that way.
    """
    entries = _entries(module, param_name, patch_map)
    return _patched(tensor, entries, inplace) if entries else tensor


def patch_signature(module: nn.Module, param_name: str, *, patch_map: PatchMap | None = None) -> tuple:
    """A hashable identity of the patches active for `module.param_name` (empty tuple when none).

    A cache of patched device copies can key on it: equal signatures give equal patched weights.
    """
    return tuple((id(patch), strength) for patch, strength in _entries(module, param_name, patch_map))


@dataclass(frozen=True)
class AppliedAdapter:
    """One adapter stacked on a handle, with its strength, its patches resolved on the base and its mode."""

    adapter: Adapter
    strength: float
    patches: tuple[WeightPatch, ...]
    mode: AdapterMode = AdapterMode.AUTO

    @property
    def projected(self) -> tuple[str, ...]:
        """Keys of the entries that were moved onto a narrower input to apply (a full-model AdaLN on a pruned DiT)."""
        return tuple(dict.fromkeys(patch.key for patch in self.patches if patch.projected))


# How a report names each component a file's entries are for.
COMPONENT_NAMES = {MODEL: "DiT", TEXT_ENCODER: "text encoder"}


@dataclass(frozen=True)
class Binding:
    """What one adapter file bound on one component: how many of its entries applied, and by which route.

    `entries` counts the file's entries for the component; `applied` those that became patches;
    `projected` the applied ones mapped onto a module of another form than they were trained on
    (WeightPatch.projected: the pruned DiT's AdaLN projection); `beside` the applied ones that run
    on the side path (the rest are added to the weight at take time, or to the dequantized weight).
    `not_loaded` says why a component's entries were not applied at all ("" when they were asked for).
    """

    adapter: str
    component: str
    entries: int
    applied: int = 0
    projected: int = 0
    beside: int = 0
    strength: float = 0.0
    not_loaded: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON values (what a job's profile notes)."""
        return {"adapter": self.adapter, "component": COMPONENT_NAMES.get(self.component, self.component),
                "entries": self.entries, "applied": self.applied, "projected": self.projected,
                "side_path": self.beside, "strength": self.strength, "not_loaded": self.not_loaded or None}

    def text(self) -> str:
        """One line a person reads: "DiT: 24 of 24 entries applied (0 projected), 24 on the side path"."""
        name = COMPONENT_NAMES.get(self.component, self.component)
        if not self.entries:
            return f"{name}: the file has no entries for it"
        if self.not_loaded:
            return f"{name}: {self.entries} entries not applied ({self.not_loaded})"
        return (f"{name}: {self.applied} of {self.entries} entries applied at {self.strength:g} "
                f"({self.projected} projected), {self.beside} on the side path")


@dataclass(frozen=True)
class MergeReport:
    """What merging a handle's adapters did: which adapters, how many weights it changed, the rounding it added.

    `weights` counts the parameters given the deltas (private copies); `errors` holds, per quantized
    weight requantized, max |stored - exact| / max |exact| (float weights take the deltas as a take-time
    patch would, so they add nothing); `head_banks` counts the per-step output-head banks (PDD), which
    are never merged; `extra_bytes` is what the private copies hold.
    """

    adapters: tuple[tuple[str, float], ...]  # (file name, strength), in application order
    weights: int
    errors: dict[str, float]
    head_banks: int
    extra_bytes: int

    @property
    def largest(self) -> tuple[str, float] | None:
        """(weight, error) of the largest requantization error, or None when nothing was requantized."""
        if not self.errors:
            return None
        name = max(self.errors, key=self.errors.get)
        return name, self.errors[name]

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON values (what a job's profile notes)."""
        largest = self.largest
        return {"adapters": [{"adapter": name, "strength": strength} for name, strength in self.adapters],
                "weights": self.weights, "requantized": len(self.errors), "head_banks": self.head_banks,
                "largest_error": largest[1] if largest else 0.0, "largest_error_weight": largest[0] if largest else None,
                "errors": dict(self.errors), "extra_bytes": self.extra_bytes}

    def text(self) -> str:
        """One line a person reads."""
        listed = ", ".join(f"{name} at {strength:g}" for name, strength in self.adapters)
        line = f"merged {len(self.adapters)} adapter{'s' if len(self.adapters) != 1 else ''} ({listed}) into " \
               f"{self.weights} weights"
        largest = self.largest
        if largest is None:
            line += ", none of them quantized (no rounding added)"
        else:
            line += (f", {len(self.errors)} of them requantized; largest error {largest[1]:.3%} of that weight's "
                     f"largest value ({largest[0]})")
        if self.head_banks:
            line += f"; {self.head_banks} output-head banks stay chosen per step"
        return line + f"; private copies {self.extra_bytes / 2**20:.1f} MiB"


class ModelHandle:
    """A base module plus stacked adapters; runs them on the fly (`active()`) or merged (`merged()`).

    Build one with `ModelHandle(model, name=..., component=..., options=...)`; `applied`, `base`,
    `merged_count` and `requantization_errors` are set by `with_adapter` and `merged`, not by callers. `options` (e.g. sampling shifts set by a
    node) travel unchanged to every handle derived from this one.
    """

    def __init__(self, model: nn.Module, *, name: str = "", component: str = MODEL,
                 options: dict[str, Any] | None = None, applied: tuple[AppliedAdapter, ...] = (),
                 base: nn.Module | None = None, merged_count: int = 0,
                 requantization_errors: dict[str, float] | None = None) -> None:
        self.model = model  # the module to run: the base, or a merged tree sharing the base
        self.base = model if base is None else base  # the shared, never-modified base module
        self.name = name
        self.component = component  # which adapter entries apply: "model" or "text_encoder"
        self.options: dict[str, Any] = dict(options or {})
        self.applied = applied
        # How many of `applied` (the first ones) `model` holds merged; the rest run on the fly on it.
        if not 0 <= merged_count <= len(applied) or (merged_count == 0) != (model is self.base):
            raise ValueError(f"a handle runs its base exactly when none of its adapters is merged; got "
                             f"{merged_count} of {len(applied)} merged")
        self.merged_count = merged_count
        self._patch_map, self._side_map = self._build_maps()
        self._merged: ModelHandle | None = None
        # What merging added per requantized weight (given by `merged()` to the handle it makes; merge_errors).
        self._requantization_errors = dict(requantization_errors or {})

    def _build_maps(self) -> tuple[PatchMap, SideMap]:
        """The take-time patch map and the side map of the adapters not merged, on the module that runs
        (the routing rule is in the module docstring)."""
        routed: dict[str, dict[str, list[tuple[WeightPatch, float, AdapterMode]]]] = {}
        for applied in self.applied[self.merged_count:]:
            for patch in applied.patches:
                routed.setdefault(patch.module_name, {}).setdefault(patch.param_name, []).append(
                    (patch, applied.strength, applied.mode))
        patch_map: PatchMap = {}
        side_map: SideMap = {}
        for module_name, params in routed.items():
            module = self.model.get_submodule(module_name)
            key = id(module)
            reads_rows = getattr(module, "side_path_reads_rows", False)  # a table lookup, not a product
            for param_name, entries in params.items():
                beside_ok = (param_name == "weight" and getattr(module, "runs_adapter_side_path", False)
                             and all(patch.runs_beside_rows if reads_rows else patch.runs_beside
                                     for patch, _s, _m in entries))
                quantized = getattr(module, "holds_quantized_weights", False)
                for patch, strength, mode in entries:
                    if beside_ok and (quantized or mode is AdapterMode.BYPASS):
                        side_map.setdefault(key, []).append((patch, strength))
                    else:
                        patch_map.setdefault(key, {}).setdefault(param_name, []).append((patch, strength))
        return patch_map, side_map

    @property
    def patch_map(self) -> PatchMap:
        """The take-time patches this handle activates around a forward (those of the adapters not merged)."""
        return self._patch_map

    @property
    def side_map(self) -> SideMap:
        """The side-path patches this handle activates around a forward (those of the adapters not merged)."""
        return self._side_map

    @property
    def adapters(self) -> list[tuple[str, float]]:
        """`(adapter file, strength)` per stacked adapter, in application order."""
        return [(applied.adapter.source, applied.strength) for applied in self.applied]

    def with_adapter(self, adapter: Adapter, strength: float, *,
                     mode: AdapterMode = AdapterMode.AUTO) -> "ModelHandle":
        """A new handle with `adapter` stacked at `strength` in `mode`, sharing this handle's base weights.

        Returns this handle itself when the strength is 0 or the adapter has no entries for this
        handle's component (a text-encoder-only file on the model). Raises ValueError when the
        adapter cannot be applied to the base (see Adapter.patches_for).
        """
        if strength == 0:
            return self
        patches = adapter.patches_for(self.base, self.component)
        if not patches:
            return self
        applied = AppliedAdapter(adapter, float(strength), tuple(patches), mode)
        return ModelHandle(self.model, name=self.name, component=self.component, options=self.options,
                           applied=(*self.applied, applied), base=self.base, merged_count=self.merged_count)

    def binding(self, adapter: Adapter, *, not_loaded: str = "") -> Binding:
        """What `adapter` bound on this handle's component (its latest stacking here; none applied when absent)."""
        entries = sum(1 for entry in adapter.entries if entry.component == self.component)
        stacked = next((a for a in reversed(self.applied) if a.adapter is adapter), None)
        if stacked is None or not_loaded:
            return Binding(adapter.name, self.component, entries, not_loaded=not_loaded)
        beside_ids = {id(patch) for entries_ in self._side_map.values() for patch, _s in entries_}
        keys: dict[str, list[WeightPatch]] = {}
        for patch in stacked.patches:
            keys.setdefault(patch.key, []).append(patch)
        projected = sum(1 for patches in keys.values() if any(p.projected for p in patches))
        beside = sum(1 for patches in keys.values() if any(id(p) in beside_ids for p in patches))
        return Binding(adapter.name, self.component, entries, len(keys), projected, beside, stacked.strength)

    def with_options(self, **options: Any) -> "ModelHandle":
        """A handle like this one (same base, adapters and merged copies) with `options` updated."""
        clone = ModelHandle(self.model, name=self.name, component=self.component,
                            options={**self.options, **options}, applied=self.applied, base=self.base,
                            merged_count=self.merged_count, requantization_errors=self._requantization_errors)
        if self._merged is not None:  # keep the merged copies already made, under the new options
            clone._merged = self._merged.with_options(**options)
        return clone

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        """Activate this handle's patches for weights taken inside the block; yields the module to run."""
        from models import memory  # memory imports this module

        banks = self._head_banks()
        token = _active_options.set({**self.options, HEAD_BANKS: banks} if banks else self.options)
        try:
            with patches_active(self._patch_map), side_active(self._side_map), \
                    memory.placed_on(self.options.get(PLACED_DEVICE)):
                yield self.model
        finally:
            _active_options.reset(token)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward with this handle's patches active (or, inside a sampler step an EasyCache
        patch skips, reuse the last computed change instead: models/step_cache.py)."""
        def forward() -> Any:
            with self.active():
                return self.model(*args, **kwargs)

        if len(args) >= 2 and step_cache.running() is not None:
            return step_cache.guarded_call(forward, args[0], args[1])
        return forward()

    def _head_banks(self) -> dict[int, dict[str, WeightPatch]]:
        """The per-step head banks of the stacked adapters, by id of the module that runs (the last one wins)."""
        found: dict[int, dict[str, WeightPatch]] = {}
        for applied in self.applied:
            for patch in applied.patches:
                if patch.source.per_step:
                    found.setdefault(id(self.model.get_submodule(patch.module_name)), {})[patch.param_name] = patch
        return found

    def _patched_params(self) -> dict[str, dict[str, list[tuple[Patch, float]]]]:
        """`{module name: {param name: entries}}` for every patched parameter, in application order."""
        found: dict[str, dict[str, list[tuple[Patch, float]]]] = {}
        for applied in self.applied:
            for patch in applied.patches:
                if patch.source.per_step:
                    continue  # chosen by the model at each step (HEAD_BANKS), never added to the weight
                found.setdefault(patch.module_name, {}).setdefault(patch.param_name, []).append(
                    (patch, applied.strength))
        return found

    def patched_weight(self, module_name: str, param_name: str = "weight") -> torch.Tensor:
        """The float32 parameter `module_name.param_name` of the base with every stacked patch added.

        Whatever route the patches take when the model runs, this is the weight they stand for (a
        quantized layer's weight dequantized first): the reference the side path and a merge are held to.
        """
        module = self.base.get_submodule(module_name)
        if param_name == "weight" and getattr(module, "holds_quantized_weights", False):
            tensor = module.dequantized_weight(torch.float32)
        else:
            tensor = getattr(module, param_name).detach().to(torch.float32)
        return _patched(tensor, self._patched_params().get(module_name, {}).get(param_name, []))

    def merge_bytes(self) -> int:
        """Extra bytes a merged copy needs: one copy of each patched parameter in its stored dtype."""
        total = 0
        for module_name, params in self._patched_params().items():
            module = self.base.get_submodule(module_name)
            for param_name in params:
                param = getattr(module, param_name)
                total += param.numel() * param.element_size()
        return total

    def merged(self) -> "ModelHandle":
        """A handle whose patched modules are private copies holding base + the deltas of every stacked
        adapter (computed once, from the base even when some adapters were merged before)."""
        if self.merged_count == len(self.applied):
            return self
        if self._merged is None:
            errors: dict[str, float] = {}
            tree = _copy_with_merged(self.base, self._patched_params(), errors)
            self._merged = ModelHandle(tree, name=self.name, component=self.component, options=self.options,
                                       applied=self.applied, base=self.base, merged_count=len(self.applied),
                                       requantization_errors=errors)
        return self._merged

    def merge_errors(self) -> dict[str, float]:
        """What merging adds, per quantized weight it requantizes: max |merged - exact| / max |exact|.

        `exact` is the weight the patches stand for (`patched_weight`), so this is the rounding of the
        one requantization (see QuantizedLinear.requantized for its bound); float weights merge exactly.
        """
        return dict(self.merged()._requantization_errors)

    def merge_report(self) -> MergeReport:
        """What `merged()` does for this handle (merging it when not done yet)."""
        merged = self.merged()
        banks = sum(1 for applied in self.applied for patch in applied.patches if patch.source.per_step)
        return MergeReport(adapters=tuple((applied.adapter.name, applied.strength) for applied in self.applied),
                           weights=sum(len(params) for params in self._patched_params().values()),
                           errors=dict(merged._requantization_errors), head_banks=banks,
                           extra_bytes=self.merge_bytes())

    def prepared(self, max_merge_bytes: int | None = None) -> "ModelHandle":
        """The merged handle when its extra bytes fit `max_merge_bytes` (None: always), else this one."""
        if max_merge_bytes is not None and self.merge_bytes() > max_merge_bytes:
            return self
        return self.merged()

    def preview_summary(self) -> str:
        """A few lines saying what this handle is (what PreviewAny shows for a MODEL or CLIP wire)."""
        parameters: dict[str, int] = {}
        for tensor in [*self.base.parameters(), *self.base.buffers()]:
            parameters[str(tensor.dtype).removeprefix("torch.")] = parameters.get(
                str(tensor.dtype).removeprefix("torch."), 0) + tensor.numel()
        stored = ", ".join(f"{count:,} {dtype}" for dtype, count in sorted(parameters.items(), key=lambda kv: -kv[1]))
        lines = [f"{self.component.upper()} {self.name or '(unnamed)'}: {type(self.base).__name__}",
                 f"values: {stored or 'none'}",
                 f"adapters: {', '.join(f'{source} at {strength:g}' for source, strength in self.adapters) or 'none'}"]
        if self.options:
            lines.append(f"options: {', '.join(sorted(self.options))}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        mode = f"{self.merged_count} merged" if self.merged_count else "on the fly"
        return f"ModelHandle({self.name or type(self.base).__name__!r}, adapters={self.adapters}, {mode})"


def _copy_with_merged(base: nn.Module, patched: dict[str, dict[str, list[tuple[Patch, float]]]],
                      errors: dict[str, float]) -> nn.Module:
    """A new module tree sharing `base`'s untouched modules; patched modules and their ancestors are copies.

    `errors` receives, per quantized weight requantized, max |stored - exact| / max |exact| (merge_errors).
    """
    copies: dict[str, nn.Module] = {}

    def private(name: str) -> nn.Module:
        # Shallow copies whose child/parameter/buffer tables are new dicts, so replacing an entry in
        # the copy never touches the base; unpatched children stay the base's own objects.
        if name in copies:
            return copies[name]
        original = base.get_submodule(name) if name else base
        clone = copy.copy(original)
        clone._modules = original._modules.copy()
        clone._parameters = original._parameters.copy()
        clone._buffers = original._buffers.copy()
        copies[name] = clone
        if name:
            parent_name, _, child = name.rpartition(".")
            private(parent_name)._modules[child] = clone
        return clone

    root = private("")
    # Normal tensors even when called under inference_mode: the merged handle is cached and may be
    # run later outside it, where inference tensors cannot meet autograd-tracked ones.
    with torch.inference_mode(False):
        _merge_into(base, patched, private, errors)
    return root


def _merge_into(base: nn.Module, patched: dict[str, dict[str, list[tuple[Patch, float]]]],
                private: Callable[[str], nn.Module], errors: dict[str, float]) -> None:
    for module_name, params in patched.items():
        clone = private(module_name)
        module = base.get_submodule(module_name)
        for param_name, entries in params.items():
            if param_name == "weight" and getattr(module, "holds_quantized_weights", False):
                # Quantized layers are merged by requantizing base + deltas once in their own format
                # (the error this adds is stated on QuantizedLinear.requantized).
                exact = _patched(module.dequantized_weight(torch.float32), entries)
                for name, tensor in module.requantized(exact).items():
                    if name == "weight":
                        clone._parameters[name] = nn.Parameter(tensor, requires_grad=False)
                    else:
                        clone._buffers[name] = tensor
                stored = clone.dequantized_weight(torch.float32)
                errors[module_name] = float((stored - exact).abs().max() / exact.abs().max().clamp(min=1e-30))
                continue
            original = getattr(module, param_name)
            clone._parameters[param_name] = nn.Parameter(_patched(original, entries), requires_grad=False)
