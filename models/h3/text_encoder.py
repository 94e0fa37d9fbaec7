"""A small causal transformer text encoder with its own byte-level tokenizer, standing where H3 uses Qwen3-VL.

The conditioning is the hidden state after a chosen layer (the released model reads Qwen3-VL's layer 50
of a 5120-wide model; the defaults mirror those widths). The tokenizer needs no vocabulary file: ids
0-2 are PAD, BOS and EOS, and byte b of the UTF-8 text is id b + 3, so tokenisation is deterministic
and lossless. Prompts may name precomputed embeddings as `embedding:name`; their rows (in the input
embedding space) replace the name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from kernels.prologues import Prologue
from models import ops
from models.ops import input_dtype
from models.h3.layers import attention, compute_device, rope_split_half

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
EMBEDDING_PATTERN = re.compile(r"embedding:([A-Za-z0-9_.\-]+)")


@dataclass
class TextEncoderConfig:
    """Shape of the text encoder. Defaults mirror the widths H3 reads from Qwen3-VL."""
    vocab_size: int = 256 + BYTE_OFFSET   # bytes plus PAD, BOS, EOS
    hidden_size: int = 5120               # width of the conditioning
    num_layers: int = 50                  # layers kept; the conditioning is the last one's output
    num_heads: int = 40
    head_dim: int = 128
    ffn_size: int = 25600                 # SwiGLU width
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6


TINY_CONFIG = TextEncoderConfig(hidden_size=48, num_layers=2, num_heads=2, head_dim=24, ffn_size=96)


class ByteTokenizer:
    """Deterministic byte-level tokenizer: [BOS] + (UTF-8 bytes + 3) + [EOS]."""

    def encode(self, text: str) -> list[int]:
        """Token ids of one text."""
        return [BOS_ID] + [b + BYTE_OFFSET for b in text.encode("utf-8")] + [EOS_ID]

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special ids dropped)."""
        return bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET).decode("utf-8", errors="replace")


class EncoderLayer(nn.Module):
    """Pre-norm causal self-attention (q/k RMSNorm, full RoPE) and SwiGLU MLP."""

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.heads, self.head_dim, self.eps = cfg.num_heads, cfg.head_dim, cfg.norm_eps
        inner = cfg.num_heads * cfg.head_dim
        self.input_norm = ops.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_norm = ops.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = nn.Module()
        self.attn.qkv_proj = ops.Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.attn.q_norm = ops.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.attn.k_norm = ops.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.attn.out_proj = ops.Linear(inner, cfg.hidden_size, bias=False)
        self.mlp = nn.Module()
        self.mlp.fc1 = ops.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=False)
        self.mlp.fc2 = ops.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.attn.qkv_proj(x, prologue=Prologue.RMS_NORM, prologue_weight=self.input_norm, eps=self.eps)
        q, k, v = qkv.view(b, s, 3, self.heads, self.head_dim).unbind(2)  # each (B, S, H, D)
        q = rope_split_half(self.attn.q_norm(q), *rope)
        k = rope_split_half(self.attn.k_norm(k), *rope)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep[:, None, None, :], causal=True)
        x = self.attn.out_proj(out.transpose(1, 2).reshape(b, s, -1), residual=x)
        h = self.mlp.fc1(x, prologue=Prologue.RMS_NORM, prologue_weight=self.post_norm, eps=self.eps)
        return self.mlp.fc2(h, prologue=Prologue.SWIGLU, residual=x)


class TextEncoder(nn.Module):
    """Texts -> (hidden (B, L, hidden_size) float32, mask (B, L) bool), right-padded."""

    def __init__(self, config: TextEncoderConfig | None = None):
        super().__init__()
        cfg = self.config = config or TextEncoderConfig()
        self.tokenizer = ByteTokenizer()
        self.embed_tokens = ops.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.num_layers)])

    def tokenize(self, text: str, embeddings: dict[str, torch.Tensor] | None = None) -> list[int | torch.Tensor]:
        """Token ids of `text`, with each `embedding:name` replaced by that embedding's (n, hidden) rows."""
        pieces: list[int | torch.Tensor] = []
        pos = 0
        body: list[int | torch.Tensor] = []
        for match in EMBEDDING_PATTERN.finditer(text):
            body += self.tokenizer.encode(text[pos:match.start()])[1:-1]
            name = match.group(1)
            if embeddings is None or name not in embeddings:
                raise ValueError(f"prompt names embedding {name!r}, which was not provided "
                                 f"(available: {sorted(embeddings or {}) or 'none'})")
            emb = embeddings[name]
            emb = emb.reshape(-1, emb.shape[-1])
            if emb.shape[-1] != self.config.hidden_size:
                raise ValueError(f"embedding {name!r} has width {emb.shape[-1]}; this text encoder's width is "
                                 f"{self.config.hidden_size}")
            body.append(emb)
            pos = match.end()
        body += self.tokenizer.encode(text[pos:])[1:-1]
        pieces = [BOS_ID] + body + [EOS_ID]
        return pieces

    def _embed_pieces(self, pieces: list[int | torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        rows, ids = [], []

        def flush() -> None:
            if ids:
                rows.append(self.embed_tokens(torch.tensor(ids, device=device)).to(dtype))
                ids.clear()

        for piece in pieces:
            if isinstance(piece, torch.Tensor):
                flush()
                rows.append(piece.to(device=device, dtype=dtype))
            else:
                ids.append(piece)
        flush()
        return torch.cat(rows)

    def encode(self, texts: list[str] | str, *, embeddings: dict[str, torch.Tensor] | None = None,
               layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states after `layer` (1-based; default: the last layer) for each text, and the padding mask."""
        if isinstance(texts, str):
            texts = [texts]
        cfg = self.config
        layer = cfg.num_layers if layer is None else layer
        if not 0 <= layer <= cfg.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{cfg.num_layers}")
        device = compute_device(self)
        dtype = input_dtype(self.layers[0].attn.qkv_proj) if cfg.num_layers else input_dtype(self.embed_tokens)
        with torch.no_grad():
            seqs = [self._embed_pieces(self.tokenize(t, embeddings), device, dtype) for t in texts]
            length = max(s.shape[0] for s in seqs)
            x = torch.zeros(len(seqs), length, cfg.hidden_size, dtype=dtype, device=device)
            keep = torch.zeros(len(seqs), length, dtype=torch.bool, device=device)
            for i, s in enumerate(seqs):
                x[i, :s.shape[0]] = s
                keep[i, :s.shape[0]] = True
            rope = self._rope(length, device)
            for block in self.layers[:layer]:
                x = block(x, rope, keep)
            hidden = x.float() * keep[..., None]
        return hidden, keep

    def _rope(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.config.head_dim // 2
        inv = 1.0 / self.config.rope_theta ** (torch.arange(half, dtype=torch.float32, device=device) / half)
        angles = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv
        return torch.cos(angles), torch.sin(angles)
