"""An adapter file parsed into entries, and its entries resolved into patches for a given module tree.

`load_adapter(path)` reads a safetensors file (nothing else is accepted), groups its tensors by
module, builds the LoRA / LoKr / LoHa / full-delta factors of each entry and checks that they join.
`Adapter.patches_for(model, component)` then maps each entry onto `model`'s modules and checks every
delta's shape against the weight it will be added to. Everything that cannot be applied exactly is
refused with a ValueError naming the file, the entry, the module and the shapes; a file whose
entries mostly name modules the model does not have is refused as a whole.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from models.adapters.base import DeltaSource, FullDelta, WeightPatch, dora_axis, fits
from models.adapters.keys import MODEL, ModuleIndex, Target, detect_format, key_path, split_role
from models.adapters.loha import LohaDelta
from models.adapters.lokr import LokrDelta
from models.adapters.lora import LoraDelta

# How many problems one refusal lists before summarising the rest.
_MAX_LISTED = 8


@dataclass
class AdapterEntry:
    """The tensors of one adapted module, as stored."""

    key: str  # key base as stored, e.g. "lora_unet_blocks_0_attn_qkv_proj"
    component: str  # keys.MODEL or keys.TEXT_ENCODER
    path: str  # module path within that component (dotted, or underscored when `underscored`)
    underscored: bool
    weight: DeltaSource | None  # the weight delta, if the entry changes the weight
    bias: FullDelta | None  # the bias delta (`diff_b`), if any
    dora_scale: torch.Tensor | None = None


@dataclass
class Adapter:
    """A parsed adapter file: entries plus the file name every refusal names."""

    source: str  # file path (or a label for tensors given directly)
    format: str  # kohya, lycoris, peft, diffusers, comfyui or full
    entries: list[AdapterEntry]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The file name without folders."""
        return os.path.basename(self.source)

    @property
    def components(self) -> set[str]:
        """The model parts the file has entries for ("model", "text_encoder")."""
        return {entry.component for entry in self.entries}

    def patches_for(self, model: nn.Module, component: str = MODEL) -> list[WeightPatch]:
        """Patches of this adapter's `component` entries on `model`; [] when it has none.

        Raises ValueError when most entries name modules `model` lacks ("for a different model"),
        when any entry names a missing module, or when a delta does not fit its weight.
        """
        entries = [entry for entry in self.entries if entry.component == component]
        if not entries:
            return []
        index = ModuleIndex(model)
        resolved: list[tuple[AdapterEntry, Target]] = []
        missing: list[AdapterEntry] = []
        for entry in entries:
            try:
                target = index.resolve(entry.path, entry.underscored)
            except ValueError as error:
                raise ValueError(f"adapter {self.source}: entry {entry.key!r}: {error}") from None
            if target is None:
                missing.append(entry)
            else:
                resolved.append((entry, target))
        if missing:
            listed = ", ".join(repr(e.key) for e in missing[:_MAX_LISTED])
            more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
            if 2 * len(missing) > len(entries):
                raise ValueError(
                    f"adapter {self.source}: this adapter is for a different model: {len(missing)} of its "
                    f"{len(entries)} {component} entries name modules this model does not have "
                    f"({listed}{more}); nothing was applied")
            raise ValueError(
                f"adapter {self.source}: {len(missing)} of its {len(entries)} {component} entries target "
                f"modules the model does not have ({listed}{more}); nothing was applied")
        patches: list[WeightPatch] = []
        problems: list[str] = []
        unfit_entries = 0
        for entry, target in resolved:
            module = index.modules[target.module_name]
            found = len(problems)
            for param_name, source in (("weight", entry.weight), ("bias", entry.bias)):
                if source is None:
                    continue
                patch, problem = self._patch(entry, target, module, param_name, source)
                if problem:
                    problems.append(problem)
                else:
                    patches.append(patch)
            unfit_entries += len(problems) > found
        if problems:
            more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
            # Same module names but mostly other shapes: another model of a family sharing the names.
            verdict = (f"this adapter is for a different model: {unfit_entries} of its {len(entries)} {component} "
                       "entries do not fit" if 2 * unfit_entries > len(entries) else "cannot be applied")
            raise ValueError(f"adapter {self.source}: {verdict}; nothing was applied:\n  "
                             + "\n  ".join(problems[:_MAX_LISTED]) + more)
        return patches

    def _patch(self, entry: AdapterEntry, target: Target, module: nn.Module, param_name: str,
               source: DeltaSource) -> tuple[WeightPatch | None, str | None]:
        """One patch, or the reason it cannot be made."""
        where = f"module {target.module_name!r}"
        param = getattr(module, param_name, None)
        if not isinstance(param, torch.Tensor):
            return None, f"entry {entry.key!r} changes the {param_name} of {where}, which has no {param_name}"
        delta_shape = source.delta_shape()
        # A quantized layer (models/ops.py) adds the delta to its dequantized weight at take time.
        quantized = getattr(module, "holds_quantized_weights", False) and param_name == "weight"
        if not quantized and (not param.is_floating_point() or hasattr(module, f"{param_name}_scale")):
            return None, (f"entry {entry.key!r}: {where} holds packed-quantised weights ({param.dtype}, stored "
                          f"shape {tuple(param.shape)}) without a quantization marker Weft reads; the adapter needs "
                          f"float weights of shape {delta_shape}")
        target_shape = tuple(module.dense_weight_shape) if quantized else tuple(param.shape)
        rows = None
        if target.part is not None:
            if param_name != "weight" or target_shape[0] % 3:
                return None, (f"entry {entry.key!r}: {where} {param_name} of shape {target_shape} cannot be split "
                              "into equal q, k, v row blocks")
            block = target_shape[0] // 3
            rows = (target.part * block, (target.part + 1) * block)
            target_shape = (block, *target_shape[1:])
            where = f"the {'qkv'[target.part]} row block (rows {rows[0]}:{rows[1]}) of {where}"
        if not fits(delta_shape, target_shape):
            return None, (f"entry {entry.key!r} ({source.kind}) does not fit {where}: expected a {param_name} "
                          f"delta of shape {target_shape}, found {delta_shape}")
        swap = target.swap_halves and param_name == "weight"
        if swap and target_shape[0] % 2:
            return None, (f"entry {entry.key!r}: {where} has an odd number of rows {target_shape[0]}, so its "
                          "[value; gate] halves cannot be exchanged")
        axis = None
        if entry.dora_scale is not None and param_name == "weight":
            axis = dora_axis(entry.dora_scale, target_shape)
            if axis is None:
                return None, (f"entry {entry.key!r}: DoRA magnitude of shape {tuple(entry.dora_scale.shape)} fits "
                              f"neither the rows nor the columns of {where} (shape {target_shape})")
        patch = WeightPatch(source=source, module_name=target.module_name, param_name=param_name, key=entry.key,
                            rows=rows, swap_halves=swap,
                            dora_scale=entry.dora_scale if axis else None, dora_axis=axis)
        return patch, None


def _build_entry(base: str, roles: dict[str, torch.Tensor], source: str) -> AdapterEntry:
    """One entry from its tensors by role; ValueError naming the key when they are incomplete."""
    where = f"adapter {source}: entry {base!r}"
    kinds = set()
    if {"up", "down", "mid"} & roles.keys():
        kinds.add("LoRA")
    if any(role.startswith("lokr_") for role in roles):
        kinds.add("LoKr")
    if any(role.startswith("hada_") for role in roles):
        kinds.add("LoHa")
    if "diff" in roles:
        kinds.add("full diff")
    if len(kinds) > 1:
        raise ValueError(f"{where} mixes {' and '.join(sorted(kinds))} tensors; cannot tell which to apply")
    alpha = roles.get("alpha")
    weight: DeltaSource | None = None
    if "LoRA" in kinds:
        if "up" not in roles or "down" not in roles:
            raise ValueError(f"{where} has a LoRA {'up' if 'up' in roles else 'down'} factor without its "
                             f"{'down' if 'up' in roles else 'up'} factor")
        weight = LoraDelta(up=roles["up"], down=roles["down"], mid=roles.get("mid"), alpha=alpha)
    elif "LoKr" in kinds:
        weight = LokrDelta(w1=roles.get("lokr_w1"), w1_a=roles.get("lokr_w1_a"), w1_b=roles.get("lokr_w1_b"),
                           w2=roles.get("lokr_w2"), w2_a=roles.get("lokr_w2_a"), w2_b=roles.get("lokr_w2_b"),
                           t2=roles.get("lokr_t2"), alpha=alpha)
    elif "LoHa" in kinds:
        needed = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
        absent = [role for role in needed if role not in roles]
        if absent:
            raise ValueError(f"{where} is a LoHa entry missing {', '.join(absent)}")
        weight = LohaDelta(w1_a=roles["hada_w1_a"], w1_b=roles["hada_w1_b"], w2_a=roles["hada_w2_a"],
                           w2_b=roles["hada_w2_b"], t1=roles.get("hada_t1"), t2=roles.get("hada_t2"), alpha=alpha)
    elif "full diff" in kinds:
        weight = FullDelta(roles["diff"])
    problem = weight.check() if weight is not None else None
    if problem:
        raise ValueError(f"{where} ({weight.kind}): {problem}")
    bias = FullDelta(roles["diff_b"]) if "diff_b" in roles else None
    if weight is None and bias is None:
        raise ValueError(f"{where} holds only {', '.join(sorted(roles))}, no factors to apply")
    if "dora_scale" in roles and weight is None:
        raise ValueError(f"{where} has a DoRA magnitude but no weight delta")
    path = key_path(base)
    return AdapterEntry(key=base, component=path.component, path=path.path, underscored=path.underscored,
                        weight=weight, bias=bias, dora_scale=roles.get("dora_scale"))


def adapter_from_tensors(tensors: dict[str, torch.Tensor], *, source: str = "<tensors>",
                         metadata: dict[str, str] | None = None) -> Adapter:
    """An Adapter from a key -> tensor mapping (what `load_adapter` reads from a file)."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, tensor in tensors.items():
        split = split_role(key)
        if split is None:
            unknown.append(key)
            continue
        base, role = split
        grouped.setdefault(base, {})[role] = tensor
    if unknown:
        listed = ", ".join(repr(k) for k in sorted(unknown)[:_MAX_LISTED])
        raise ValueError(f"adapter {source}: {len(unknown)} of its {len(tensors)} tensors are not LoRA, LoKr, "
                         f"LoHa or full-delta factors this loader knows ({listed}); supported: lora_up/lora_down/"
                         "lora_mid, lora_A/lora_B, lora.up/lora.down, lora_linear_layer, lokr_*, hada_*, diff, "
                         "diff_b, alpha, dora_scale")
    if not grouped:
        raise ValueError(f"adapter {source} holds no tensors")
    entries = [_build_entry(base, roles, source) for base, roles in sorted(grouped.items())]
    return Adapter(source=source, format=detect_format(list(tensors)), entries=entries, metadata=metadata or {})


def load_adapter(path: str | os.PathLike) -> Adapter:
    """Read an adapter (LoRA, LoKr, LoHa, full diff) from a .safetensors file; other formats are refused."""
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise ValueError(f"adapter {path}: only .safetensors adapter files are loaded (pickle-based .pt/.ckpt/.bin "
                         "files are never opened)")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"adapter {path}: not a readable safetensors file ({error})") from None
    return adapter_from_tensors(tensors, source=path, metadata=metadata)
