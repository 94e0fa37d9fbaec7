"""The loaded parts a workflow wires together, and how each is read from its file.

- MODEL: a `models.patcher.ModelHandle` around the H3 transformer; adapters stack on it and leave the
  shared base weights untouched.
- CLIP: a `TextEncoder`, the H3 text encoder's handle plus the encodings of recent prompts.
- VAE: a `VAE`, the H3 video VAE or the H3 audio VAE (`kind`), told apart by the checkpoint's keys.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

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
    """The H3 text encoder in `path`; `embedding_path(name)` locates the files prompts name as `embedding:name`."""
    from models.adapters.keys import TEXT_ENCODER
    from models.patcher import ModelHandle

    loaded = _load(path, ("h3_text_encoder",))
    return TextEncoder(ModelHandle(loaded.model, name=name, component=TEXT_ENCODER), name,
                       embedding_path=embedding_path)


def load_vae(path: Path, name: str) -> "VAE":
    """The H3 video or audio VAE in `path`, whichever its keys show it to be."""
    loaded = _load(path, ("h3_video_vae", "h3_audio_vae"))
    return VAE("video" if loaded.kind == "h3_video_vae" else "audio", loaded.model, name, path=path,
               metadata=loaded.metadata)


def read_embedding(path: Path) -> torch.Tensor:
    """The one (tokens, width) tensor of a textual-inversion file, as float32."""
    from models.loading import load_state_dict

    tensors = load_state_dict(str(path))
    if len(tensors) != 1:
        raise ValueError(f"embedding file {path.name} holds {len(tensors)} tensors "
                         f"({', '.join(sorted(tensors)[:5])}); it should hold exactly one (tokens, width) tensor")
    return next(iter(tensors.values())).float()


class TextEncoder:
    """The value on a CLIP wire: the H3 text encoder's ModelHandle and the encodings of recent prompts.

    `embedding_path(name)` returns the file of the textual-inversion embedding a prompt calls
    `embedding:name`, or raises ValueError saying where it looked.
    """

    def __init__(self, handle: Any, name: str = "", *, embedding_path: Callable[[str], Path] | None = None) -> None:
        self.handle = handle  # models.patcher.ModelHandle of component "text_encoder"
        self.name = name
        self.embedding_path = embedding_path
        self._encoded: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def model(self):
        """The text encoder module."""
        return self.handle.model

    def with_adapter(self, adapter: Any, strength: float) -> "TextEncoder":
        """A CLIP value whose encoder carries `adapter` too; this one, and the base weights, stay as they are."""
        handle = self.handle.with_adapter(adapter, strength)
        if handle is self.handle:
            return self
        return TextEncoder(handle, self.name, embedding_path=self.embedding_path)

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

    def encode(self, text: str, *, node: str = "CLIPTextEncode") -> list:
        """CONDITIONING for `text`: [[hidden (1, L, D) float32, {"attention_mask": (1, L) bool}]].

        The result is remembered per (prompt, versions of the embedding files it names); each call
        returns a fresh outer list and dict, so a caller adding keys does not change what is remembered.
        """
        if not isinstance(text, str):
            raise TypeError(f"{node}: text must be a string, got {type(text).__name__}")
        try:
            embeddings, versions = self._embeddings(text)
        except ValueError as exc:
            raise ValueError(f"{node}: {exc}") from None
        key = (text, versions)
        with self._lock:
            remembered = self._encoded.get(key)
            if remembered is not None:
                self._encoded.move_to_end(key)
        if remembered is None:
            with self.handle.active():
                remembered = self.handle.model.encode([text], embeddings=embeddings or None)
            with self._lock:
                self._encoded[key] = remembered
                while len(self._encoded) > PROMPT_CACHE_SIZE:
                    self._encoded.popitem(last=False)
        hidden, mask = remembered
        return [[hidden, {"attention_mask": mask}]]

    def __repr__(self) -> str:
        return f"TextEncoder({self.name!r}, adapters={self.handle.adapters})"


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

    def __repr__(self) -> str:
        return f"VAE({self.kind!r}, {self.name!r})"
