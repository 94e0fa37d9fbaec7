"""A tiny H3-shaped transformer (the original checkpoint's key names) and adapter-file helpers for the tests.

The model is the tests' own, so they do not depend on models/h3/transformer.py: the same module
names (`blocks.N.attn.qkv_proj`, `mlp.fc1`, `adaln_proj.linear`, `token_refiner.blocks.N...`,
`final_layer...`), fused qkv rows [q | k | v] with an inner attention width (2 x 24 = 48) wider
than the hidden width (32), and a SwiGLU fc1 stored [gate; value]. Layers are models/ops modules,
so every weight reaches its op through the memory manager's take, where patches apply.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from models import ops

HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 24, 40
INNER = HEADS * HEAD_DIM  # 48: the q, k and v row blocks of qkv_proj are 48 rows each
VIDEO_IN, AUDIO_IN, TEXT_IN, T_FREQ, T_EMBED = 96, 32, 20, 16, 16


class FusedAttention(nn.Module):
    """Fused qkv (rows [q | k | v]), per-head RMSNorm on q and k, out projection."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HEAD_DIM
        self.qkv_proj = ops.Linear(HIDDEN, 3 * INNER, bias=False)
        self.q_norm = ops.RMSNorm(HEAD_DIM, eps=1e-6)
        self.k_norm = ops.RMSNorm(HEAD_DIM, eps=1e-6)
        self.out_proj = ops.Linear(INNER, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = self.qkv_proj(x).view(s, 3, HEADS, HEAD_DIM).unbind(1)  # each (S, H, D)
        q, k = self.q_norm(q), self.k_norm(k)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # (H, S, D)
        return self.out_proj(out.transpose(0, 1).reshape(s, INNER))


class GatedFeedForward(nn.Module):
    """SwiGLU: fc1 rows are [gate; value]."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = ops.Linear(HIDDEN, 2 * FFN, bias=True)
        self.fc2 = ops.Linear(FFN, HIDDEN, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * value)


class ModulationHead(nn.Module):
    def __init__(self, expand: int) -> None:
        super().__init__()
        self.linear = ops.Linear(T_EMBED, expand * HIDDEN, bias=True)


class Block(nn.Module):
    def __init__(self, modulated: bool = True) -> None:
        super().__init__()
        self.norm1 = ops.RMSNorm(HIDDEN, eps=1e-6)
        self.norm2 = ops.RMSNorm(HIDDEN, eps=1e-6)
        self.attn = FusedAttention()
        self.mlp = GatedFeedForward()
        if modulated:
            self.adaln_proj = ModulationHead(4)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor | None = None) -> torch.Tensor:
        if t_emb is None:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        shift1, scale1, shift2, scale2 = self.adaln_proj.linear(F.silu(t_emb)).chunk(4, dim=-1)
        x = x + self.attn(self.norm1(x) * (1 + scale1) + shift1)
        return x + self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class PromptRefiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(modulated=False)])
        self.final_norm = ops.RMSNorm(HIDDEN, eps=1e-6)


class TimestepProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = ops.Linear(T_FREQ, HIDDEN, bias=True)
        self.proj_out = ops.Linear(HIDDEN, T_EMBED, bias=True)


class OutputProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = ops.RMSNorm(HIDDEN, eps=1e-6)
        self.adaln_proj = ModulationHead(2)
        self.video_out = ops.Linear(HIDDEN, VIDEO_IN, bias=True)
        self.audio_out = ops.Linear(HIDDEN, AUDIO_IN, bias=True)


class TinyH3(nn.Module):
    """Two blocks and one refiner block over rows [text | audio | video]; returns (video, audio) outputs."""

    def __init__(self, num_blocks: int = 2) -> None:
        super().__init__()
        self.video_patch_proj = ops.Linear(VIDEO_IN, HIDDEN, bias=True)
        self.audio_patch_proj = ops.Linear(AUDIO_IN, HIDDEN, bias=True)
        self.condition_proj = ops.Linear(TEXT_IN, HIDDEN, bias=True)
        self.time_embedder = TimestepProjection()
        self.token_refiner = PromptRefiner()
        self.blocks = nn.ModuleList([Block() for _ in range(num_blocks)])
        self.final_layer = OutputProjection()

    def forward(self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor,
                t_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t_emb = self.time_embedder.proj_out(F.silu(self.time_embedder.proj_in(t_freq)))  # (1, T_EMBED)
        txt = self.condition_proj(text)
        for block in self.token_refiner.blocks:
            txt = block(txt)
        txt = self.token_refiner.final_norm(txt)
        x = torch.cat([txt, self.audio_patch_proj(audio), self.video_patch_proj(video)])  # (S, HIDDEN)
        for block in self.blocks:
            x = block(x, t_emb)
        shift, scale = self.final_layer.adaln_proj.linear(F.silu(t_emb)).chunk(2, dim=-1)
        x = self.final_layer.norm(x) * (1 + scale) + shift
        n_video = video.shape[0]
        return self.final_layer.video_out(x[-n_video:]), self.final_layer.audio_out(x[text.shape[0]:-n_video])


def tiny_h3(seed: int = 0) -> TinyH3:
    """The tiny model with seeded random weights."""
    torch.manual_seed(seed)
    model = TinyH3()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def tiny_inputs(seed: int = 1) -> tuple[torch.Tensor, ...]:
    """(video rows, audio rows, text rows, timestep features) for TinyH3.forward."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(6, VIDEO_IN, generator=gen), torch.randn(4, AUDIO_IN, generator=gen),
            torch.randn(3, TEXT_IN, generator=gen), torch.randn(1, T_FREQ, generator=gen))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter and buffer (to prove the base was never written)."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """Every tensor of `model` equals the snapshot bit for bit."""
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"base parameter {name} was modified"


def write_adapter(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Save `tensors` as a safetensors adapter file and return its path."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def rand(*shape: int, seed: int) -> torch.Tensor:
    """Seeded normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def param(model: nn.Module, name: str) -> torch.Tensor:
    """`model`'s parameter by dotted name."""
    return dict(model.named_parameters())[name]
