"""Adapter key names: which tensor role a key holds, which model part it targets, which module it means.

An adapter file's key is `<prefix><module path><role suffix>`:
  kohya      lora_unet_blocks_0_attn_qkv_proj.lora_down.weight   (underscores for dots; lora_te_ for
             the text encoder)
  PEFT       base_model.model.blocks.0.attn.qkv_proj.lora_A.weight  (or lora_A.default.weight)
  diffusers  transformer.transformer_blocks.0.attn.to_q.lora.up.weight  (or lora_linear_layer.up)
  LyCORIS    lycoris_blocks_0_attn_qkv_proj.lokr_w1  (hada_*, lokr_*, diff; kohya prefixes too)
  ComfyUI    diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight, or bare module paths
The diffusers names of the H3 transformer (transformer_blocks.N.attn.to_q, ff.net.0.proj, proj_in,
...) are matched as aliases generated from the model's own module names, so the same lookup serves
dotted and underscored keys, a wrapped model (`diffusion_model.blocks...`) and a bare one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

# Role suffixes, longest first so `.lora_B.default.weight` wins over shorter endings.
_ROLE_SUFFIXES: dict[str, str] = {
    ".lora_up.weight": "up", ".lora_down.weight": "down", ".lora_mid.weight": "mid",
    ".lora_B.weight": "up", ".lora_A.weight": "down",
    ".lora_B.default.weight": "up", ".lora_A.default.weight": "down",
    ".lora.up.weight": "up", ".lora.down.weight": "down",
    ".lora_linear_layer.up.weight": "up", ".lora_linear_layer.down.weight": "down",
    ".alpha": "alpha",
    ".dora_scale": "dora_scale",
    ".lora_magnitude_vector": "dora_scale", ".lora_magnitude_vector.weight": "dora_scale",
    ".lora_magnitude_vector.default": "dora_scale", ".lora_magnitude_vector.default.weight": "dora_scale",
    ".lokr_w1": "lokr_w1", ".lokr_w1_a": "lokr_w1_a", ".lokr_w1_b": "lokr_w1_b",
    ".lokr_w2": "lokr_w2", ".lokr_w2_a": "lokr_w2_a", ".lokr_w2_b": "lokr_w2_b", ".lokr_t2": "lokr_t2",
    ".hada_w1_a": "hada_w1_a", ".hada_w1_b": "hada_w1_b", ".hada_w2_a": "hada_w2_a",
    ".hada_w2_b": "hada_w2_b", ".hada_t1": "hada_t1", ".hada_t2": "hada_t2",
    ".diff": "diff", ".diff_b": "diff_b",
    # Weight replacements (FastH3 adapters, PDD head banks): the stored tensor takes the weight's place.
    ".set_weight": "set_weight", ".set_bias": "set_bias",
    # LyCORIS stores norm-layer changes as full deltas under these names.
    ".w_norm": "diff", ".b_norm": "diff_b",
}
_SUFFIXES_LONGEST_FIRST = sorted(_ROLE_SUFFIXES, key=len, reverse=True)

MODEL = "model"
TEXT_ENCODER = "text_encoder"

# Underscore-style prefixes (kohya, LyCORIS): the rest of the key has dots replaced by underscores.
_UNDERSCORE_PREFIXES: tuple[tuple[str, str], ...] = (
    ("lora_unet_", MODEL), ("lora_transformer_", MODEL), ("lycoris_", MODEL),
    ("lora_te1_", TEXT_ENCODER), ("lora_te2_", TEXT_ENCODER), ("lora_te3_", TEXT_ENCODER),
    ("lora_te_", TEXT_ENCODER),
)
# Dotted prefixes that say the key is for the text encoder (stripped); anything else targets the model.
# ComfyUI names the encoder after the prefix: `text_encoders.<name>.`.
_TEXT_ENCODER_PREFIX = re.compile(r"^(text_encoders\.[^.]+\.|text_encoder\.|te\.|cond_stage_model\.)")
# Wrapper names tools put in front of module paths. Stripped from both the adapter's paths and the
# model's module names, so `diffusion_model.blocks.0...` finds `blocks.0...` and the reverse.
_WRAPPERS = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "unet.",
             "model.", "text_model.")


@dataclass(frozen=True)
class KeyPath:
    """Where one adapter entry points: its model part and its module path as stored."""

    component: str  # MODEL or TEXT_ENCODER
    path: str  # module path, dotted, or with underscores when `underscored`
    underscored: bool


def split_role(key: str) -> tuple[str, str] | None:
    """`(base, role)` for an adapter tensor key, or None when the suffix is not one we know."""
    for suffix in _SUFFIXES_LONGEST_FIRST:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], _ROLE_SUFFIXES[suffix]
    return None


def key_path(base: str) -> KeyPath:
    """The component and module path an entry's key base names."""
    for prefix, component in _UNDERSCORE_PREFIXES:
        if base.startswith(prefix):
            return KeyPath(component, base[len(prefix):], True)
    match = _TEXT_ENCODER_PREFIX.match(base)
    if match and len(base) > match.end():
        return KeyPath(TEXT_ENCODER, base[match.end():], False)
    return KeyPath(MODEL, base, False)


def detect_format(keys: list[str]) -> str:
    """The community format a file's keys follow (kohya, lycoris, peft, diffusers, comfyui, full)."""
    roles = {split[1] for split in map(split_role, keys) if split is not None}
    if any(k.startswith("lycoris_") for k in keys) or any(r.startswith(("lokr_", "hada_")) for r in roles):
        return "lycoris"
    if any(k.startswith(("lora_unet_", "lora_te", "lora_transformer_")) for k in keys):
        return "kohya"
    if any(".lora.up." in k or ".lora_linear_layer." in k for k in keys):
        return "diffusers"
    if any(".lora_A." in k or ".lora_B." in k for k in keys):
        if any(k.startswith("transformer.") for k in keys):
            return "diffusers"  # diffusers saves PEFT-named factors under `transformer.`
        return "peft" if any(k.startswith("base_model.model.") or ".default." in k for k in keys) else "comfyui"
    if "up" in roles:
        return "comfyui"
    return "full"


# The original checkpoint's module names (bare, or under ComfyUI's / ai-toolkit's `diffusion_model.`).
_NATIVE_NAMES = ("diffusion_model.", "blocks.", "token_refiner.blocks.", "final_layer.")


def interleaved_qkv_file(keys: list[str]) -> bool:
    """True for a DiffSynth-Studio file: PEFT's `.default.` infix over the original checkpoint's module names.

    DiffSynth-Studio trains on the released checkpoint's fused qkv as the training code first lays it out,
    rows grouped head by head ([head 0: q k v, head 1: q k v, ...]); every other trainer reorders it to
    [all q; all k; all v] first, as Weft's model holds it. Shapes cannot tell the two apart; the `.default.`
    infix over these names is what marks DiffSynth's files (diffusers reads them the same way).
    """
    return any(".lora_A.default." in k or ".lora_B.default." in k for k in keys) and \
        any(k.startswith(_NATIVE_NAMES) for k in keys)


def _wrapper_variants(path: str, sep: str) -> list[str]:
    """`path` then `path` with leading wrapper names stripped one at a time (dotted or underscored)."""
    variants = [path]
    wrappers = [w if sep == "." else w.replace(".", "_") for w in _WRAPPERS]
    changed = True
    while changed:
        changed = False
        for wrapper in wrappers:
            if path.startswith(wrapper) and len(path) > len(wrapper):
                path = path[len(wrapper):]
                variants.append(path)
                changed = True
                break
    return variants


# Diffusers names of the H3 transformer, per module of ours: (their name, row third or None, swap).
# qkv_proj rows are [q | k | v], equal thirds; diffusers' SwiGLU projection stores [value; gate]
# where our mlp.fc1 stores [gate; value], so its deltas have their row halves exchanged.
_BLOCK_PREFIXES = ((re.compile(r"^blocks\.(\d+)\.(.+)$"), ("blocks.{}.", "transformer_blocks.{}.")),
                   (re.compile(r"^token_refiner\.blocks\.(\d+)\.(.+)$"),
                    ("token_refiner.blocks.{}.", "token_refiner.refiner_blocks.{}.")))
_BLOCK_INNER: dict[str, tuple[tuple[str, int | None, bool], ...]] = {
    "attn.qkv_proj": (("attn.to_q", 0, False), ("attn.to_k", 1, False), ("attn.to_v", 2, False)),
    "attn.out_proj": (("attn.to_out.0", None, False),),
    "attn.q_norm": (("attn.norm_q", None, False),),
    "attn.k_norm": (("attn.norm_k", None, False),),
    "mlp.fc1": (("ff.net.0.proj", None, True),),
    "mlp.fc2": (("ff.net.2", None, False),),
}
_TOP_LEVEL: dict[str, str] = {
    "video_patch_proj": "proj_in", "audio_patch_proj": "audio_proj_in", "condition_proj": "context_embedder",
    "final_layer.video_out": "proj_out", "final_layer.audio_out": "audio_proj_out",
    "final_layer.norm": "norm_out.norm", "final_layer.adaln_proj.linear": "norm_out.linear",
    "time_embedder.proj_in": "time_embedder.linear_1", "time_embedder.proj_out": "time_embedder.linear_2",
}


def _aliases(name: str) -> list[tuple[str, int | None, bool]]:
    """Other names an adapter may use for module `name` (already wrapper-stripped)."""
    found: list[tuple[str, int | None, bool]] = []
    if name in _TOP_LEVEL:
        found.append((_TOP_LEVEL[name], None, False))
    for pattern, prefixes in _BLOCK_PREFIXES:
        match = pattern.match(name)
        if not match:
            continue
        index, inner = match.groups()
        inner_names = [(inner, None, False), *_BLOCK_INNER.get(inner, ())]
        for prefix in prefixes:
            for inner_name, part, swap in inner_names:
                alias = prefix.format(index) + inner_name
                if alias != name:
                    found.append((alias, part, swap))
    return found


@dataclass(frozen=True)
class Target:
    """A module of the model an adapter path resolved to, with the row third it means, if any."""

    module_name: str  # the real dotted name in the model
    part: int | None = None  # 0, 1, 2: q, k or v third of a fused projection's rows
    swap_halves: bool = False


_AMBIGUOUS = Target("<ambiguous>")


class ModuleIndex:
    """Every name an adapter may use for a module of `model`: real, wrapper-stripped, aliases, underscored."""

    def __init__(self, model: nn.Module) -> None:
        self.modules: dict[str, nn.Module] = {name: m for name, m in model.named_modules() if name}
        # name -> (priority, Target); a lower priority number wins, equal priorities with different
        # targets make the name ambiguous (refused if an adapter uses it).
        self._names: dict[str, tuple[int, Target]] = {}
        for name in self.modules:
            variants = _wrapper_variants(name, ".")
            for rank, variant in enumerate(variants):
                self._add(variant, min(rank, 1), Target(name))
                for alias, part, swap in _aliases(variant):
                    self._add(alias, 2, Target(name, part, swap))
        underscored: dict[str, tuple[int, Target]] = {}
        for alias, (priority, target) in self._names.items():
            self._add(alias.replace(".", "_"), priority, target, into=underscored)
        self._underscored = underscored

    def _add(self, alias: str, priority: int, target: Target, into: dict | None = None) -> None:
        table = self._names if into is None else into
        held = table.get(alias)
        if held is None or priority < held[0]:
            table[alias] = (priority, target)
        elif priority == held[0] and held[1] != target:
            table[alias] = (priority, _AMBIGUOUS)

    def resolve(self, path: str, underscored: bool) -> Target | None:
        """The module an adapter path names, or None; raises ValueError when the name is ambiguous."""
        table = self._underscored if underscored else self._names
        for variant in _wrapper_variants(path, "_" if underscored else "."):
            held = table.get(variant)
            if held is None:
                continue
            if held[1] is _AMBIGUOUS:
                raise ValueError(f"adapter module path {path!r} matches more than one module of the model")
            return held[1]
        return None
