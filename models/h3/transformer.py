"""The H3 audio-video diffusion transformer: one stream of blocks over one packed sequence.

Per batch element the sequence is [text | condition rows | target audio | target video] (see
models/h3/packing.py). Full bidirectional self-attention, no cross-attention. Every block is AdaLN-zero
modulated by a row chosen from (timestep, modality tag), so one forward carries several noise levels
(clean condition rows, the video and the audio schedules, per-token noise masks). Text is projected by
`condition_proj` and refined by a small `token_refiner` (no AdaLN, no RoPE). The output is the velocity
pointing toward data for the target audio and video: x0 = x + sigma * v.

Parameter names are the original checkpoint's, so a real checkpoint loads by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels.norms import modulated_rms_norm, rms_norm_rope
from kernels.prologues import Prologue
from models import ops, parallel
from models.h3 import packing
from models.h3.packing import SegmentRole as Role
from models.h3 import pdd, sparse_attention
from models.adapters.base import InputAffine, NoInputAffine
from models.h3.layers import attention
from models.memory import using
from models.ops import input_dtype


def island_dtype(layer: nn.Module) -> torch.dtype:
    """The input dtype of a layer kept in float32 (patch projections, output heads, time embedding).

    A float layer runs in its weight's dtype; a quantized one (a GGUF file may store these layers
    in a block type) is fed float32, so it is dequantized to float32 and the island stays float32.
    """
    return torch.float32 if getattr(layer, "holds_quantized_weights", False) else layer.weight.dtype


@dataclass
class H3TransformerConfig:
    """Shape of an H3 transformer. Defaults are the released 33B model's."""
    hidden_size: int = 5376              # width of the residual stream
    num_layers: int = 50                 # DiT blocks
    refiner_layers: int = 2              # token_refiner blocks (text only)
    num_heads: int = 56
    head_dim: int = 128                  # inner attention width 56 * 128 = 7168, wider than hidden_size
    ffn_size: int = 14336                # SwiGLU width (fc1 holds gate and value halves)
    video_channels: int = 24             # video latent channels
    audio_channels: int = 32             # audio latent channels
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) video patch: 24 * 4 = 96 values per row
    text_dim: int = 5120                 # width of the text encoder's hidden states
    time_freq_dim: int = 256             # sinusoidal timestep features
    time_hidden_size: int = 5376         # time_embedder.proj_in width
    time_embed_dim: int = 2688           # time_embedder output, input of every adaln_proj
    rope_freqs_per_axis: int = 16        # rotary pairs per axis (t, h, w): 3 * 16 * 2 = 96 of 128 dims rotated
    adaln_curve_points: int | None = None  # curve-form checkpoints: rows of adaln_t_table (no time_embedder)
    gate_compress: bool = False          # FastH3 checkpoints: each block's attn.to_gate_compress (VSA's coarse gate)
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    shift_video: float = 12.0            # sigma shift of the video schedule
    shift_audio: float = 3.0             # sigma shift of the audio schedule (derived from the video sigma)

    @property
    def inner_dim(self) -> int:
        """Attention width (heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def video_patch_dim(self) -> int:
        """Values per video patch row."""
        pt, ph, pw = self.patch_size
        return self.video_channels * pt * ph * pw


# A configuration that keeps every interface of the real one (24/32 latent channels, patch 1x2x2,
# partial rotary, inner attention width != hidden width) and runs in milliseconds on a CPU.
TINY_CONFIG = H3TransformerConfig(
    hidden_size=64, num_layers=2, refiner_layers=1, num_heads=2, head_dim=48, ffn_size=128, text_dim=48,
    time_freq_dim=32, time_hidden_size=64, time_embed_dim=32, rope_freqs_per_axis=6)


def _rms_norm(dim: int, eps: float) -> nn.Module:
    return ops.RMSNorm(dim, eps=eps)


def _falling_frequencies(count: int, base: float = 10000.0) -> torch.Tensor:
    # base^(-i / count) for i < count, falling geometrically from 1 towards 1 / base. Written as
    # exp(i * -ln(base) / count) and evaluated in float32 in that order, because that is how the released
    # model's reference code rounds them; the features then match it bit for bit.
    steps = torch.arange(count, dtype=torch.float32)
    return torch.exp(steps * -math.log(base) / count)


class TimestepEncoder(nn.Module):
    """Timestep t in [0, 1] -> sinusoidal features (all cosines, then all sines) -> two-layer SiLU MLP."""

    def __init__(self, feature_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.feature_dim = feature_dim
        self.proj_in = ops.Linear(feature_dim, hidden_dim, bias=True)
        self.proj_out = ops.Linear(hidden_dim, out_dim, bias=True)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        frequencies = _falling_frequencies(self.feature_dim // 2).to(t.device)
        phases = t.float()[:, None] * frequencies  # (M, feature_dim / 2)
        features = torch.cat([phases.cos(), phases.sin()], dim=-1)
        hidden = F.silu(self.proj_in(features.to(island_dtype(self.proj_in))))
        return self.proj_out(hidden)


class RotarySelfAttention(nn.Module):
    """Self-attention with one fused q/k/v projection, RMS-normalised q and k per head, and rotary positions
    on the leading dims of each head."""

    def __init__(self, width: int, heads: int, head_dim: int, qk_eps: float, *, gate_compress: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv_proj = ops.Linear(width, 3 * heads * head_dim, bias=False)
        self.q_norm = _rms_norm(head_dim, qk_eps)
        self.k_norm = _rms_norm(head_dim, qk_eps)
        self.out_proj = ops.Linear(heads * head_dim, width, bias=False)
        # FastH3's gate of VSA's coarse branch; dense attention does not use it.
        self.to_gate_compress = ops.Linear(width, heads * head_dim, bias=False) if gate_compress else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                residual: torch.Tensor | None = None,
                sparse: sparse_attention.SparseCall | None = None) -> torch.Tensor:
        rows = x.shape[0]
        # The fused projection's output features are ordered (q|k|v, head, dim).
        q, k, v = self.qkv_proj(x).view(rows, 3, self.heads, self.head_dim).unbind(1)  # each (S, heads, dim)
        if rope is None:
            q, k = self.q_norm(q), self.k_norm(k)
        else:
            q, k = _normed_rotated(self.q_norm, q, rope), _normed_rotated(self.k_norm, k, rope)
        gate = None
        if sparse is not None and sparse.plan is not None and self.to_gate_compress is not None:
            gate = self.to_gate_compress(x).view(rows, self.heads, self.head_dim)
        split = parallel.active_split()
        if split is not None:
            # Sequence parallel: trade this rank's rows of every head for every row of its share of the heads.
            traded = split.heads_to_rows(q, k, v, *(() if gate is None else (gate,)))
            q, k, v, gate = traded[0], traded[1], traded[2], (traded[3] if gate is not None else None)
        seq, heads = q.shape[0], q.shape[1]
        if sparse is not None:
            mixed = sparse.attend(q, k, v, gate).reshape(seq, heads * self.head_dim)
        else:
            by_head = [part.transpose(0, 1)[None] for part in (q, k, v)]  # (1, heads, S, dim)
            mixed = _dense_attention(*by_head)[0].transpose(0, 1).reshape(seq, heads * self.head_dim)
        if split is not None:
            mixed = split.rows_to_heads(mixed.view(seq, heads, self.head_dim))  # (rows here, all heads * dim)
        return self.out_proj(mixed.to(v.dtype), residual=residual)


def _normed_rotated(norm: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """rope_split_half(norm(x), *rope) for x (S, heads, dim), as one fused pass where that pays (kernels/norms.py)."""
    with using(norm, dtype=x.dtype) as (weight, _):
        return rms_norm_rope(x, weight, norm.eps, *rope)


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention with the dense backend the running MODEL handle chose (ModelAttentionBackend)."""
    from models.patcher import active_options

    if active_options().get("attention_backend") == "int8":
        score_bytes = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4
        if score_bytes <= sparse_attention.INT8_MAX_SCORE_BYTES:
            from kernels.attention import attention as kernel_attention
            return kernel_attention(q, k, v, int8_qk=True)
        sparse_attention.warn_once(
            f"int8 attention would hold a {score_bytes / 2**30:.1f} GiB score matrix; using PyTorch attention instead")
    return attention(q, k, v)


class SwiGLU(nn.Module):
    """Gated feed-forward: fc2(silu(gate) * value), where fc1 yields the gate and value halves side by side."""

    def __init__(self, width: int, inner: int):
        super().__init__()
        self.fc1 = ops.Linear(width, 2 * inner, bias=False)
        self.fc2 = ops.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc2(self.fc1(x), prologue=Prologue.SWIGLU, residual=residual)


class Modulation(nn.Module):
    """Time embeddings -> modulation tables: `parts` tensors (shift, scale or gate) of one row per
    (timestep, modality tag), row index = timestep index * tags + tag."""

    def __init__(self, time_dim: int, width: int, parts: int, tags: int, *, silu_input: bool = True):
        super().__init__()
        self.parts, self.tags, self.width, self.silu_input = parts, tags, width, silu_input
        # One output feature per (tag, part, channel), in that order: the checkpoint's layout.
        self.linear = ops.Linear(time_dim, tags * parts * width, bias=True)

    def forward(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        source = F.silu(t_emb) if self.silu_input else t_emb
        table = self.linear(source.to(input_dtype(self.linear)))  # (M, tags * parts * width)
        return table.reshape(-1, self.parts, self.width).unbind(1)  # parts x (M * tags, width)


class RowModulation:
    """Applies per-row modulation rows (indexed by `row_index`): the pre-norm's shift and scale, the residual's gate.

    The gate is applied by contiguous runs of rows, or by gather when runs are many.
    """

    MAX_RUNS = 32

    def __init__(self, row_index: torch.Tensor):
        self.row_index = row_index  # (S,) the modulation row of every token
        values, counts = torch.unique_consecutive(row_index, return_counts=True)
        if values.numel() <= self.MAX_RUNS:
            stops = counts.cumsum(0).tolist()
            starts = [0] + stops[:-1]
            self.runs = list(zip(starts, stops, values.tolist()))
            self.index = None
        else:
            self.runs, self.index = None, row_index

    def norm_affine(self, norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """norm(x) * (1 + scale[row]) + shift[row], `norm` an RMSNorm (fused where that pays: kernels/norms.py)."""
        with using(norm, dtype=x.dtype) as (weight, _):
            return modulated_rms_norm(x, weight, norm.eps, shift, scale, self.row_index)

    def gated_add(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + gate[row] * y."""
        if self.index is not None:
            return x + gate[self.index].to(x.dtype) * y
        out = torch.empty_like(x)
        for a, b, r in self.runs:
            out[a:b] = torch.addcmul(x[a:b], y[a:b], gate[r].to(x.dtype))
        return out


def _modulated_residual(x: torch.Tensor, rows: RowModulation, norm: nn.Module, sublayer: Callable,
                        shift: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + gate * sublayer(norm(x) * (1 + scale) + shift), with each row's shift, scale and gate."""
    return rows.gated_add(x, gate, sublayer(rows.norm_affine(norm, x, shift, scale)))


class TextLayer(nn.Module):
    """A pre-norm transformer layer for the text rows alone: attention then SwiGLU, no modulation, no RoPE."""

    def __init__(self, cfg: H3TransformerConfig):
        super().__init__()
        self.norm1 = _rms_norm(cfg.hidden_size, cfg.norm_eps)
        self.norm2 = _rms_norm(cfg.hidden_size, cfg.norm_eps)
        self.attn = RotarySelfAttention(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.qk_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.norm1(x), residual=x)
        return self.mlp(self.norm2(x), residual=x)


class TextRefiner(nn.Module):
    """Prepares the projected text for the joint sequence: a stack of TextLayers and an RMSNorm."""

    def __init__(self, cfg: H3TransformerConfig):
        super().__init__()
        self.blocks = nn.ModuleList([TextLayer(cfg) for _ in range(cfg.refiner_layers)])
        self.final_norm = _rms_norm(cfg.hidden_size, cfg.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.blocks:
            x = layer(x)
        return self.final_norm(x)


class JointLayer(nn.Module):
    """One layer over the whole packed sequence: attention and SwiGLU, each wrapped in a per-row
    modulation (shift and scale before, a gate on the residual) chosen by timestep and modality."""

    def __init__(self, cfg: H3TransformerConfig):
        super().__init__()
        self.norm1 = _rms_norm(cfg.hidden_size, cfg.norm_eps)
        self.norm2 = _rms_norm(cfg.hidden_size, cfg.norm_eps)
        self.attn = RotarySelfAttention(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.qk_norm_eps,
                                        gate_compress=cfg.gate_compress)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_size)
        # Curve-form checkpoints store the modulation input already activated.
        self.adaln_proj = Modulation(cfg.time_embed_dim, cfg.hidden_size, parts=6, tags=3,
                                     silu_input=cfg.adaln_curve_points is None)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, rows: RowModulation,
                rope: tuple[torch.Tensor, torch.Tensor],
                sparse: sparse_attention.SparseCall | None = None) -> torch.Tensor:
        tables = self.adaln_proj(t_emb)  # attention's shift, scale, gate, then the SwiGLU's
        x = _modulated_residual(x, rows, self.norm1, lambda h: self.attn(h, rope, sparse=sparse), *tables[:3])
        return _modulated_residual(x, rows, self.norm2, self.mlp, *tables[3:])


class OutputHeads(nn.Module):
    """Modulated RMSNorm of the target rows, then the float32 projection to video patches or audio frames."""

    def __init__(self, cfg: H3TransformerConfig):
        super().__init__()
        self.norm = _rms_norm(cfg.hidden_size, cfg.final_norm_eps)
        self.adaln_proj = Modulation(cfg.time_embed_dim, cfg.hidden_size, parts=2, tags=1,
                                     silu_input=cfg.adaln_curve_points is None)
        self.video_out = ops.Linear(cfg.hidden_size, cfg.video_patch_dim, bias=True)
        self.audio_out = ops.Linear(cfg.hidden_size, cfg.audio_channels, bias=True)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, t_index: torch.Tensor,
                stream: Role) -> torch.Tensor:
        """Float32 velocities of `x`, rows of the VIDEO or the AUDIO target; t_index picks each row's timestep."""
        shift, scale = self.adaln_proj(t_emb)  # one row per timestep (a single tag)
        normed = RowModulation(t_index).norm_affine(self.norm, x, shift, scale).float()
        head = self.video_out if stream == Role.VIDEO else self.audio_out
        from models.patcher import HEAD_BANKS, active_options
        bank = active_options().get(HEAD_BANKS, {}).get(id(head))
        if bank is not None:
            return self._banked(head, bank, normed, stream)
        return head(normed.to(island_dtype(head))).float()

    def _banked(self, head: nn.Module, bank: dict, normed: torch.Tensor, stream: Role) -> torch.Tensor:
        """The head a PDD bank gives for the sampler step being taken (models/h3/pdd.py), applied to `normed`."""
        step = pdd.current_step()
        weight_bank = bank.get("weight")
        if step is None or weight_bank is None:
            raise ValueError(f"the adapter {weight_bank.key if weight_bank else bank['bias'].key!r} holds a bank of "
                             "output heads chosen per sampler step (a PDD adapter); run the model through an H3 sampler "
                             "(KSampler, SamplerCustom, SamplerCustomAdvanced), which says which step it takes")
        shift = step.video_shift if stream == Role.VIDEO else step.audio_shift
        bias_bank = bank.get("bias")
        weight, bias = pdd.blended_head(weight_bank.source.value.to(normed.device, torch.float32),
                                        None if bias_bank is None else bias_bank.source.value.to(normed.device,
                                                                                                 torch.float32),
                                        weight_bank.source.heads, step, shift)
        if bias is None and head.bias is not None:
            bias = head.bias.float().to(normed.device)
        return F.linear(normed.float(), weight, bias)


def _noised_visual_condition(rows: torch.Tensor, seed: int) -> torch.Tensor:
    """Visual condition rows at noise level sigma = 1 - VIDEO_CONDITION_T, the level they are labelled with.

    The flow interpolation (1 - sigma) * clean + sigma * noise, with noise from a CPU generator seeded
    afresh for every block, so every block and every step sees the same noise for a given seed.
    """
    sigma = 1.0 - packing.VIDEO_CONDITION_T
    noise = torch.randn(rows.shape, generator=torch.Generator("cpu").manual_seed(int(seed)), dtype=torch.float32)
    return (1.0 - sigma) * rows + sigma * noise.to(rows.device)


@dataclass
class BlockContext:
    """What a block hook sees of one forward over one packed sequence (one batch element)."""
    layout: packing.PackedLayout
    t_emb: torch.Tensor                          # the timestep embeddings the modulation rows index
    rows: RowModulation                          # each row's modulation row
    rope: tuple[torch.Tensor, torch.Tensor]      # rotary cos, sin per row
    sigma_video: float                           # the video stream's noise level this step
    latent_size: tuple[int, int, int]            # (T', H, W) of the whole clip's video latent, before padding
    num_layers: int                              # blocks of the model
    split: parallel.SequenceSplit | None = None  # sequence parallel: the block tensors hold this rank's rows only
    window: packing.TargetWindow | None = None   # a context window: which clip frames the target rows hold

    def rows_here(self, start: int, stop: int) -> tuple[slice, slice] | None:
        """Where sequence rows [start, stop) sit in the block tensors and within the run, or None if not held here."""
        if self.split is None:
            return slice(start, stop), slice(0, stop - start)
        return self.split.overlap(start, stop)


class BlockHook(Protocol):
    """Something that runs between the transformer's blocks (the Fun ControlNet patch is one)."""

    def begin(self, context: BlockContext) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """For one forward: a function (block index, block input, block output) -> the output passed on, or None."""


# Where a curve-form model's affine comes from (models/loading.py reads these), and what to do without it.
AFFINE_KEYS = ("adaln_basis", "adaln_mean")
AFFINE_SIDECAR = "adaln_affine.safetensors"
MISSING_AFFINE = ("moving such an entry onto the pruned model needs the pruning's basis and mean (tensors adaln_basis "
                  "(curve width, full width) and adaln_mean (full width)), which the released pruned int8 files do not "
                  f"carry; put them in '<model file name>.{AFFINE_SIDECAR}' or '{AFFINE_SIDECAR}' beside the model "
                  "file (the pruned bf16 release holds them), or use an adapter made for the pruned model")

# Parameters kept in float32 whatever the model dtype (the checkpoint's float32 island).
FLOAT32_PREFIXES = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "adaln_t_table",
                    "rope.", "final_layer.video_out.", "final_layer.audio_out.")


class H3Transformer(nn.Module):
    """The H3 transformer; forward returns velocities toward data for the target video and audio."""

    def __init__(self, config: H3TransformerConfig | None = None):
        super().__init__()
        cfg = self.config = config or H3TransformerConfig()
        if 6 * cfg.rope_freqs_per_axis > cfg.head_dim:
            raise ValueError(f"rope_freqs_per_axis {cfg.rope_freqs_per_axis} rotates more than head_dim {cfg.head_dim}")
        self.video_patch_proj = ops.Linear(cfg.video_patch_dim, cfg.hidden_size, bias=True)
        self.audio_patch_proj = ops.Linear(cfg.audio_channels, cfg.hidden_size, bias=True)
        self.condition_proj = ops.Linear(cfg.text_dim, cfg.hidden_size, bias=True)
        if cfg.adaln_curve_points is not None:
            self.register_buffer("adaln_t_table", torch.zeros(cfg.adaln_curve_points, cfg.time_embed_dim))
        else:
            self.time_embedder = TimestepEncoder(cfg.time_freq_dim, cfg.time_hidden_size, cfg.time_embed_dim)
        self.rope = nn.Module()
        n = cfg.rope_freqs_per_axis
        self.rope.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float32) / n)))
        self.token_refiner = TextRefiner(cfg)
        self.blocks = nn.ModuleList([JointLayer(cfg) for _ in range(cfg.num_layers)])
        self.final_layer = OutputHeads(cfg)
        # Curve form: how the curve's coordinates map back to the full model's SiLU'd time embedding, which
        # adapters trained on the full model need (see adapter_input_affines); set by the loader when found.
        self.adaln_affine: InputAffine | NoInputAffine | None = None
        if cfg.adaln_curve_points is not None:
            self.adaln_affine = NoInputAffine(cfg.time_embed_dim, None, MISSING_AFFINE)

    def adaln_modules(self) -> list[str]:
        """Names of the Linear layers that read the time embedding (every AdaLN projection)."""
        return [f"blocks.{i}.adaln_proj.linear" for i in range(len(self.blocks))] + ["final_layer.adaln_proj.linear"]

    def adapter_head_bank_layers(self) -> list[str]:
        """The output heads, which take a PDD bank of heads chosen per sampler step (models/h3/pdd.py)."""
        return ["final_layer.video_out", "final_layer.audio_out"]

    def adapter_input_affines(self) -> dict[str, InputAffine | NoInputAffine]:
        """For a curve-form model: every AdaLN projection, with the affine from the full model's input to its own.

        The pruning wrote the full model's modulation input, silu(time_embedder(t)) (time_embed_dim of the full
        model, 2688 released), as mean + curve(t) @ basis, where curve(t) is the table row this model reads (8
        released); so each projection here is the full one times basis.T, its bias plus the full weight times
        mean. An adapter entry for the full projection moves here the same way (models/adapters/base.py,
        InputAffine): exactly, wherever the pruned model itself equals the full one.
        """
        if self.adaln_affine is None:
            return {}
        return {name: self.adaln_affine for name in self.adaln_modules()}

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations flow in (that of the non-float32 weights)."""
        return input_dtype(self.condition_proj)

    def refine_text(self, text: torch.Tensor) -> torch.Tensor:
        """The text rows the blocks attend to: the encoder's (L, text_dim) states, projected and refined."""
        return self.token_refiner(self.condition_proj(text.to(self.compute_dtype)))

    def rope_tables(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, 3) positions -> cos, sin of (S, 3 * freqs) rotation angles (t freqs, then h, then w)."""
        inv = self.rope.inv_freq.float().to(device)
        angles = positions.to(device=device, dtype=torch.float32)[:, :, None] * inv  # (S, 3, F)
        angles = angles.flatten(1)
        return torch.cos(angles), torch.sin(angles)

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        """(M,) timesteps in [0, 1] (1 = clean) -> (M, time_embed_dim)."""
        if self.config.adaln_curve_points is None:
            return self.time_embedder(t).to(self.compute_dtype)
        # The table samples a curve at t = k / (rows - 1), linear between samples: the embedding is a
        # weighted sum of rows (as the tiled decoders sum weighted tiles), row k weighing 1 - |place - k|
        # and nothing beyond one step, so at most two rows count and a t on the grid takes its row exactly.
        table = self.adaln_t_table.float()                                   # (rows, time_embed_dim)
        place = t.float().clamp(0.0, 1.0) * (table.shape[0] - 1)            # (M,)
        grid = torch.arange(table.shape[0], device=place.device, dtype=place.dtype)
        weights = (1.0 - (place[:, None] - grid[None, :]).abs()).clamp(min=0.0)   # (M, rows)
        return weights @ table

    def forward(self, video: torch.Tensor, audio: torch.Tensor, context: torch.Tensor,
                sigma_video: float, sigma_audio: float, *, context_mask: torch.Tensor | None = None,
                conditions: list[list[packing.ConditionItem]] | None = None,
                video_mask: torch.Tensor | None = None, audio_mask: torch.Tensor | None = None,
                condition_seed: int = 0, context_tags: torch.Tensor | None = None,
                target_window: packing.TargetWindow | None = None,
                clip_size: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocities toward data for the targets.

        video (B, 24, T, H, W), audio (B, 32, 2, Ta), context (B, L, text_dim) with optional boolean
        context_mask (B, L); sigma_video / sigma_audio: the streams' noise levels; conditions: per batch
        element, the condition items (models/h3/packing.py); video_mask (B, T, ceil(H/2), ceil(W/2)) and
        audio_mask (B, Ta): per-row noise masks in [0, 1] (1 = generate); context_tags (B, L): the modality
        tag of each text token (packing.TAG_TEXT, or TAG_VIDEO for a picture's tokens; default all text). The running MODEL
        handle's options may add block hooks (`models.patcher.BLOCK_HOOKS`, see BlockHook). target_window: the
        targets are these frames of a longer clip of latent size clip_size (T', H, W) (a context window,
        models/h3/context_windows.py); their rows keep the clip's times. Returns float32 (B, 24, T, H, W) and
        (B, 32, 2, Ta).
        """
        cfg = self.config
        b, c, t, h, w = video.shape
        if c != cfg.video_channels or audio.shape[1] != cfg.audio_channels or audio.shape[2] != 2:
            raise ValueError(f"H3 transformer expects video (B, {cfg.video_channels}, T, H, W) and audio "
                             f"(B, {cfg.audio_channels}, 2, T); got {tuple(video.shape)} and {tuple(audio.shape)}")
        if context.shape[-1] != cfg.text_dim:
            raise ValueError(f"conditioning width {context.shape[-1]} does not match the model's text width {cfg.text_dim}")
        if audio.shape[0] != b or context.shape[0] not in (1, b):
            raise ValueError(f"batch sizes differ: video {b}, audio {audio.shape[0]}, conditioning {context.shape[0]}")
        # Latent sizes that are not whole patches are padded circularly (the reference's padding); the
        # output is cropped back.
        video = packing.pad_to_patches(video)
        v_out, a_out = [], []
        for i in range(b):
            text = context[i if context.shape[0] > 1 else 0]
            tags = None if context_tags is None else context_tags[i if context_tags.shape[0] > 1 else 0]
            if context_mask is not None:
                keep = context_mask[i if context_mask.shape[0] > 1 else 0].bool()
                text = text[keep]
                tags = None if tags is None else tags[keep.to(tags.device)]
            v, a = self._forward_one(
                video[i], audio[i], text, float(sigma_video), float(sigma_audio),
                conditions[i] if conditions else [],
                video_mask[i] if video_mask is not None else None,
                audio_mask[i] if audio_mask is not None else None, condition_seed, tags, clip_size or (t, h, w),
                target_window)
            v_out.append(v[:, :, :h, :w])
            a_out.append(a)
        return torch.stack(v_out), torch.stack(a_out)

    def _forward_one(self, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, sigma_v: float,
                     sigma_a: float, items: list[packing.ConditionItem], video_mask: torch.Tensor | None,
                     audio_mask: torch.Tensor | None, seed: int,
                     text_tags: torch.Tensor | None = None,
                     latent_size: tuple[int, int, int] | None = None,
                     window: packing.TargetWindow | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        device, dtype = video.device, self.compute_dtype
        _, lt, lh, lw = video.shape
        at = audio.shape[-1]
        layout = packing.build_layout(text.shape[0], lt, lh, lw, at, items, text_tags, window)
        seq = layout.seq_len

        t_rows, tags = packing.row_timesteps(layout, sigma_v, sigma_a, video_mask, audio_mask)
        t_values, t_index = torch.unique(t_rows.float(), return_inverse=True)
        t_emb = self.time_embedding(t_values.to(device))
        mod = RowModulation((t_index * 3 + tags).to(device))

        # Rows are embedded in float32 (the patch projections are float32), then kept in the model dtype.
        x = torch.empty(seq, cfg.hidden_size, dtype=dtype, device=device)
        for seg in layout.segments:
            if seg.role is Role.TEXT:
                x[seg.start:seg.stop] = self.refine_text(text)
            elif seg.role is Role.VIDEO:
                x[seg.start:seg.stop] = self._proj(self.video_patch_proj, packing.patchify_video(video.float())).to(dtype)
            elif seg.role in (Role.COND_VIDEO, Role.REF_VIDEO):
                rows = packing.patchify_video(items[seg.item].video.float().to(device))
                rows = _noised_visual_condition(rows, seed)
                x[seg.start:seg.stop] = self._proj(self.video_patch_proj, rows).to(dtype)
            else:
                lat = audio if seg.role is Role.AUDIO else items[seg.item].audio
                rows = packing.pack_audio(lat.float().to(device))
                x[seg.start:seg.stop] = self._proj(self.audio_patch_proj, rows).to(dtype)

        rope = self.rope_tables(layout.positions, device)
        split = None
        if (comm := parallel.communicator()) is not None:
            # Sequence parallel: from here on every per-row tensor is this rank's slice of the rows.
            comm.check_heads(cfg.num_heads)
            split = parallel.SequenceSplit(comm, seq)
            x, rope = split.local(x), (split.local(rope[0]), split.local(rope[1]))
            mod = RowModulation(split.local((t_index * 3 + tags).to(device)))
        from models.patcher import BLOCK_HOOKS, active_options
        sparse = sparse_attention.sparse_call(active_options().get("sparse_attention"), layout, sigma_v,
                                              (lt, lh, lw), has_gate=cfg.gate_compress, device=device)
        context = BlockContext(layout, t_emb, mod, rope, sigma_v, latent_size or (lt, lh, lw), len(self.blocks),
                               split, window)
        runs = [run for hook in active_options().get(BLOCK_HOOKS, ()) if (run := hook.begin(context)) is not None]
        with parallel.sequence_split(split):
            for index, block in enumerate(self.blocks):
                out = block(x, t_emb, mod, rope, sparse if sparse is not None and sparse.applies(index) else None)
                for run in runs:
                    out = run(index, x, out)
                x = out

        vs, as_ = layout.segment(Role.VIDEO), layout.segment(Role.AUDIO)
        if split is None:
            v = self.final_layer(x[vs.start:vs.stop], t_emb, t_index[vs.start:vs.stop].to(device), Role.VIDEO)
            a = self.final_layer(x[as_.start:as_.stop], t_emb, t_index[as_.start:as_.stop].to(device), Role.AUDIO)
        else:
            v, a = self._split_heads(x, t_emb, t_index.to(device), vs, as_, split)
        video_v = packing.unpatchify_video(v, lt, lh // 2, lw // 2, cfg.video_channels)
        audio_v = packing.unpack_audio(a)
        return video_v, audio_v

    def _split_heads(self, x: torch.Tensor, t_emb: torch.Tensor, t_index: torch.Tensor, video: packing.Segment,
                     audio: packing.Segment, split: parallel.SequenceSplit) -> tuple[torch.Tensor, torch.Tensor]:
        """The output heads over this rank's rows, then every rank's outputs gathered: (video rows, audio rows)."""
        width = max(self.config.video_patch_dim, self.config.audio_channels)
        out = torch.zeros(split.per_rank, width, dtype=torch.float32, device=x.device)  # padding stays zero
        for seg, role in ((video, Role.VIDEO), (audio, Role.AUDIO)):
            if (where := split.overlap(seg.start, seg.stop)) is not None:
                here, within = where
                rows = t_index[seg.start + within.start:seg.start + within.stop]
                result = self.final_layer(x[here], t_emb, rows, role)
                out[here, :result.shape[1]] = result
        full = split.gather(out)
        return (full[video.start:video.stop, :self.config.video_patch_dim],
                full[audio.start:audio.stop, :self.config.audio_channels])

    @staticmethod
    def _proj(layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return layer(rows.to(island_dtype(layer)))
