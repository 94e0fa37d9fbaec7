"""The loaded parts a workflow wires together, and how each is read from its file.

- MODEL: a `models.patcher.ModelHandle` around the H3 transformer; adapters stack on it and leave the
  shared base weights untouched.
- CLIP: a `TextEncoder`, the text encoder's handle plus the encodings of recent prompts. Two encoders
  load: the Qwen3-VL encoder the released H3 models are conditioned on (models/text/qwen3vl.py, its
  tokenizer read from the `qwen25_tokenizer/` folder beside the file; pictures and videos of a prompt
  reach it), and Weft's small text-only encoder (models/h3/text_encoder.py) that the tiny default
  models use. The file's keys say which one it is.
- VAE: a `VAE`, the H3 video VAE or the H3 audio VAE (`kind`), told apart by the checkpoint's keys.
- MODEL_PATCH: a `ModelPatch`, extra weights a node adds to the diffusion model (the H3 Fun ControlNet).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from models import memory, parallel
from models.cache import file_identity

PROMPT_CACHE_SIZE = 64  # prompt encodings a text encoder remembers, least recently used dropped first
AUDIO_VAE_SAMPLE_RATE_HZ = 32000
VAE_KINDS = ("video", "audio")


def _load(path: Path, expect: tuple[str, ...]):
    from models.loading import load_model

    return load_model(str(path), expect=expect)


def load_diffusion_model(path: Path, name: str) -> Any:
    """The H3 transformer in `path` as a ModelHandle named `name`."""
    from models.patcher import ModelHandle

    return ModelHandle(_load(path, ("h3_transformer",)).model, name=name)


def load_text_encoder(path: Path, name: str, *,
                      embedding_path: Callable[[str], Path] | None = None) -> "TextEncoder":
    """The text encoder in `path` (Qwen3-VL with its tokenizer, or Weft's small encoder); `embedding_path(name)`
    locates the files prompts name as `embedding:name` (small encoder only)."""
    from models.adapters.keys import TEXT_ENCODER
    from models.patcher import ModelHandle

    loaded = _load(path, ("h3_text_encoder", "qwen3vl"))
    tokenizer = None
    if loaded.kind == "qwen3vl":
        from models.text.qwen_tokenizer import load_tokenizer_beside
        try:
            tokenizer = load_tokenizer_beside(path)
        except FileNotFoundError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return TextEncoder(ModelHandle(loaded.model, name=name, component=TEXT_ENCODER), name,
                       embedding_path=embedding_path, tokenizer=tokenizer)


def load_vae(path: Path, name: str) -> "VAE":
    """The H3 video or audio VAE in `path`, whichever its keys show it to be."""
    loaded = _load(path, ("h3_video_vae", "h3_audio_vae"))
    return VAE("video" if loaded.kind == "h3_video_vae" else "audio", loaded.model, name, path=path,
               metadata=loaded.metadata)


class ModelPatch:
    """The value on a MODEL_PATCH wire: a loaded model patch (`net`, an H3 Fun ControlNet) and its file name."""

    def __init__(self, net: torch.nn.Module, name: str = "") -> None:
        self.net = net
        self.name = name

    def __repr__(self) -> str:
        return f"ModelPatch({self.name!r})"


def load_model_patch(path: Path, name: str) -> ModelPatch:
    """The model patch in `path` (an H3 Fun ControlNet-Union file)."""
    return ModelPatch(_load(path, ("h3_fun_control",)).model, name)


def read_embedding(path: Path) -> torch.Tensor:
    """The one (tokens, width) tensor of a textual-inversion file, as float32."""
    from models.loading import load_state_dict

    tensors = load_state_dict(str(path))
    if len(tensors) != 1:
        raise ValueError(f"embedding file {path.name} holds {len(tensors)} tensors "
                         f"({', '.join(sorted(tensors)[:5])}); it should hold exactly one (tokens, width) tensor")
    return next(iter(tensors.values())).float()


def _tensor_digest(tensor: torch.Tensor) -> tuple:
    """What tells one picture from another in a prompt-cache key: shape, dtype and a hash of the values."""
    data = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(data.view(torch.uint8).reshape(-1).numpy().tobytes()).hexdigest() if data.numel() else ""
    return tuple(data.shape), str(data.dtype), digest


def _reference_key(reference: Any) -> tuple:
    """A prompt-cache key part for one reference (models/text/qwen_prompt.py): its kind and its content."""
    from models.text.qwen_prompt import ImageReference, VideoReference
    if isinstance(reference, ImageReference):
        return "image", _tensor_digest(reference.image)
    if isinstance(reference, VideoReference):
        return "video", _tensor_digest(reference.frames), tuple(reference.timestamps_s)
    return (type(reference).__name__,)


class TextEncoder:
    """The value on a CLIP wire: the text encoder's ModelHandle and the encodings of recent prompts.

    With a `tokenizer` the model is Qwen3-VL, which also reads the pictures and videos of a prompt;
    without one it is Weft's small text-only encoder. `embedding_path(name)` returns the file of the
    textual-inversion embedding a prompt calls `embedding:name` (small encoder only), or raises
    ValueError saying where it looked.
    """

    def __init__(self, handle: Any, name: str = "", *, embedding_path: Callable[[str], Path] | None = None,
                 tokenizer: Any = None) -> None:
        self.handle = handle  # models.patcher.ModelHandle of component "text_encoder"
        self.name = name
        self.embedding_path = embedding_path
        self.tokenizer = tokenizer  # models.text.qwen_tokenizer.QwenTokenizer for Qwen3-VL, else None
        self._encoded: OrderedDict[tuple, tuple[torch.Tensor, dict]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def reads_pictures(self) -> bool:
        """True when the encoder sees the pictures and videos of a prompt (Qwen3-VL), not only its words."""
        return self.tokenizer is not None

    @property
    def model(self):
        """The text encoder module."""
        return self.handle.model

    def placed(self, device: torch.device | None) -> "TextEncoder":
        """This encoder running on `device` (None: where the loader put it); the weights are shared."""
        from models.patcher import PLACED_DEVICE

        handle = self.handle.with_options(**{PLACED_DEVICE: device})
        return TextEncoder(handle, self.name, embedding_path=self.embedding_path, tokenizer=self.tokenizer)

    def with_adapter(self, adapter: Any, strength: float, **how: Any) -> "TextEncoder":
        """A CLIP value whose encoder carries `adapter` too; this one, and the base weights, stay as they are.

        `how` is passed to ModelHandle.with_adapter (`mode=`).
        """
        handle = self.handle.with_adapter(adapter, strength, **how)
        if handle is self.handle:
            return self
        return TextEncoder(handle, self.name, embedding_path=self.embedding_path, tokenizer=self.tokenizer)

    def _embeddings(self, text: str) -> tuple[dict[str, torch.Tensor], tuple]:
        """The embeddings `text` names and the versions of their files."""
        from models.h3.text_encoder import EMBEDDING_PATTERN

        embeddings: dict[str, torch.Tensor] = {}
        versions = []
        for name in sorted(set(EMBEDDING_PATTERN.findall(text))):
            if self.embedding_path is None:
                raise ValueError(f"the prompt names embedding {name!r}, but this text encoder has no embeddings "
                                 "folder")
            path = self.embedding_path(name)
            embeddings[name] = read_embedding(path)
            versions.append(file_identity(path))
        return embeddings, tuple(versions)

    def encode(self, text: str, *, node: str = "CLIPTextEncode", references: tuple | list = ()) -> list:
        """CONDITIONING for `text`: [[hidden (1, L, D) float32, {"attention_mask": (1, L) bool, ...}]].

        references: the pictures, sounds and videos the prompt names, in the order of
        models/text/qwen_prompt.py (ImageReference, AudioReference, VideoReference). Qwen3-VL lays them
        out before the prompt and adds "token_tags" (1, L) (0 for a picture's or video's tokens, 1 for
        text); the small encoder reads the text alone. The result is remembered per (prompt,
        references, versions of the embedding files it names); each call returns a fresh outer list
        and dict, so a caller adding keys does not change what is remembered.
        """
        if not isinstance(text, str):
            raise TypeError(f"{node}: text must be a string, got {type(text).__name__}")
        references = tuple(references) if self.reads_pictures else ()
        try:
            embeddings, versions = self._embeddings(text) if not self.reads_pictures else ({}, ())
            key = (text, versions, tuple(_reference_key(r) for r in references))
        except ValueError as exc:
            raise ValueError(f"{node}: {exc}") from None
        with self._lock:
            remembered = self._encoded.get(key)
            if remembered is not None:
                self._encoded.move_to_end(key)
        if remembered is None:
            try:
                remembered = self._run(text, embeddings, references)
            except ValueError as exc:
                raise ValueError(f"{node}: {exc}") from None
            with self._lock:
                self._encoded[key] = remembered
                while len(self._encoded) > PROMPT_CACHE_SIZE:
                    self._encoded.popitem(last=False)
        hidden, extras = remembered
        return [[hidden, dict(extras)]]

    @parallel.on_root_in_group  # a rank group encodes prompts on rank 0
    def _run(self, text: str, embeddings: dict[str, torch.Tensor], references: tuple) -> tuple[torch.Tensor, dict]:
        """(hidden (1, L, D) float32, extras) of one prompt, computed by the model."""
        if not self.reads_pictures:
            with self.handle.active():
                hidden, mask = self.handle.model.encode([text], embeddings=embeddings or None)
            return hidden, {"attention_mask": mask}
        from models.h3.packing import TOKEN_TAGS_KEY
        from models.text.qwen_prompt import build_encoder_prompt

        prompt = build_encoder_prompt(self.tokenizer, text, references)
        with self.handle.active():
            encoded = self.handle.model.encode(prompt.input_ids, prompt.visual_items)
        hidden = encoded.hidden[None]
        return hidden, {"attention_mask": torch.ones(hidden.shape[:2], dtype=torch.bool),
                        TOKEN_TAGS_KEY: encoded.tags[None]}

    def __repr__(self) -> str:
        return f"TextEncoder({self.name!r}, adapters={self.handle.adapters})"


class PlacedModule:
    """A model whose encode and decode run on `device` (SelectVAEDevice); every other attribute is the model's."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        """The model's encode, on the chosen device."""
        with memory.placed_on(self.device):
            return self.module.encode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        """The model's decode, on the chosen device."""
        with memory.placed_on(self.device):
            return self.module.decode(*args, **kwargs)


# The methods of ComfyUI's VAE object that node packs call on a VAE wire's value themselves
# (`vae.encode(pixels)`). Weft's VAE is encoded and decoded by its nodes; asking for one of these names
# says so instead of a bare AttributeError (getattr with a default still gets the default).
COMFY_VAE_METHODS = frozenset({
    "encode", "decode", "encode_tiled", "decode_tiled", "decode_tiled_", "encode_tiled_", "decode_tiled_1d",
    "decode_tiled_3d", "encode_tiled_1d", "encode_tiled_3d", "vae_encode_crop_pixels", "get_sd",
    "memory_used_encode", "memory_used_decode", "spacial_compression_encode", "spacial_compression_decode",
    "temporal_compression_decode", "throw_exception_if_invalid",
})


class VAE:
    """The value on a VAE wire: the H3 video VAE (`kind` "video") or audio VAE (`kind` "audio")."""

    def __init__(self, kind: str, model: torch.nn.Module, name: str = "", *, path: Path | None = None,
                 metadata: dict[str, str] | None = None) -> None:
        if kind not in VAE_KINDS:
            raise ValueError(f"a VAE's kind is 'video' or 'audio', not {kind!r}")
        self.kind = kind
        self.model = model
        self.name = name
        self.path = path  # the file it came from (live previews cache their projection beside it)
        self.metadata = metadata or {}  # the file's safetensors metadata
        self.preview_projection = None  # fitted by nodes.previews on first need

    @property
    def audio_sample_rate(self) -> int:
        """The waveform rate an audio VAE reads and writes."""
        return int(getattr(self.model, "sample_rate", AUDIO_VAE_SAMPLE_RATE_HZ))

    def require(self, kind: str, node: str, input_name: str = "vae") -> "VAE":
        """This VAE if it is of `kind`; otherwise a ValueError naming the node, the input and the right nodes."""
        if self.kind != kind:
            fitting = "VAEDecodeAudio / VAEEncodeAudio" if self.kind == "audio" else "VAEDecode / VAEEncode"
            raise ValueError(f"{node}: input '{input_name}' is an H3 {self.kind} VAE ({self.name}), but this node "
                             f"works with the {kind} VAE; {fitting} are the nodes for this one")
        return self

    def placed(self, device: torch.device | None) -> "VAE":
        """This VAE running on `device` (None: where the loader put it); the weights are shared."""
        module = self.model.module if isinstance(self.model, PlacedModule) else self.model
        placed = VAE(self.kind, module if device is None else PlacedModule(module, device), self.name,
                     path=self.path, metadata=self.metadata)
        placed.preview_projection = self.preview_projection
        return placed

    def __getattr__(self, name: str) -> Any:
        # Called only for names the object lacks; reads nothing of its own unless the name is one of
        # ComfyUI's VAE methods (so copying and unpickling, which probe names, are unaffected).
        if name in COMFY_VAE_METHODS:
            shown = self.__dict__.get("name") or self.__dict__.get("kind", "")
            raise AttributeError(
                f"Weft's VAE ({shown}) has no {name}(): a custom node called ComfyUI's VAE object method "
                f"directly, which Weft does not provide; encode and decode with Weft's VAE Encode / VAE Decode "
                f"nodes (their outputs can feed the custom node) instead")
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"VAE({self.kind!r}, {self.name!r})"
