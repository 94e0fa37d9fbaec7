"""Model loaders: the diffusion model, the text encoder, the VAEs and adapters (LoRA, LoKr, LoHa).

Value types on the wires:
- MODEL: a `models.patcher.ModelHandle` around the H3 transformer (adapters stack on it without touching
  the shared base weights). A handle may carry `h3_shifts = (video, audio)` set by MiniMaxH3SigmaShift.
- CLIP: a `TextEncoder` (below): a ModelHandle around the H3 text encoder plus a cache of encoded prompts.
- VAE: a `VAE` (below): the H3 video VAE or the H3 audio VAE, told apart by the checkpoint's keys.

Loaded files live in one model cache per runtime (the process's shared services), keyed by the file's
path, size and modification time: a model file is read once, and the text encoder stays resident between
jobs, so a second job with a new seed reuses it and its cached prompt encodings.
"""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from execution.context import current
from execution.paths import UnsafePathError
from nodes.spec import Input, NodeSpec, Output

UNET_WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
# ComfyUI's CLIPLoader types, in its order; Weft loads only the H3 text encoder (type "minimax").
CLIP_TYPES = (
    "stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos", "lumina2",
    "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image", "flux2", "ovis", "longcat_image",
    "cogvideox", "lens", "pixeldit", "ideogram4", "boogu", "krea2", "joyimage", "mage", "minimax", "yue2",
)
SUPPORTED_CLIP_TYPES = ("minimax",)
CLIP_DEVICES = ("default", "cpu")
PROMPT_CACHE_SIZE = 64  # encoded prompts kept per text encoder
EMBEDDING_SUFFIXES = (".safetensors", ".sft")


# ---------------------------------------------------------------------- the model cache
class ModelCache:
    """Loaded objects by file identity (path, size, mtime), shared by every job of one runtime.

    A file rewritten in place gets a new identity; the stale entry for the same path is dropped then.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def identity(path: Path) -> tuple[str, int, int]:
        """(resolved path, size in bytes, mtime in ns) of a file."""
        stat = path.stat()
        return str(path.resolve()), stat.st_size, stat.st_mtime_ns

    def get(self, kind: str, path: Path, build: Callable[[], Any], *, variant: Any = None) -> Any:
        """The cached object of `kind` for `path` (and `variant`), built by `build()` when absent."""
        ident = self.identity(path)
        key = (kind, variant, *ident)
        with self._lock:
            if key in self._entries:
                return self._entries[key]
        value = build()  # outside the lock: loading may take long, and another file may load meanwhile
        with self._lock:
            for stale in [k for k in self._entries if k[0] == kind and k[1] == variant and k[2] == ident[0]]:
                del self._entries[stale]
            return self._entries.setdefault(key, value)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every loaded model."""
        with self._lock:
            self._entries.clear()


def model_cache() -> ModelCache:
    """The running job's model cache (one per runtime, so per process for the server and the CLI)."""
    return current().runtime.setdefault("model_cache", ModelCache())


# The model folders `python -m models.h3.make_tiny` fills (kept here: importing make_tiny imports torch models).
TINY_MODEL_FOLDERS = ("diffusion_models", "vae", "text_encoders")


def missing_model_hint(folder: str) -> str:
    """How to fill `models/<folder>` when it holds no model file at all ("" when it holds some)."""
    paths = current().paths
    if paths.list_models(folder):
        return ""
    hint = f"models/{folder} holds no model file: put real checkpoint files (.safetensors) in {paths.models / folder}"
    if folder in TINY_MODEL_FOLDERS:
        hint += (f", or write Weft's tiny random test models with "
                 f"`python -m models.h3.make_tiny --models-dir {paths.models}`")
    return hint


def _model_file(node: str, folder: str, name: str) -> Path:
    try:
        return current().paths.model_path(folder, name)
    except FileNotFoundError as exc:
        hint = missing_model_hint(folder)
        raise ValueError(f"{node}: {exc}" + (f"; {hint}" if hint else "")) from None


def _file_fingerprint(folder: str, input_name: str) -> Callable[..., Any]:
    # A file replaced under the same name loads again (ComfyUI keys loaders on the name alone).
    def fingerprint(**kwargs: Any) -> Any:
        name = kwargs.get(input_name)
        try:
            path = current().paths.model_path(folder, name)
        except (FileNotFoundError, ValueError, TypeError):
            return None
        return ModelCache.identity(path)
    return fingerprint


def _models_folder(folder: str) -> Callable[[], str]:
    return lambda: ", ".join(str(p) for p in current().paths.model_dirs(folder))


def _model_choice(name: str, folder: str, tooltip: str) -> Any:
    return Input.combo(name, lambda: current().paths.list_models(folder), tooltip=tooltip,
                       folder=_models_folder(folder), missing_hint=lambda: missing_model_hint(folder))


def _load(node: str, path: Path, expect: tuple[str, ...]):
    from models.loading import load_model

    try:
        return load_model(str(path), expect=expect)
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


# ---------------------------------------------------------------------- value types
class TextEncoder:
    """What travels on a CLIP wire: the H3 text encoder as a ModelHandle, with a cache of encoded prompts."""

    def __init__(self, handle: Any, name: str = "") -> None:
        self.handle = handle  # models.patcher.ModelHandle, component "text_encoder"
        self.name = name
        self._encoded: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def model(self):
        """The text encoder module."""
        return self.handle.model

    def with_adapter(self, adapter: Any, strength: float) -> "TextEncoder":
        """A new CLIP value with `adapter` stacked on the text encoder (the base stays shared)."""
        handle = self.handle.with_adapter(adapter, strength)
        return self if handle is self.handle else TextEncoder(handle, self.name)

    def encode(self, text: str, *, node: str = "CLIPTextEncode") -> list:
        """CONDITIONING for `text`: [[hidden (1, L, D) float32, {"attention_mask": (1, L) bool}]].

        Encodings are cached by prompt (and the identity of any embedding files it names), so an
        unchanged prompt is not encoded again. A new list and extras dict are returned each time, so
        callers may add keys without touching the cache.
        """
        if not isinstance(text, str):
            raise TypeError(f"{node}: text must be a string, got {type(text).__name__}")
        embeddings, idents = _prompt_embeddings(node, text)
        key = (text, idents)
        with self._lock:
            hit = self._encoded.get(key)
            if hit is not None:
                self._encoded.move_to_end(key)
        if hit is None:
            with self.handle.active():
                hidden, mask = self.handle.model.encode([text], embeddings=embeddings or None)
            hit = (hidden, mask)
            with self._lock:
                self._encoded[key] = hit
                while len(self._encoded) > PROMPT_CACHE_SIZE:
                    self._encoded.popitem(last=False)
        hidden, mask = hit
        return [[hidden, {"attention_mask": mask}]]

    def __repr__(self) -> str:
        return f"TextEncoder({self.name!r}, adapters={self.handle.adapters})"


def _prompt_embeddings(node: str, text: str) -> tuple[dict[str, torch.Tensor], tuple]:
    """The `embedding:name` tensors a prompt names, read from models/embeddings, and their file identities."""
    from models.h3.text_encoder import EMBEDDING_PATTERN

    names = sorted(set(EMBEDDING_PATTERN.findall(text)))
    if not names:
        return {}, ()
    from models.loading import load_state_dict

    found: dict[str, torch.Tensor] = {}
    idents = []
    paths = current().paths
    for name in names:
        path = None
        for candidate in (*(name + suffix for suffix in EMBEDDING_SUFFIXES), name):
            try:
                path = paths.model_path("embeddings", candidate)
                break
            except FileNotFoundError:
                continue
            except UnsafePathError as exc:
                raise ValueError(f"{node}: embedding name {name!r} is not a file name in the embeddings folder: "
                                 f"{exc}") from None
        if path is None:
            raise ValueError(f"{node}: the prompt names embedding {name!r}, but no {name}.safetensors is in "
                             f"{', '.join(str(p) for p in paths.model_dirs('embeddings'))}")
        tensors = load_state_dict(str(path))
        if len(tensors) != 1:
            raise ValueError(f"{node}: embedding file {path.name} holds {len(tensors)} tensors "
                             f"({', '.join(sorted(tensors)[:5])}); one (tokens, width) tensor is expected")
        found[name] = next(iter(tensors.values())).float()
        idents.append(ModelCache.identity(path))
    return found, tuple(idents)


class VAE:
    """What travels on a VAE wire: the H3 video VAE (`kind` "video") or audio VAE (`kind` "audio")."""

    def __init__(self, kind: str, model: torch.nn.Module, name: str = "") -> None:
        if kind not in ("video", "audio"):
            raise ValueError(f"VAE kind must be 'video' or 'audio', got {kind!r}")
        self.kind = kind
        self.model = model
        self.name = name

    @property
    def audio_sample_rate(self) -> int:
        """Waveform sample rate of an audio VAE (32000 Hz)."""
        return int(getattr(self.model, "sample_rate", 32000))

    def require(self, kind: str, node: str, input_name: str = "vae") -> "VAE":
        """This VAE when it is of `kind`, else a ValueError naming the node and the input."""
        if self.kind != kind:
            other = "VAEDecodeAudio / VAEEncodeAudio" if self.kind == "audio" else "VAEDecode / VAEEncode"
            raise ValueError(f"{node}: input '{input_name}' is an H3 {self.kind} VAE ({self.name}); this node "
                             f"needs the {kind} VAE (use {other} with this one)")
        return self

    def __repr__(self) -> str:
        return f"VAE({self.kind!r}, {self.name!r})"


def check_vae(node: str, vae: Any, kind: str, input_name: str = "vae") -> VAE:
    """Refuse anything that is not an H3 VAE of `kind`."""
    if not isinstance(vae, VAE):
        raise TypeError(f"{node}: input '{input_name}' must be a VAE from VAELoader, got {type(vae).__name__}")
    return vae.require(kind, node, input_name)


def check_clip(node: str, clip: Any) -> TextEncoder:
    """Refuse anything that is not a CLIP value from CLIPLoader."""
    if not isinstance(clip, TextEncoder):
        raise TypeError(f"{node}: input 'clip' must be a CLIP from CLIPLoader, got {type(clip).__name__}")
    return clip


def check_model(node: str, model: Any) -> Any:
    """Refuse anything that is not a MODEL (ModelHandle) from UNETLoader."""
    from models.patcher import ModelHandle

    if not isinstance(model, ModelHandle):
        raise TypeError(f"{node}: input 'model' must be a MODEL from UNETLoader, got {type(model).__name__}")
    return model


def with_options(handle: Any, **options: Any) -> Any:
    """A shallow copy of a ModelHandle with extra attributes (it shares the base and the patches)."""
    clone = copy.copy(handle)
    for key, value in options.items():
        setattr(clone, key, value)
    return clone


def _carry_options(old: Any, new: Any) -> Any:
    # A handle stacked with an adapter keeps the sampling shifts set on the one it came from.
    shifts = getattr(old, "h3_shifts", None)
    if new is not old and shifts is not None and getattr(new, "h3_shifts", None) != shifts:
        new = with_options(new, h3_shifts=shifts)
    return new


# ---------------------------------------------------------------------- node functions
def _unet_loader(unet_name: str, weight_dtype: str = "default") -> tuple[Any]:
    from models.patcher import ModelHandle

    if weight_dtype != "default":
        raise ValueError(f"UNETLoader: weight_dtype {weight_dtype!r} is not supported; Weft runs the H3 transformer "
                         "in the file's own dtype (float8 files are upcast to bfloat16): choose 'default'")
    path = _model_file("UNETLoader", "diffusion_models", unet_name)

    def build():
        loaded = _load("UNETLoader", path, ("h3_transformer",))
        return ModelHandle(loaded.model, name=unet_name)

    return (model_cache().get("unet", path, build),)


def _clip_loader(clip_name: str, type: str = "stable_diffusion", device: str = "default") -> tuple[TextEncoder]:
    from models.adapters.keys import TEXT_ENCODER
    from models.patcher import ModelHandle

    problem = _clip_type_problem(type)
    if problem:
        raise ValueError(problem)
    if device not in CLIP_DEVICES:
        raise ValueError(f"CLIPLoader: device {device!r} is not one of {', '.join(CLIP_DEVICES)}")
    if device == "cpu":
        _require_cpu_compute()
    path = _model_file("CLIPLoader", "text_encoders", clip_name)

    def build():
        loaded = _load("CLIPLoader", path, ("h3_text_encoder",))
        return TextEncoder(ModelHandle(loaded.model, name=clip_name, component=TEXT_ENCODER), clip_name)

    return (model_cache().get("clip", path, build),)


def _require_cpu_compute() -> None:
    # Placement is the memory manager's; a text encoder pinned to the CPU while models run elsewhere is not
    # supported yet, so say so instead of silently running it on the accelerator.
    from models import memory

    if memory.manager() is not None and memory.compute_device().type != "cpu":
        raise ValueError(f"CLIPLoader: device 'cpu' is not supported while models run on "
                         f"{memory.compute_device()}; choose 'default' (the memory manager places the text encoder)")


def _clip_type_problem(clip_type: Any) -> str | None:
    if clip_type in SUPPORTED_CLIP_TYPES:
        return None
    return (f"CLIPLoader: type {clip_type!r} cannot be loaded by Weft, which implements the MiniMax H3 text "
            f"encoder only; choose type 'minimax' with an H3 text encoder file")


def _clip_loader_validate(type: Any = None, **_other: Any) -> bool | str:
    if type is None:  # linked: checked when the node runs
        return True
    return _clip_type_problem(type) or True


def _vae_loader(vae_name: str) -> tuple[VAE]:
    path = _model_file("VAELoader", "vae", vae_name)

    def build():
        loaded = _load("VAELoader", path, ("h3_video_vae", "h3_audio_vae"))
        return VAE("video" if loaded.kind == "h3_video_vae" else "audio", loaded.model, vae_name)

    return (model_cache().get("vae", path, build),)


def _adapter(node: str, lora_name: str):
    from models.adapters import load_adapter

    path = _model_file(node, "loras", lora_name)

    def build():
        try:
            return load_adapter(path)
        except ValueError as exc:
            raise ValueError(f"{node}: {exc}") from None

    return model_cache().get("adapter", path, build)


def _stack(node: str, target: Any, adapter: Any, strength: float, what: str) -> Any:
    try:
        return target.with_adapter(adapter, float(strength))
    except ValueError as exc:
        raise ValueError(f"{node}: cannot apply {adapter.name} to the {what}: {exc}") from None


def _lora_loader_model_only(model: Any, lora_name: str, strength_model: float) -> tuple[Any]:
    model = check_model("LoraLoaderModelOnly", model)
    if strength_model == 0:
        return (model,)
    adapter = _adapter("LoraLoaderModelOnly", lora_name)
    return (_carry_options(model, _stack("LoraLoaderModelOnly", model, adapter, strength_model, "model")),)


def _lora_loader(model: Any, clip: Any, lora_name: str, strength_model: float,
                 strength_clip: float) -> tuple[Any, TextEncoder]:
    model = check_model("LoraLoader", model)
    clip = check_clip("LoraLoader", clip)
    if strength_model == 0 and strength_clip == 0:
        return model, clip
    adapter = _adapter("LoraLoader", lora_name)
    new_model = model
    if strength_model != 0:
        new_model = _carry_options(model, _stack("LoraLoader", model, adapter, strength_model, "model"))
    new_clip = clip if strength_clip == 0 else _stack("LoraLoader", clip, adapter, strength_clip, "text encoder")
    return new_model, new_clip


_LORA_NAME_TIP = "The name of the LoRA."
_STRENGTH = dict(min=-100.0, max=100.0, step=0.01)

NODES = [
    NodeSpec(
        node_id="UNETLoader", display_name="Load Diffusion Model", category="advanced/loaders",
        description="Loads a diffusion model (the H3 transformer) from models/diffusion_models.",
        execute=_unet_loader,
        inputs=[
            _model_choice("unet_name", "diffusion_models", "The diffusion model file."),
            Input.combo("weight_dtype", list(UNET_WEIGHT_DTYPES), "default",
                        tooltip="Weight storage dtype; Weft supports 'default' (the file's own dtype)."),
        ],
        outputs=[Output("MODEL")],
        fingerprint=_file_fingerprint("diffusion_models", "unet_name"),
        search_aliases=("load unet", "diffusion model", "load transformer"),
    ),
    NodeSpec(
        node_id="CLIPLoader", display_name="Load CLIP", category="advanced/loaders",
        description="Loads a text encoder from models/text_encoders. Weft implements the MiniMax H3 text encoder "
                    "(type 'minimax'); other types are refused.",
        execute=_clip_loader,
        inputs=[
            _model_choice("clip_name", "text_encoders", "The text encoder file."),
            Input.combo("type", list(CLIP_TYPES), "stable_diffusion",
                        tooltip="The model family of the text encoder; Weft loads 'minimax'."),
            Input.combo("device", list(CLIP_DEVICES), "default", optional=True,
                        tooltip="Where the text encoder runs: 'default' lets the memory manager decide; 'cpu' "
                                "is accepted when models run on the CPU."),
        ],
        outputs=[Output("CLIP")],
        fingerprint=_file_fingerprint("text_encoders", "clip_name"),
        validate_inputs=_clip_loader_validate,
        search_aliases=("text encoder", "load text encoder"),
    ),
    NodeSpec(
        node_id="VAELoader", display_name="Load VAE", category="loaders",
        description="Loads a VAE from models/vae: the H3 video VAE or the H3 audio VAE (told apart by its keys).",
        execute=_vae_loader,
        inputs=[_model_choice("vae_name", "vae", "The VAE file (video or audio).")],
        outputs=[Output("VAE")],
        fingerprint=_file_fingerprint("vae", "vae_name"),
    ),
    NodeSpec(
        node_id="LoraLoader", display_name="Load LoRA", category="loaders",
        description="Applies a LoRA (or LoKr / LoHa) to the diffusion model and the text encoder; the base "
                    "weights stay shared and unmodified.",
        execute=_lora_loader,
        inputs=[
            Input.link("model", "MODEL", tooltip="The diffusion model the LoRA will be applied to."),
            Input.link("clip", "CLIP", tooltip="The CLIP model the LoRA will be applied to."),
            _model_choice("lora_name", "loras", _LORA_NAME_TIP),
            Input.float("strength_model", 1.0, **_STRENGTH,
                        tooltip="How strongly to modify the diffusion model. This value can be negative."),
            Input.float("strength_clip", 1.0, **_STRENGTH,
                        tooltip="How strongly to modify the CLIP model. This value can be negative."),
        ],
        outputs=[Output("MODEL", tooltip="The modified diffusion model."),
                 Output("CLIP", tooltip="The modified CLIP model.")],
        fingerprint=_file_fingerprint("loras", "lora_name"),
    ),
    NodeSpec(
        node_id="LoraLoaderModelOnly", display_name="LoraLoaderModelOnly", category="loaders",
        description="Applies a LoRA (or LoKr / LoHa) to the diffusion model only.",
        execute=_lora_loader_model_only,
        inputs=[
            Input.link("model", "MODEL"),
            _model_choice("lora_name", "loras", _LORA_NAME_TIP),
            Input.float("strength_model", 1.0, **_STRENGTH),
        ],
        outputs=[Output("MODEL")],
        fingerprint=_file_fingerprint("loras", "lora_name"),
    ),
]
