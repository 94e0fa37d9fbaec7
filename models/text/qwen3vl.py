"""Qwen3-VL as H3 reads it: the language model's residual stream over a prompt whose pictures and videos
were turned into tokens by the vision tower.

Attribute names are the released encoder file's keys (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`,
`visual.blocks.N.attn.qkv`, `visual.deepstack_merger_list.N`, ...), so loading is a name map and the
quantized layers (nvfp4 linears, the int8 embedding table) stay as stored until their op takes them.

The language model: token embedding, then decoder layers of pre-norm grouped-query attention (per-head
RMSNorm on q and k, multi-axis rotary embedding) and a SiLU-gated MLP, without biases. There is no final
norm: the conditioning is the residual stream after the last layer, in float32.

The vision tower: 3 x 2 x 16 x 16 patches (two frames) embedded by a Conv3d, plus a learned square table
of position embeddings resampled bilinearly (corners aligned) to the picture's patch grid; pre-norm
blocks of full attention within each two-frame slice (2-D rotary embedding of the patch row and column)
and a tanh-GELU MLP; then a merger that joins each 2 x 2 group of patches into one language-model token.
Deepstack mergers read the output of chosen blocks the same way; their tokens are added to the language
model's stream at the vision positions, one merger per layer, before layers 1, 2, ... run.

Positions (the multi-axis rotary embedding, `rope_positions`): text advances all three axes (time,
row, column) together by one per token. A vision block of a h x w token grid takes time = the running
position and row / column = the running position plus its grid coordinates, then the running position
advances by max(h, w). A video is one block per two-frame slice (the prompt puts a timestamp between
slices). The head's frequencies alternate between the axes (t, h, w, t, h, w, ...) for the first
3 x (row and column sections) frequencies; the rest rotate by time.

Prompts arrive as token ids in which each picture is `<|vision_start|>`, one `<|image_pad|>` per merged
token and `<|vision_end|>` (videos use `<|video_pad|>`, one block per slice), plus the preprocessed
patches of each picture or video in the order they appear (`VisualInput`). Tags: 0 for every token of a
vision block (its start and end tokens included), 1 for text.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.h3.layers import attention, compute_device
from models.memory import stream_blocks

VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_ID = 151655
VIDEO_PAD_ID = 151656
TAG_VISION, TAG_TEXT = 0, 1
H3_CONDITIONING_LAYER = 50       # H3 reads the stream after this layer; later layers of a file are not loaded
VISION_HEADS = 16                # every released Qwen3-VL vision tower has 16 heads
# Blocks that feed the deepstack mergers in the released vision towers, by depth.
RELEASED_DEEPSTACK_LAYERS = {27: (8, 16, 24), 24: (5, 11, 17)}
DEEPSTACK_METADATA = "qwen3vl_deepstack_layers"   # a file may say which blocks feed its mergers (a JSON list)
# Key names of Hugging Face's Qwen3-VL checkpoints, read under the released file's names.
HF_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def default_mrope_section(head_dim: int) -> tuple[int, int, int]:
    """Frequencies per axis (time, row, column): (24, 20, 20) for 128-wide heads, the same shares otherwise."""
    half = head_dim // 2
    spatial = round(half * 20 / 64)
    return half - 2 * spatial, spatial, spatial


@dataclass
class Qwen3VLVisionConfig:
    """Shape of the vision tower; defaults are the released one's."""
    depth: int = 27                      # transformer blocks
    hidden_size: int = 1152              # block width
    num_heads: int = VISION_HEADS
    intermediate_size: int = 4304        # MLP width
    in_channels: int = 3
    patch_size: int = 16                 # pixels per patch side
    temporal_patch_size: int = 2         # frames per patch
    spatial_merge_size: int = 2          # patches per merged token side
    num_position_embeddings: int = 2304  # learned positions: a 48 x 48 square
    out_hidden_size: int = 5120          # merged token width (the language model's)
    deepstack_layers: tuple[int, ...] = (8, 16, 24)  # blocks whose outputs feed the deepstack mergers
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values in one flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclass
class Qwen3VLConfig:
    """Shape of the language model (and its vision tower); defaults are the released H3 encoder's."""
    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 25600       # SiLU-gated MLP width
    num_layers: int = 50                 # layers kept (the released file stops at 50 of 64)
    num_heads: int = 64                  # query heads
    num_kv_heads: int = 8                # key/value heads, each shared by num_heads / num_kv_heads query heads
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)  # rotary frequencies for time, row, column
    vision: Qwen3VLVisionConfig = field(default_factory=Qwen3VLVisionConfig)


# 48 wide: the tiny H3 transformer's text width. Vision heads stay 16 (4 wide each), as in the released towers.
TINY_CONFIG = Qwen3VLConfig(
    hidden_size=48, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
    mrope_section=default_mrope_section(16),
    vision=Qwen3VLVisionConfig(depth=3, hidden_size=64, intermediate_size=96, num_position_embeddings=64,
                               out_hidden_size=48, deepstack_layers=(0, 1)))


@dataclass
class VisualInput:
    """One picture or video, preprocessed: `patches` (t * h * w, C * 2 * 16 * 16) in merge-block order and
    `grid_thw` = (t two-frame slices, h, w patches)."""
    patches: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass
class EncodedPrompt:
    """What the encoder gives the DiT: the residual stream (L, D) float32 and a modality tag per token (L,)."""
    hidden: torch.Tensor
    tags: torch.Tensor
    layers: list[torch.Tensor] | None = None  # every layer's stream (the embeddings first), when asked for


# ----------------------------------------------------------------------------------------------
# Rotary embeddings

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def mrope_axes(head_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """(head_dim / 2,) long: the axis (0 time, 1 row, 2 column) each rotary frequency turns with."""
    half = head_dim // 2
    if sum(section) != half:
        raise ValueError(f"rotary sections {section} do not add up to half the head width ({half})")
    index = torch.arange(half)
    axes = torch.zeros(half, dtype=torch.long)
    axes[(index % 3 == 1) & (index < 3 * section[1])] = 1
    axes[(index % 3 == 2) & (index < 3 * section[2])] = 2
    return axes


def mrope_tables(positions: torch.Tensor, head_dim: int, theta: float, section: tuple[int, int, int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, L) positions -> cos, sin (L, head_dim) float32, each frequency turned by its axis's position."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = positions.to(device=device, dtype=torch.float32)[:, :, None] * inv_freq  # (3, L, half)
    axes = mrope_axes(head_dim, section).to(device)
    chosen = angles.gather(0, axes.view(1, 1, -1).expand(1, angles.shape[1], -1))[0]  # (L, half)
    doubled = torch.cat((chosen, chosen), dim=-1)
    return doubled.cos(), doubled.sin()


def rope_positions(input_ids: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
    """(3, L) long positions (time, row, column) of a prompt; `grids` holds each vision block's merged (h, w)."""
    ids = input_ids.tolist()
    positions = torch.empty(3, len(ids), dtype=torch.long)
    grid_iter = iter(grids)
    index, running = 0, 0
    while index < len(ids):
        if ids[index] not in (IMAGE_PAD_ID, VIDEO_PAD_ID):
            positions[:, index] = running
            running += 1
            index += 1
            continue
        h, w = next(grid_iter)
        count = h * w
        rows = torch.arange(h).repeat_interleave(w)
        cols = torch.arange(w).repeat(h)
        positions[0, index:index + count] = running
        positions[1, index:index + count] = running + rows
        positions[2, index:index + count] = running + cols
        running += max(h, w)
        index += count
    return positions


def pad_runs(input_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(pad id, start, stop) of each run of one vision pad id in a prompt, in order."""
    runs: list[tuple[int, int, int]] = []
    ids = input_ids.tolist()
    index = 0
    while index < len(ids):
        token = ids[index]
        if token in (IMAGE_PAD_ID, VIDEO_PAD_ID):
            stop = index
            while stop < len(ids) and ids[stop] == token:
                stop += 1
            runs.append((token, index, stop))
            index = stop
        else:
            index += 1
    return runs


def modality_tags(input_ids: torch.Tensor) -> torch.Tensor:
    """(L,) long: 0 inside every vision block (from its start token to its end token), 1 elsewhere."""
    tags = torch.full((input_ids.shape[0],), TAG_TEXT, dtype=torch.long)
    inside = False
    for i, token in enumerate(input_ids.tolist()):
        if token == VISION_START_ID:
            inside = True
        if inside or token in (IMAGE_PAD_ID, VIDEO_PAD_ID):
            tags[i] = TAG_VISION
        if token == VISION_END_ID:
            inside = False
    return tags


# ----------------------------------------------------------------------------------------------
# Vision tower

def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Bilinear resampling of a `side`-long table to `size` points, end points on end points.
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def patch_grid(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid in merge-block order (each merge x merge block's patches together)."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


class VisionPatchEmbed(nn.Module):
    """Flattened (C, 2, 16, 16) patches -> block-width rows, through the released Conv3d."""

    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = ops.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = patches.view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        return self.proj(x).view(-1, cfg.hidden_size)  # (N, width)


class VisionAttention(nn.Module):
    """Full attention with 2-D rotary embedding; each two-frame slice attends only to itself."""

    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = ops.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = ops.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], slice_len: int,
                residual: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # each (N, heads, head_dim)
        cos, sin = (t[:, None, :] for t in rope)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        slices = n // slice_len
        # (slices, heads, slice_len, head_dim): slices are independent sequences.
        q, k, v = (t.view(slices, slice_len, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = attention(q, k, v).transpose(1, 2).reshape(n, -1)
        return self.proj(out, residual=residual)


class VisionMLP(nn.Module):
    """linear_fc2(gelu_tanh(linear_fc1(x)))."""

    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = ops.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = ops.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"), residual=residual)


class VisionBlock(nn.Module):
    """Pre-norm (LayerNorm) attention and MLP, both residual."""

    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.norm1 = ops.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = ops.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], slice_len: int) -> torch.Tensor:
        x = self.attn(self.norm1(x), rope, slice_len, residual=x)
        return self.mlp(self.norm2(x), residual=x)


class PatchMerger(nn.Module):
    """Each merge x merge group of patches -> one language-model token (LayerNorm, Linear, GELU, Linear).

    The final merger normalises each patch before joining them; the deepstack mergers normalise the
    joined group (`norm_after_join`).
    """

    def __init__(self, cfg: Qwen3VLVisionConfig, norm_after_join: bool) -> None:
        super().__init__()
        self.joined = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm_after_join = norm_after_join
        self.norm = ops.LayerNorm(self.joined if norm_after_join else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = ops.Linear(self.joined, self.joined, bias=True)
        self.linear_fc2 = ops.Linear(self.joined, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.joined)) if self.norm_after_join else self.norm(x).view(-1, self.joined)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # (N / merge^2, out width)


class VisionTower(nn.Module):
    """Preprocessed patches of one picture or video -> its language-model tokens and deepstack tokens."""

    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        if cfg.head_dim % 4:
            raise ValueError(f"vision heads of width {cfg.head_dim} cannot carry a 2-D rotary embedding "
                             f"(the width must be a multiple of 4)")
        if max(cfg.deepstack_layers, default=-1) >= cfg.depth:
            raise ValueError(f"deepstack layers {cfg.deepstack_layers} reach past the tower's {cfg.depth} blocks")
        self.config = cfg
        self.patch_embed = VisionPatchEmbed(cfg)
        self.pos_embed = ops.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, norm_after_join=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(cfg, norm_after_join=True) for _ in cfg.deepstack_layers])

    def _position_rows(self, t: int, h: int, w: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # The learned square table resampled to the h x w grid (corners on corners), repeated per slice.
        side = math.isqrt(self.config.num_position_embeddings)
        rows, cols = patch_grid(h, w, self.config.spatial_merge_size)
        h_taps, h_weights = _axis_taps(rows, h, side)
        w_taps, w_weights = _axis_taps(cols, w, side)
        indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4).to(device)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4).to(device)
        table = self.pos_embed(indices, dtype=torch.float32)  # (h*w, 4, width)
        return (table * weights[:, :, None]).sum(1).to(dtype).repeat(t, 1)

    def _rope(self, t: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        quarter = self.config.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta
                          ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter))
        rows, cols = patch_grid(h, w, self.config.spatial_merge_size)
        angles = torch.cat([rows.to(device)[:, None] * inv_freq, cols.to(device)[:, None] * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1).repeat(t, 1)  # (t*h*w, head_dim)
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor, grid_thw: tuple[int, int, int], dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(tokens (t*h*w / merge^2, out width), one deepstack token tensor per merger)."""
        cfg = self.config
        t, h, w = (int(v) for v in grid_thw)
        merge = cfg.spatial_merge_size
        if h % merge or w % merge:
            raise ValueError(f"a picture of {h} x {w} patches does not split into {merge} x {merge} groups")
        if tuple(patches.shape) != (t * h * w, cfg.patch_values):
            raise ValueError(f"a picture of grid {(t, h, w)} needs patches of shape ({t * h * w}, {cfg.patch_values}); "
                             f"got {tuple(patches.shape)}")
        device = compute_device(self)
        x = self.patch_embed(patches.to(device=device, dtype=dtype))
        x = x + self._position_rows(t, h, w, x.dtype, device)
        rope = self._rope(t, h, w, device)
        deepstack = []
        for index, block in enumerate(stream_blocks(self.blocks)):
            x = block(x, rope, h * w)
            if index in cfg.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_layers.index(index)](x))
        return self.merger(x), deepstack


# ----------------------------------------------------------------------------------------------
# Language model

class TextAttention(nn.Module):
    """Causal grouped-query attention with per-head q/k RMSNorm and the multi-axis rotary embedding."""

    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = ops.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = ops.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = ops.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = ops.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = ops.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = ops.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(length, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(length, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(length, self.kv_heads, self.head_dim)
        cos, sin = (t[:, None, :].to(x.dtype) for t in rope)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        share = self.heads // self.kv_heads
        # (1, heads, L, head_dim); each key/value head serves `share` neighbouring query heads.
        q = q.transpose(0, 1)[None]
        k = k.repeat_interleave(share, dim=1).transpose(0, 1)[None]
        v = v.repeat_interleave(share, dim=1).transpose(0, 1)[None]
        out = attention(q, k, v, causal=True)[0].transpose(0, 1).reshape(length, -1)
        return self.o_proj(out, residual=residual)


class TextMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__()
        self.gate_proj = ops.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = ops.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = ops.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x), residual=residual)


class DecoderLayer(nn.Module):
    """Pre-norm (RMSNorm) attention and MLP, both residual."""

    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__()
        self.input_layernorm = ops.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = ops.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = TextAttention(cfg)
        self.mlp = TextMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), rope, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class Qwen3VL(nn.Module):
    """The Qwen3-VL encoder H3 is conditioned on: `encode(input_ids, visuals)` -> EncodedPrompt."""

    def __init__(self, config: Qwen3VLConfig | None = None) -> None:
        super().__init__()
        cfg = self.config = config or Qwen3VLConfig()
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"{cfg.num_heads} query heads do not share {cfg.num_kv_heads} key/value heads evenly")
        if cfg.vision.out_hidden_size != cfg.hidden_size:
            raise ValueError(f"the vision tower's tokens are {cfg.vision.out_hidden_size} wide, but the language "
                             f"model is {cfg.hidden_size} wide")
        mrope_axes(cfg.head_dim, cfg.mrope_section)  # refuses sections that do not fit the heads
        self.model = nn.Module()
        self.model.embed_tokens = ops.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.visual = VisionTower(cfg.vision)

    def _vision_tokens(self, input_ids: torch.Tensor, visuals: Sequence[VisualInput | tuple]
                       ) -> tuple[list[tuple[int, int]], dict[int, torch.Tensor], list[dict[int, torch.Tensor]]]:
        """Merged (h, w) of each vision block, and the tokens (and deepstack tokens) of each pad position."""
        runs = pad_runs(input_ids)
        merge = self.config.vision.spatial_merge_size
        grids: list[tuple[int, int]] = []
        tokens: dict[int, torch.Tensor] = {}
        deep: list[dict[int, torch.Tensor]] = [{} for _ in self.config.vision.deepstack_layers]
        run_index = 0
        for number, item in enumerate(visuals, start=1):
            patches, grid = (item.patches, item.grid_thw) if hasattr(item, "patches") else item
            t, h, w = (int(v) for v in grid)
            per_slice = (h // merge) * (w // merge)
            blocks = runs[run_index:run_index + t]
            if len(blocks) < t or any(stop - start != per_slice for _, start, stop in blocks) \
                    or len({pad for pad, _, _ in blocks}) != 1 or (t > 1 and blocks[0][0] != VIDEO_PAD_ID):
                found = [(stop - start) for _, start, stop in blocks]
                raise ValueError(f"visual input {number} (grid {t} x {h} x {w}) needs {t} block(s) of {per_slice} "
                                 f"pad tokens in the prompt; found {found or 'none'}")
            merged, deepstack = self.visual(patches, (t, h, w))
            for slice_index, (_, start, stop) in enumerate(blocks):
                rows = slice(slice_index * per_slice, (slice_index + 1) * per_slice)
                grids.append((h // merge, w // merge))
                tokens[start] = merged[rows]
                for level, feature in enumerate(deepstack):
                    deep[level][start] = feature[rows]
            run_index += t
        if run_index != len(runs):
            raise ValueError(f"the prompt has {len(runs)} vision blocks, but the visual inputs fill {run_index}")
        return grids, tokens, deep

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        # A float table is taken in its stored dtype and only the looked-up rows are widened (a float32
        # copy of a 151,936-row table would cost twice its size); a quantized table decodes its rows itself.
        table = self.model.embed_tokens
        quantized = getattr(table, "holds_quantized_weights", False)
        return table(ids, dtype=torch.float32 if quantized else table.weight.dtype).float()

    def encode(self, input_ids: torch.Tensor | Sequence[int], visuals: Sequence[VisualInput | tuple] = (), *,
               keep_layers: bool = False) -> EncodedPrompt:
        """The residual stream after the last layer (L, hidden) in float32 and the modality tags (L,) of a prompt.

        input_ids: the prompt's token ids with pad tokens for its vision blocks; visuals: the pictures and
        videos in the order their blocks appear. keep_layers: also return every layer's stream.
        """
        cfg = self.config
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("the prompt has no tokens (an empty prompt is the pad token alone)")
        if int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"token id {int(ids.max())} is outside this encoder's vocabulary of {cfg.vocab_size}")
        device = compute_device(self)
        with torch.no_grad():
            grids, tokens, deep = self._vision_tokens(ids, visuals)
            x = self._embed(ids.to(device))  # (L, hidden) float32
            deep_rows = []
            if tokens:
                x = x.clone()
                starts = sorted(tokens)
                for start in starts:
                    x[start:start + tokens[start].shape[0]] = tokens[start].float()
                vision_at = torch.cat([torch.arange(s, s + tokens[s].shape[0]) for s in starts]).to(device)
                deep_rows = [torch.cat([level[s] for s in starts]).float() for level in deep]
            rope = mrope_tables(rope_positions(ids, grids), cfg.head_dim, cfg.rope_theta, cfg.mrope_section, device)
            kept = [x] if keep_layers else None
            for index, layer in enumerate(stream_blocks(self.model.layers)):
                if 0 < index <= len(deep_rows):
                    # A deepstack merger's tokens join the stream after the layer of the same number.
                    x = x.index_add(0, vision_at, deep_rows[index - 1])
                x = layer(x, rope)
                if kept is not None:
                    kept.append(x)
        return EncodedPrompt(x.float(), modality_tags(ids), kept)


# ----------------------------------------------------------------------------------------------
# Config recovery and key names

def released_key(key: str) -> str:
    """A Hugging Face Qwen3-VL key under the released file's name (other keys unchanged)."""
    for hf_prefix, released in HF_PREFIXES:
        if key.startswith(hf_prefix):
            return released + key[len(hf_prefix):]
    return key


def _count(shapes: dict[str, tuple], pattern: str) -> int:
    rx = re.compile(pattern)
    found = {int(m.group(1)) for k in shapes for m in [rx.match(k)] if m}
    return max(found) + 1 if found else 0


def _shape(shapes: dict[str, tuple], key: str) -> tuple[int, ...]:
    if key not in shapes:
        raise ValueError(f"Qwen3-VL checkpoint lacks {key!r}")
    return tuple(shapes[key])


def _deepstack_layers(depth: int, mergers: int, metadata: dict[str, str]) -> tuple[int, ...]:
    declared = metadata.get(DEEPSTACK_METADATA)
    if declared is not None:
        try:
            layers = tuple(int(v) for v in json.loads(declared))
        except (ValueError, TypeError):
            raise ValueError(f"metadata {DEEPSTACK_METADATA} is {declared!r}; expected a JSON list of block "
                             "numbers") from None
    else:
        layers = RELEASED_DEEPSTACK_LAYERS.get(depth, ())
    if len(layers) != mergers:
        raise ValueError(f"the vision tower has {depth} blocks and {mergers} deepstack mergers, and which blocks feed "
                         f"them is not known (released towers: {RELEASED_DEEPSTACK_LAYERS}); the file's metadata "
                         f"{DEEPSTACK_METADATA} may list them")
    return layers


def config_from_shapes(shapes: dict[str, tuple], metadata: dict[str, str] | None = None) -> Qwen3VLConfig:
    """Qwen3VLConfig recovered from tensor shapes under the released names (dense shapes for quantized layers).

    The layer count is the file's, up to H3_CONDITIONING_LAYER; widths that disagree are refused naming the keys.
    """
    metadata = metadata or {}
    vocab, hidden = _shape(shapes, "model.embed_tokens.weight")
    layer = "model.layers.0."
    head_dim = _shape(shapes, layer + "self_attn.q_norm.weight")[0]
    q_out, q_in = _shape(shapes, layer + "self_attn.q_proj.weight")
    kv_out = _shape(shapes, layer + "self_attn.k_proj.weight")[0]
    intermediate = _shape(shapes, layer + "mlp.gate_proj.weight")[0]
    if q_in != hidden:
        raise ValueError(f"model.layers.0.self_attn.q_proj takes {q_in} inputs, but the token embeddings are "
                         f"{hidden} wide")
    if q_out % head_dim or kv_out % head_dim:
        raise ValueError(f"attention widths {q_out} (q) and {kv_out} (k, v) are not whole heads of {head_dim} "
                         "(the q_norm width)")
    patch = _shape(shapes, "visual.patch_embed.proj.weight")
    if len(patch) != 5:
        raise ValueError(f"visual.patch_embed.proj.weight has shape {list(patch)}; expected a Conv3d weight "
                         "(width, channels, frames, height, width)")
    width = patch[0]
    positions = _shape(shapes, "visual.pos_embed.weight")[0]
    if math.isqrt(positions) ** 2 != positions:
        raise ValueError(f"visual.pos_embed holds {positions} positions, not a square grid")
    joined = _shape(shapes, "visual.merger.linear_fc1.weight")[1]
    merge = math.isqrt(joined // width)
    if merge * merge * width != joined:
        raise ValueError(f"visual.merger joins {joined} values, not a square group of {width}-wide patches")
    out_width = _shape(shapes, "visual.merger.linear_fc2.weight")[0]
    if out_width != hidden:
        raise ValueError(f"the vision tower's merger writes {out_width}-wide tokens (visual.merger.linear_fc2), but "
                         f"the language model is {hidden} wide (model.embed_tokens); the two halves come from "
                         "different models")
    depth = _count(shapes, r"visual\.blocks\.(\d+)\.")
    mergers = _count(shapes, r"visual\.deepstack_merger_list\.(\d+)\.")
    vision = Qwen3VLVisionConfig(
        depth=depth, hidden_size=width, num_heads=VISION_HEADS,
        intermediate_size=_shape(shapes, "visual.blocks.0.mlp.linear_fc1.weight")[0], in_channels=patch[1],
        patch_size=patch[3], temporal_patch_size=patch[2], spatial_merge_size=merge,
        num_position_embeddings=positions, out_hidden_size=out_width,
        deepstack_layers=_deepstack_layers(depth, mergers, metadata))
    layers = min(_count(shapes, r"model\.layers\.(\d+)\."), H3_CONDITIONING_LAYER)
    return Qwen3VLConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                         num_heads=q_out // head_dim, num_kv_heads=kv_out // head_dim, head_dim=head_dim,
                         mrope_section=default_mrope_section(head_dim), vision=vision)


def unused_key(key: str, config: Qwen3VLConfig) -> bool:
    """True for tensors a file may carry that the conditioning does not use: the final norm, the output head,
    and layers after the last one kept."""
    if key in ("model.norm.weight", "lm_head.weight"):
        return True
    match = re.match(r"model\.layers\.(\d+)\.", key)
    return match is not None and int(match.group(1)) >= config.num_layers
