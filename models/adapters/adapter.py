"""An adapter file parsed into entries, and its entries resolved into patches for a given module tree.

`load_adapter(path)` reads a safetensors file (nothing else is accepted), groups its tensors by
module, builds the LoRA / LoKr / LoHa / full-delta factors of each entry and checks that they join.
`Adapter.patches_for(model, component)` then maps each entry onto `model`'s modules and checks every
delta's shape against the weight it will be added to. Everything that cannot be applied exactly is
refused with a ValueError naming the file, the entry, the module and the shapes; a file whose
entries mostly name modules the model does not have is refused as a whole.

Full-model AdaLN entries on a pruned H3 DiT. The pruned (curve-form) DiT has no time embedder: each
AdaLN projection reads c(t), a row of `adaln_t_table` (8 wide, linear between 1025 rows), instead of
the full model's e(t) = silu(time_embedder(t)) (2688 wide). The pruning wrote e(t) ~ m + c(t) @ B with a
basis B (8, 2688) and a mean m (2688,), and folded them into each projection: W' = W @ B.T, b' = b + W @ m
(models/h3/transformer.py, `adapter_input_affines`). A delta dW (out, 2688) trained on the full
projection therefore acts on the pruned one as

    dW @ e(t) ~ dW @ (m + B.T @ c(t)) = (dW @ B.T) @ c(t) + dW @ m,

a weight delta dW @ B.T (out, 8) and a bias delta dW @ m (out,), both at the adapter's strength and
alpha / rank. For a LoRA (dW = s * up @ down) that is up @ (down @ B.T) and s * up @ (down @ m), so the
rank is kept; LoKr, LoHa and full diffs are rebuilt, then projected (base.py: ProjectedDelta,
ProjectedOffset). Entries whose input is already 8 wide (made for the pruned model) apply unchanged.
Exactness: the projected entry adds exactly dW applied to the pruned model's own stand-in for e(t), so
the pruned model with it equals the full model with the adapter wherever the pruned base equals the full
base (t on a table row and e(t) inside the basis' span; the tests build such a pair). Elsewhere the
difference is dW times the pruning's residual e(t) - m - B.T c(t): the same approximation the pruned base
already makes, carried into the adapter's change. Not projected, and refused by name: DoRA entries (their
norm is taken over the 2688-wide weight), entries on the time embedder (the pruned model has none), and
every wide entry when B and m are not found (the released int8 files lack them; loading.py says where it
looks). SGLang does the same (sgl-project/sglang PR 36075, after the pruned reference model's own
projection); the formula here is derived from Weft's model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from models.adapters.base import (DeltaSource, FullDelta, HeadBank, InputAffine, NoInputAffine, ProjectedDelta,
                                  ProjectedOffset, Replacement, WeightPatch, dora_axis, fits)
from models.adapters.keys import MODEL, ModuleIndex, Target, detect_format, interleaved_qkv_file, key_path, split_role
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
    bias: FullDelta | Replacement | None  # the bias delta (`diff_b`) or replacement (`set_bias`), if any
    dora_scale: torch.Tensor | None = None
    head_interleaved_qkv: bool = False  # a fused qkv delta whose rows are [head: q k v, ...] (DiffSynth-Studio)


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
        affines = input_affines(model)
        bank_layers = head_bank_layers(model)
        for entry, target in resolved:
            module = index.modules[target.module_name]
            found = len(problems)
            if target.module_name in bank_layers and _is_bank(entry, module):
                banks, problem = self._bank(entry, target, module)
                if problem:
                    problems.append(problem)
                    unfit_entries += 1
                else:
                    patches.extend(banks)
                continue
            sources = [("weight", entry.weight), ("bias", entry.bias)]
            affine = affines.get(target.module_name)
            if affine is not None and _wide_input(entry.weight, affine):
                projected, problem = self._projected(entry, target, module, affine)
                if problem:
                    problems.append(problem)
                    unfit_entries += 1
                    continue
                patches.extend(projected)
                sources = [("bias", entry.bias)]
            for param_name, source in sources:
                if source is None:
                    continue
                patch, problem = self._patch(entry, target, module, param_name, source, index)
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

    def _bank(self, entry: AdapterEntry, target: Target, module: nn.Module) -> tuple[list[WeightPatch], str | None]:
        """The head-bank patches of a `set_weight` holding several heads for an output layer, or why not."""
        out, width = (int(d) for d in module.weight.shape)
        rows, cols = entry.weight.delta_shape()
        heads = rows // out
        where = f"module {target.module_name!r}"
        if cols != width:
            return [], (f"entry {entry.key!r}: a bank of {heads} heads for {where} must read {width} values per row, "
                        f"found {cols}")
        declared = self.metadata.get("pdd_num_steps")
        if declared is not None and declared.strip().isdigit() and int(declared) != heads:
            return [], (f"entry {entry.key!r} holds {heads} heads for {where}, but the file's pdd_num_steps says "
                        f"{declared}")
        patches = [WeightPatch(source=HeadBank(entry.weight.value, heads), module_name=target.module_name,
                               param_name="weight", key=entry.key)]
        if entry.bias is not None:
            if not isinstance(entry.bias, Replacement) or entry.bias.delta_shape() != (heads * out,):
                return [], (f"entry {entry.key!r}: the bank's bias must be a set_bias of {heads * out} values, "
                            f"found {entry.bias.kind} {entry.bias.delta_shape()}")
            if getattr(module, "bias", None) is None:
                return [], f"entry {entry.key!r} sets a bias bank on {where}, which has no bias"
            patches.append(WeightPatch(source=HeadBank(entry.bias.value, heads), module_name=target.module_name,
                                       param_name="bias", key=entry.key))
        return patches, None

    def _projected(self, entry: AdapterEntry, target: Target, module: nn.Module,
                   affine: InputAffine | NoInputAffine) -> tuple[list[WeightPatch], str | None]:
        """The weight and bias patches of a wide-input entry moved onto `module`'s narrow input, or why not."""
        where = f"module {target.module_name!r}"
        wide = entry.weight.delta_shape()[1]
        if isinstance(affine, NoInputAffine):
            return [], (f"entry {entry.key!r} was trained for a {wide}-wide input, but {where} reads "
                        f"{affine.narrow} values (a pruned model): {affine.reason}")
        if entry.dora_scale is not None:
            return [], (f"entry {entry.key!r} is DoRA, whose magnitude normalises the {wide}-wide weight; it cannot "
                        f"be moved onto the {affine.narrow}-wide input of {where}")
        if target.part is not None or target.swap_halves:
            return [], f"entry {entry.key!r} names a row block of {where}, which a projected entry cannot"
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if not isinstance(bias, torch.Tensor):
            return [], (f"entry {entry.key!r}: moving it onto the {affine.narrow}-wide input of {where} adds a "
                        "constant, and that module has no bias to hold it")
        out = tuple(module.dense_weight_shape)[0] if getattr(module, "holds_quantized_weights", False) \
            else int(weight.shape[0])
        if entry.weight.delta_shape()[0] != out:
            return [], (f"entry {entry.key!r} ({entry.weight.kind}) does not fit {where}: expected {out} output rows, "
                        f"found {entry.weight.delta_shape()[0]}")
        return [WeightPatch(source=ProjectedDelta(entry.weight, affine), module_name=target.module_name,
                            param_name="weight", key=entry.key, projected=True),
                WeightPatch(source=ProjectedOffset(entry.weight, affine), module_name=target.module_name,
                            param_name="bias", key=entry.key, projected=True)], None

    def _patch(self, entry: AdapterEntry, target: Target, module: nn.Module, param_name: str,
               source: DeltaSource, index: ModuleIndex) -> tuple[WeightPatch | None, str | None]:
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
        row_order = None
        if entry.head_interleaved_qkv and param_name == "weight" and target.part is None:
            head_dim = getattr(index.modules.get(target.module_name.rpartition(".")[0]), "head_dim", None)
            if not head_dim or target_shape[0] % (3 * head_dim):
                return None, (f"entry {entry.key!r}: its fused qkv rows are stored head by head (DiffSynth-Studio's "
                              f"layout), but {where} has no head size Weft can read to reorder them")
            heads = target_shape[0] // (3 * head_dim)
            # Our row (part, head, d) is their row (head, part, d).
            row_order = torch.arange(target_shape[0]).view(heads, 3, head_dim).transpose(0, 1).reshape(-1)
        patch = WeightPatch(source=source, module_name=target.module_name, param_name=param_name, key=entry.key,
                            rows=rows, swap_halves=swap,
                            dora_scale=entry.dora_scale if axis else None, dora_axis=axis, row_order=row_order)
        return patch, None


def input_affines(model: nn.Module) -> dict[str, InputAffine | NoInputAffine]:
    """The layers of `model` whose input stands for a wider one (a pruned H3 DiT's AdaLN), by module name."""
    found = getattr(model, "adapter_input_affines", None)
    return found() if callable(found) else {}


def head_bank_layers(model: nn.Module) -> set[str]:
    """The layers of `model` that take a bank of heads chosen per sampler step (H3's output heads)."""
    found = getattr(model, "adapter_head_bank_layers", None)
    return set(found()) if callable(found) else set()


def _is_bank(entry: AdapterEntry, module: nn.Module) -> bool:
    """True when `entry` replaces `module`'s weight by a stack of several heads (rows a multiple of its rows)."""
    weight = getattr(module, "weight", None)
    if not isinstance(entry.weight, Replacement) or weight is None or weight.dim() != 2:
        return False
    shape = entry.weight.delta_shape()
    return len(shape) == 2 and shape[0] > weight.shape[0] and shape[0] % weight.shape[0] == 0


def _wide_input(weight: DeltaSource | None, affine: InputAffine | NoInputAffine) -> bool:
    """True when `weight` is a linear delta for the wider input `affine` stands for (not the layer's own)."""
    if weight is None:
        return False
    shape = weight.delta_shape()
    if len(shape) != 2 or shape[1] == affine.narrow:
        return False
    return affine.wide is None or shape[1] == affine.wide


def _build_entry(base: str, roles: dict[str, torch.Tensor], source: str,
                 file_alpha: torch.Tensor | None = None) -> AdapterEntry:
    """One entry from its tensors by role; ValueError naming the key when they are incomplete.

    `file_alpha` (the file's metadata `alpha`) stands in for an entry that stores no alpha of its own.
    """
    where = f"adapter {source}: entry {base!r}"
    if "alpha" not in roles and file_alpha is not None:
        roles = {**roles, "alpha": file_alpha}
    kinds = set()
    if {"up", "down", "mid"} & roles.keys():
        kinds.add("LoRA")
    if any(role.startswith("lokr_") for role in roles):
        kinds.add("LoKr")
    if any(role.startswith("hada_") for role in roles):
        kinds.add("LoHa")
    if "diff" in roles:
        kinds.add("full diff")
    if "set_weight" in roles:
        kinds.add("weight replacement")
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
    elif "weight replacement" in kinds:
        weight = Replacement(roles["set_weight"])
    problem = weight.check() if weight is not None else None
    if problem:
        raise ValueError(f"{where} ({weight.kind}): {problem}")
    if "diff_b" in roles and "set_bias" in roles:
        raise ValueError(f"{where} holds both a bias delta (diff_b) and a bias replacement (set_bias)")
    bias = FullDelta(roles["diff_b"]) if "diff_b" in roles else Replacement(roles["set_bias"]) if "set_bias" in roles \
        else None
    if weight is None and bias is None:
        raise ValueError(f"{where} holds only {', '.join(sorted(roles))}, no factors to apply")
    if "dora_scale" in roles and isinstance(weight, Replacement):
        raise ValueError(f"{where} has a DoRA magnitude on a weight replacement (set_weight)")
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
                         "diff_b, set_weight, set_bias, alpha, dora_scale")
    if not grouped:
        raise ValueError(f"adapter {source} holds no tensors")
    metadata = metadata or {}
    file_alpha = _file_alpha(metadata, source)
    entries = [_build_entry(base, roles, source, file_alpha) for base, roles in sorted(grouped.items())]
    if interleaved_qkv_file(list(tensors)):
        for entry in entries:
            entry.head_interleaved_qkv = entry.path.endswith(("attn.qkv_proj", "attn_qkv_proj"))
    return Adapter(source=source, format=detect_format(list(tensors)), entries=entries, metadata=metadata)


def _file_alpha(metadata: dict[str, str], source: str) -> torch.Tensor | None:
    """The network alpha a file records in its metadata (`alpha`), as an alpha tensor, or None.

    The scale rule: an entry's own `.alpha` tensor gives alpha / rank; else the file's metadata `alpha`
    (one alpha for every entry, as lightx2v's files record it) gives alpha / rank; else the scale is 1,
    that is, alpha is taken to equal the rank, as the common trainers and diffusers assume.
    """
    value = metadata.get("alpha")
    if value is None:
        return None
    try:
        return torch.tensor(float(value))
    except ValueError:
        raise ValueError(f"adapter {source}: its metadata records alpha as {value!r}, which is not a number; "
                         "fix or remove that entry") from None


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
