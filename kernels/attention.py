"""Attention: `softmax(q @ k.T * scale + mask) @ v` over (B, heads, tokens, head_dim) tensors.

One public function, `attention`, with two backend registries (kernels/registry.py):
  attention       sdpa   PyTorch's scaled_dot_product_attention (flash / memory-efficient kernels where
                         the device has them); the default
                  eager  the reference, float32 softmax
  attention_int8  int8   q and k quantised to int8 per block of `INT8_BLOCK` tokens (one scale per block
                         per head), k smoothed by its mean over tokens first (softmax ignores a per-query
                         constant, and the smoothed k quantises with less error); for decoders whose
                         weights are int8-quantised. Products of int8 values are summed exactly in
                         float32 (head_dim * 127^2 < 2^24), so this is what an int8 matrix product computes.
                  eager  the unquantised reference, the fallback when the int8 path declines
Both int8-path backends return `nan_to_num` of their output: a row whose keys are all masked gives
zeros instead of NaN.

`mask` is either boolean (True = attend) or additive (float, -inf to block), broadcastable to
(B, heads, q_tokens, k_tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from kernels.registry import KernelRegistry

INT8_BLOCK = 64  # tokens per quantisation block of q and k
_INT8_EXACT_HEAD_DIM = (1 << 24) // (127 * 127)  # float32 sums int8 products exactly up to this head_dim


def _scores_mask(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.float()


def attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """The reference: float32 scores and softmax, output in q's dtype."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, L, S)
    probs = torch.softmax(_scores_mask(scores, mask), dim=-1)
    return (probs @ v.float()).to(q.dtype)  # (B, H, L, D)


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """PyTorch's fused scaled-dot-product attention."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _sdpa_check(q, k, v, *, mask=None, scale=None) -> str | None:
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} is not float32/float16/bfloat16"
    return None


def quantize_per_block(t: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values of t (B, H, L, D) and their scales (B, H, L, 1): one scale per `block` tokens per head."""
    batch, heads, tokens, dim = t.shape
    blocks = math.ceil(tokens / block)
    padded = F.pad(t.float(), (0, 0, 0, blocks * block - tokens))
    grouped = padded.view(batch, heads, blocks, block, dim)
    amax = grouped.abs().amax(dim=(3, 4), keepdim=True)  # (B, H, blocks, 1, 1)
    block_scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    values = torch.round(grouped / block_scale).clamp_(-127, 127).to(torch.int8)
    values = values.view(batch, heads, blocks * block, dim)[:, :, :tokens]
    scales = block_scale.expand(batch, heads, blocks, block, 1).reshape(batch, heads, blocks * block, 1)[:, :, :tokens]
    return values, scales


def attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Attention with q and k quantised to int8 per block (k mean-smoothed first)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    k_smooth = k.float() - k.float().mean(dim=-2, keepdim=True)
    q_values, q_scales = quantize_per_block(q)
    k_values, k_scales = quantize_per_block(k_smooth)
    # The integer product, then one rescale per (query block, key block) pair.
    scores = q_values.float() @ k_values.float().transpose(-1, -2)  # (B, H, L, S)
    scores = scores * (q_scales * scale) * k_scales.transpose(-1, -2)
    probs = torch.softmax(_scores_mask(scores, mask), dim=-1)
    return torch.nan_to_num(probs @ v.float()).to(q.dtype)


def _int8_check(q, k, v, *, mask=None, scale=None) -> str | None:
    if q.shape[-1] > _INT8_EXACT_HEAD_DIM:
        return f"head_dim {q.shape[-1]} > {_INT8_EXACT_HEAD_DIM}: float32 would not sum the int8 products exactly"
    if not q.is_floating_point():
        return f"dtype {q.dtype} is not floating point"
    return None


def _int8_fallback(q, k, v, *, mask=None, scale=None) -> torch.Tensor:
    return torch.nan_to_num(attention_eager(q, k, v, mask=mask, scale=scale))


ATTENTION = KernelRegistry("attention")
ATTENTION.register("sdpa", attention_sdpa, check=_sdpa_check)
ATTENTION.register("eager", attention_eager)

ATTENTION_INT8 = KernelRegistry("attention_int8")
ATTENTION_INT8.register("int8", attention_int8, check=_int8_check)
ATTENTION_INT8.register("eager", _int8_fallback)


def check_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Raise ValueError naming the shapes when q, k, v, mask do not fit together."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention: q, k, v must be (B, heads, tokens, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if mask is not None:
        scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            fits = torch.broadcast_shapes(mask.shape, scores) == torch.Size(scores)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attention: mask {tuple(mask.shape)} does not broadcast to the scores {scores}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
              backend: str | None = None, scale: float | None = None, int8_qk: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v: q (B, H, L, D), k/v (B, H, S, D) -> (B, H, L, D).

    `int8_qk=True` selects the int8 path (see module docstring); `backend` forces one backend of
    the selected path.
    """
    check_arguments(q, k, v, mask)
    registry = ATTENTION_INT8 if int8_qk else ATTENTION
    return registry(q, k, v, mask=mask, scale=scale, backend=backend)


# Block-sparse attention -----------------------------------------------------------------------------
#
# block_sparse_attention(q, k, v, ...) over (B, heads, tokens, head_dim) tensors cut into tiles of
# SPARSE_TILE consecutive rows. Each query tile attends exactly to a chosen set of key tiles:
#   - ranked by the tile-mean score q_mean(i) . k_mean(j) * scale, either the top `keep_ratio` of the
#     tiles outside the sinks (ties at the cut are kept) or, when keep_ratio is 0, every tile whose
#     centred tile-mean score exceeds `tau` standard deviations of that row's proxy scores (Sol-Attn);
#   - always the diagonal tile and its two neighbours, the sink key tiles [sink_blocks) and, for the
#     query tiles in [sink_rows), every tile (those rows are dense).
# With `pooled_tail`, every tile not chosen still enters the softmax as one pooled key (its mean key,
# scored once per query tile) carrying its summed values, so no key leaves the denominator. Without it
# the softmax runs over the chosen tiles only (VSA's fine branch). `coarse_gate` adds VSA's coarse
# branch: gate * softmax(q_mean k_mean^T * scale) v_mean, the output of a row's tile. `tile_len` says
# how many rows at the front of each tile are live; the rest are padding: never keys, and their
# output rows are meaningless. The arithmetic is float32.
#
# Backends (registry `block_sparse_attention`):
#   blockwise  never holds more than a bounded working set beyond the output: per head, it chooses the
#              key tiles of a chunk of query tiles at a time, then gathers each group's chosen tiles a
#              few at a time into reused buffers and folds them into an online softmax; nothing it
#              holds grows with the square of the sequence
#   eager      the reference: the full masked score matrix of each head

SPARSE_TILE = 64
_LOG2E = 1.4426950408889634
# Bytes the blockwise backend's gathered keys, values and scores may take at once (cut from the
# output's spare rows when it is float32), a sixteenth of it for a chunk's tile choice. On the CPU,
# 1 MiB keeps VSA at 49,152 tokens near 0.23x dense SDPA's time and below its peak memory
# (bench/sparse_attention.py).
SPARSE_WORKING_BYTES = {"cpu": 1 << 20}
SPARSE_WORKING_BYTES_DEFAULT = 256 << 20


def _tile_rows(tokens: int, tiles: int, tile_len: torch.Tensor | None,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths (tiles,) float32, live (tiles * 64,) bool): the live rows of each tile, which come first in it.

    A tile holds SPARSE_TILE rows but the last one only what remains of the sequence; `tile_len`, when
    given, can only lower that, and never below one row.
    """
    room = (tokens - SPARSE_TILE * torch.arange(tiles, device=device)).clamp(max=SPARSE_TILE).float()
    if tile_len is not None:
        if tile_len.numel() != tiles:
            raise ValueError(f"block_sparse_attention: tile_len has {tile_len.numel()} entries for {tiles} tiles "
                             f"of {tokens} tokens")
        room = torch.minimum(room, tile_len.reshape(-1).to(device=device, dtype=torch.float32).clamp(min=1))
    slot_in_tile = torch.arange(SPARSE_TILE, device=device)
    return room, (slot_in_tile < room.unsqueeze(1)).reshape(-1)


def _tile_means(x: torch.Tensor, live: torch.Tensor | None, lengths: torch.Tensor) -> torch.Tensor:
    """(N*64, D) rows -> (N, D) float32 mean over each tile's live rows (every row when `live` is None).

    The live rows are summed by a product with the 0/1 mask, so no masked copy of x is made.
    """
    per_tile = x.view(lengths.numel(), SPARSE_TILE, x.shape[-1]).float()     # (N, 64, D)
    if live is None:
        return per_tile.sum(dim=1).div_(SPARSE_TILE)
    weight = live.view(-1, SPARSE_TILE).to(per_tile.dtype)                   # (N, 64)
    return torch.einsum("nr,nrd->nd", weight, per_tile) / lengths.unsqueeze(1)


def _topk_count(tiles: int, ratio: float) -> int:
    """Tiles a query tile keeps by rank: round(ratio * tiles) within [1, tiles - 1]; 0 when tiles <= 1."""
    return max(0, min(tiles - 1, max(1, round(ratio * tiles))))


def _span(pair: Sequence[int] | None, tiles: int) -> tuple[int, int]:
    start, stop = (tuple(pair) + (0, 0))[:2] if pair else (0, 0)
    start, stop = max(0, min(int(start), tiles)), max(0, min(int(stop), tiles))
    return start, max(start, stop)


class _KeyTiles:
    """One head's key and value tile means, the key means centred on their mean.

    Centring shifts every score of a query by the same constant, which neither a ranking nor a
    softmax sees; the Sol-Attn threshold needs the centred form, and scores of tokens against
    `k - centre` then share one softmax with the tile scores.
    """

    def __init__(self, k_mean: torch.Tensor, v_mean: torch.Tensor | None):
        """Takes `k_mean` over: it is centred in place."""
        self.centre = k_mean.mean(dim=0)
        self.centred = k_mean.sub_(self.centre)
        self.spread = self.centred.pow(2).mean(dim=0)
        self.v_mean = v_mean

    def select(self, q_mean: torch.Tensor, first: int, *, scale: float, keep_ratio: float, tau: float,
               sink_blocks: tuple[int, int], sink_rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Choice for query tiles [first, first + R): (exact (R, N) bool, tile-mean scores (R, N), natural log)."""
        rows, tiles = q_mean.shape[0], self.centred.shape[0]
        scores = (q_mean @ self.centred.T) * scale
        s0, s1 = sink_blocks
        count = _topk_count(tiles - (s1 - s0), keep_ratio) if keep_ratio > 0 else 0
        if count:
            ranked = scores.clone()
            ranked[:, s0:s1] = float("-inf")               # sinks ride on top of the budget
            exact = ranked >= ranked.topk(count, dim=1).values[:, -1:]
        elif keep_ratio > 0:
            exact = torch.zeros_like(scores, dtype=torch.bool)
        else:
            # tau standard deviations of the proxy scores q_mean . k_mean(j) over j, in base-2 units as the
            # published threshold is stated.
            log2_scale = scale * _LOG2E
            variance = (q_mean.pow(2) * self.spread).sum(-1)
            threshold = tau * torch.sqrt(variance * log2_scale * log2_scale + 1e-6)
            exact = scores * _LOG2E > threshold[:, None]
        own = torch.arange(first, first + rows, device=q_mean.device)[:, None]
        band = (own + torch.tensor([-1, 0, 1], device=q_mean.device)).clamp_(0, tiles - 1)
        exact.scatter_(1, band, True)
        exact[:, s0:s1] = True
        r0, r1 = (min(max(r - first, 0), rows) for r in sink_rows)
        exact[r0:r1] = True
        return exact, scores


def select_tiles(q_mean: torch.Tensor, k_mean: torch.Tensor, *, scale: float, keep_ratio: float, tau: float,
                 sink_blocks: tuple[int, int], sink_rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's tile choice: (exact (N, N) bool, tile-mean scores (N, N) of the keys centred on their mean).

    q_mean, k_mean: (N, D) float32 tile means. See the section comment for the rules.
    """
    keys = _KeyTiles(k_mean.clone(), None)
    return keys.select(q_mean, 0, scale=scale, keep_ratio=keep_ratio, tau=tau, sink_blocks=sink_blocks,
                       sink_rows=sink_rows)


def _prepare(q, k, v, tile_len, coarse_gate, sink_blocks, sink_rows, scale):
    batch, heads, tokens, dim = q.shape
    tiles = -(-tokens // SPARSE_TILE)
    padded = tiles * SPARSE_TILE
    lengths, live = _tile_rows(tokens, tiles, tile_len, q.device)
    if padded != tokens:   # a ragged last tile: pad it; its padding rows are dead
        q, k, v = (F.pad(t, (0, 0, 0, padded - tokens)) for t in (q, k, v))
        if coarse_gate is not None:
            coarse_gate = F.pad(coarse_gate, (0, 0, 0, padded - tokens))
    scale = float(scale if scale is not None else dim ** -0.5)
    return q, k, v, coarse_gate, lengths, live, tiles, _span(sink_blocks, tiles), _span(sink_rows, tiles), scale


def _block_sparse_check(q, k, v, **kwargs) -> str | None:
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    return None


def block_sparse_eager(q, k, v, *, keep_ratio=0.0, tau=1.0, sink_blocks=None, sink_rows=None, tile_len=None,
                       pooled_tail=True, coarse_gate=None, scale=None) -> torch.Tensor:
    """The reference: each head's full score matrix, masked to the chosen tiles."""
    tokens = q.shape[2]
    out_dtype = v.dtype
    q, k, v, gate, lengths, live, tiles, sinks, rows, scale = _prepare(q, k, v, tile_len, coarse_gate,
                                                                       sink_blocks, sink_rows, scale)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    tile_of_row = torch.arange(tiles * SPARSE_TILE, device=q.device) // SPARSE_TILE
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            qh, kh, vh = q[b, h].float(), k[b, h].float(), v[b, h].float()
            q_mean = _tile_means(qh, live, lengths)
            keys = _KeyTiles(_tile_means(kh, live, lengths), _tile_means(vh, live, lengths))
            exact, scores = keys.select(q_mean, 0, scale=scale, keep_ratio=keep_ratio, tau=tau,
                                        sink_blocks=sinks, sink_rows=rows)
            token_scores = (qh @ (kh - keys.centre).T) * scale
            keep = exact[tile_of_row][:, tile_of_row] & live[None, :]
            token_scores = token_scores.masked_fill(~keep, float("-inf"))
            values = vh
            if pooled_tail:
                # One pooled key per tile not chosen; it stands for `length` keys of the tile's mean value.
                tail = scores[tile_of_row].masked_fill(exact[tile_of_row], float("-inf"))
                tail = tail + torch.log(lengths)[None, :]
                token_scores = torch.cat([token_scores, tail], dim=1)
                values = torch.cat([values, keys.v_mean], dim=0)
            result = torch.softmax(token_scores, dim=-1) @ values
            if gate is not None:
                coarse = torch.softmax(scores, dim=-1) @ keys.v_mean   # centring leaves a softmax unchanged
                result = result + gate[b, h].float() * coarse[tile_of_row]
            out[b, h] = result
    return out[:, :, :tokens].to(out_dtype)


def _working_bytes(device: torch.device) -> int:
    return SPARSE_WORKING_BYTES.get(device.type, SPARSE_WORKING_BYTES_DEFAULT)


# Bytes per (query tile, key tile) entry of a chunk's selection: scores, their ranked copy, the choice,
# the coarse softmax and the choice as bytes for ordering.
_SELECTION_ENTRY_BYTES = 16


def block_sparse_blockwise(q, k, v, *, keep_ratio=0.0, tau=1.0, sink_blocks=None, sink_rows=None, tile_len=None,
                           pooled_tail=True, coarse_gate=None, scale=None) -> torch.Tensor:
    """Chooses a chunk of query tiles at a time, then gathers their chosen key tiles, a bounded number at a
    time, into an online softmax. Nothing it holds grows with the square of the sequence."""
    tokens, dim = q.shape[2], q.shape[3]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    q, k, v, gate, lengths, live, tiles, sinks, rows, scale = _prepare(q, k, v, tile_len, coarse_gate,
                                                                       sink_blocks, sink_rows, scale)
    budget = _working_bytes(q.device)
    every_row_live = bool(live.all())
    # 0 for a live key, -inf for a padding row; row `tiles` is the dead tile that pads short choices.
    key_bias = torch.zeros(tiles + 1, SPARSE_TILE, device=q.device)
    key_bias[:tiles].masked_fill_(~live.view(tiles, SPARSE_TILE), float("-inf"))
    key_bias[tiles] = float("-inf")
    plan = _Plan(tiles=tiles, tokens=tokens, dim=dim, budget=budget, scale=scale, keep_ratio=keep_ratio, tau=tau,
                 sinks=sinks, rows=rows, lengths=lengths, live=None if every_row_live else live, key_bias=key_bias,
                 log_lengths=torch.log(lengths) if pooled_tail else None,
                 workspace=_Workspace(out, k.dtype, dim, budget))
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            written = (b * q.shape[1] + h) * tokens * dim      # output elements before this head's rows
            head_gate = gate[b, h] if gate is not None else None
            _blockwise_head(plan, q[b, h], k[b, h], v[b, h], head_gate, out[b, h], written)
    return out


@dataclass
class _Plan:
    """What every head of one blockwise call shares."""

    tiles: int
    tokens: int
    dim: int
    budget: int
    scale: float
    keep_ratio: float
    tau: float
    sinks: tuple[int, int]
    rows: tuple[int, int]
    lengths: torch.Tensor
    live: torch.Tensor | None                 # None: every row of every tile is live
    key_bias: torch.Tensor
    log_lengths: torch.Tensor | None          # None: no pooled tail
    workspace: _Workspace

    @property
    def chunk(self) -> int:
        """Query tiles whose choice is made at once: a sixteenth of the budget (the gathered tiles take the
        output's spare rows, or the rest)."""
        return max(1, min(self.tiles, self.budget // 16 // (self.tiles * _SELECTION_ENTRY_BYTES)))


def _blockwise_head(plan: _Plan, qh, kh, vh, gate, out_h, written: int) -> None:
    """One head: its (tokens, D) output rows into `out_h`; `written` output elements precede them."""
    tiles, dim = plan.tiles, plan.dim
    tile_cost = _Workspace.tile_elements(dim) * 4
    keys = _KeyTiles(_tile_means(kh, plan.live, plan.lengths), _tile_means(vh, plan.live, plan.lengths))
    k_tiles, v_tiles = kh.view(tiles, SPARSE_TILE, dim), vh.view(tiles, SPARSE_TILE, dim)
    for c0 in range(0, tiles, plan.chunk):
        c1 = min(tiles, c0 + plan.chunk)
        span = slice(c0 * SPARSE_TILE, c1 * SPARSE_TILE)
        q_mean = _tile_means(qh[span], None if plan.live is None else plan.live[span], plan.lengths[c0:c1])
        exact, scores = keys.select(q_mean, c0, scale=plan.scale, keep_ratio=plan.keep_ratio, tau=plan.tau,
                                    sink_blocks=plan.sinks, sink_rows=plan.rows)
        tail = None
        if plan.log_lengths is not None:
            tail = (scores + plan.log_lengths).masked_fill_(exact, float("-inf"))
        coarse = torch.softmax(scores, dim=-1) @ keys.v_mean if gate is not None else None
        counts = exact.sum(dim=1)
        # Dense query rows (sink_rows) want every tile, the others their few: separate groups.
        bounds = sorted({c0, c1, *(r for r in plan.rows if c0 < r < c1)})
        for lo, hi in zip(bounds, bounds[1:]):
            part = slice(lo - c0, hi - c0)
            width = int(counts[part].max())
            # Each query tile's chosen tiles first, then the dead tile (any order: the softmax is online).
            order = exact[part].to(torch.uint8).topk(width, dim=1)
            chosen = order.indices.masked_fill_(order.values == 0, tiles)
            per_group = max(1, min(width, plan.budget // tile_cost))
            group_tiles = max(1, min(hi - lo, plan.budget // (tile_cost * per_group)))
            for start in range(lo, hi, group_tiles):
                stop = min(hi, start + group_tiles)
                group = slice(start - c0, stop - c0)
                first, last = start * SPARSE_TILE, min(stop * SPARSE_TILE, plan.tokens)
                space, step = plan.workspace.space(written + last * dim, stop - start, per_group)
                queries = qh[first:stop * SPARSE_TILE].float()
                result = _attend_group(queries, keys, chosen[start - lo:stop - lo], k_tiles, v_tiles,
                                       plan.key_bias, plan.scale, step, None if tail is None else tail[group],
                                       space)
                if coarse is not None:
                    rows_gate = gate[first:stop * SPARSE_TILE].float()
                    result.addcmul_(rows_gate.view(-1, SPARSE_TILE, dim), coarse[group, None])
                if last > first:
                    out_h[first:last] = result.view(-1, dim)[:last - first]


class _GatherSpace:
    """Buffers for one step's gathered key and value tiles and their float32 scores."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor):
        self.keys, self.values, self.scores = keys, values, scores

    @classmethod
    def allocate(cls, tiles: int, dim: int, dtype: torch.dtype, device: torch.device) -> "_GatherSpace":
        keys = torch.empty(tiles * SPARSE_TILE * dim, dtype=dtype, device=device)
        return cls(keys, torch.empty_like(keys), torch.empty(tiles * SPARSE_TILE * SPARSE_TILE, device=device))

    @classmethod
    def within(cls, region: torch.Tensor, tiles: int, dim: int) -> "_GatherSpace":
        """Views of a float32 region of `tiles * _Workspace.tile_elements(dim)` elements."""
        rows = tiles * SPARSE_TILE * dim
        return cls(region[:rows], region[rows:2 * rows], region[2 * rows:])


def _gather_tiles(source: torch.Tensor, index: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """source (N, 64, D) tiles at `index` (G, S), copied into the front of the flat buffer `into`
    -> (G, S*64, D) float32."""
    group, count = index.shape
    rows = into[:group * count * SPARSE_TILE * source.shape[-1]].view(group * count, SPARSE_TILE, -1)
    torch.index_select(source, 0, index.flatten(), out=rows)
    return rows.float().view(group, count * SPARSE_TILE, -1)


class _Workspace:
    """Where each step's gathered tiles and scores live.

    A float32 output has room to spare: the elements after the rows being computed are not written
    until the call reaches them, and will be touched by then anyway, so buffers cut from there cost no
    memory beyond the output. Near the output's end the steps shrink to fit, down to one key tile, and
    only the last few groups take a small allocation. Other output dtypes use one buffer allocated on
    first need and reused.
    """

    def __init__(self, out: torch.Tensor, key_dtype: torch.dtype, dim: int, budget: int):
        self.flat = out.view(-1) if out.dtype == key_dtype == torch.float32 and out.is_contiguous() else None
        self.dim, self.key_dtype, self.device = dim, key_dtype, out.device
        self.most = max(1, budget // (self.tile_elements(dim) * 4))
        self.own: _GatherSpace | None = None

    @staticmethod
    def tile_elements(dim: int) -> int:
        """Elements one gathered key tile takes: its keys, its values and one score row per query row."""
        return SPARSE_TILE * (2 * dim + SPARSE_TILE)

    def space(self, after: int, group: int, per_group: int) -> tuple[_GatherSpace, int]:
        """Buffers for `group` query tiles taking up to `per_group` key tiles a step, and the key tiles a
        step they hold; output elements from `after` on are free."""
        per_tile = self.tile_elements(self.dim) * group
        if self.flat is not None:
            fit = min(per_group, (self.flat.numel() - after) // per_tile)
            if fit >= 1:
                return _GatherSpace.within(self.flat[after:after + fit * per_tile], group * fit, self.dim), fit
            return _GatherSpace.allocate(group, self.dim, self.key_dtype, self.device), 1
        if self.own is None:
            self.own = _GatherSpace.allocate(max(self.most, group * per_group), self.dim, self.key_dtype,
                                             self.device)
        return self.own, per_group


def _attend_group(queries: torch.Tensor, keys: _KeyTiles, chosen: torch.Tensor, k_tiles, v_tiles,
                  key_bias: torch.Tensor, scale: float, per_group: int, tail: torch.Tensor | None,
                  space: _GatherSpace) -> torch.Tensor:
    """(G*64, D) float32 query rows over their chosen key tiles (G, W), `per_group` tiles at a time, folded
    into an online softmax; `tail` (G, N) adds the pooled keys of the tiles not chosen. Returns (G, 64, D)."""
    dim = queries.shape[-1]
    group = chosen.shape[0]
    queries = queries.view(group, SPARSE_TILE, dim)
    dead = k_tiles.shape[0]
    # Scores against centred keys: q . (k - c) = q . k - q . c, one constant per query row.
    shift = (queries @ keys.centre)[..., None].mul_(-scale)            # (G, 64, 1)
    running_max = torch.full((group, SPARSE_TILE, 1), -1e30, device=queries.device)
    running_sum = torch.zeros((group, SPARSE_TILE, 1), device=queries.device)
    acc = torch.zeros((group, SPARSE_TILE, dim), device=queries.device)
    width = chosen.shape[1]
    for s0 in range(0, width, per_group):
        index = chosen[:, s0:s0 + per_group]                            # (G, S)
        real = index.clamp(max=dead - 1)                                # the dead tile reads any keys, masked
        gathered_keys = _gather_tiles(k_tiles, real, space.keys)       # (G, S*64, D)
        values = _gather_tiles(v_tiles, real, space.values)
        scores = space.scores[:queries.numel() // dim * gathered_keys.shape[1]].view(group, SPARSE_TILE, -1)
        torch.baddbmm(shift, queries, gathered_keys.transpose(1, 2), alpha=scale, out=scores)   # (G, 64, S*64)
        scores.add_(key_bias[index].view(group, 1, -1))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        correction = (running_max - new_max).exp_()
        scores.sub_(new_max).exp_()
        running_sum.mul_(correction).add_(scores.sum(dim=-1, keepdim=True))
        acc.mul_(correction).baddbmm_(scores, values)
        running_max = new_max
    if tail is not None:
        # The tiles not chosen, one pooled key each, weighted by their live rows.
        tail = tail[:, None, :]                                         # (G, 1, N)
        new_max = torch.maximum(running_max, tail.amax(dim=-1, keepdim=True))
        correction = (running_max - new_max).exp_()
        weights = (tail - new_max).exp_()                               # (G, 64, N)
        running_sum.mul_(correction).add_(weights.sum(dim=-1, keepdim=True))
        acc.mul_(correction).add_(weights @ keys.v_mean)
    return acc.div_(running_sum.clamp_min(1e-30))


BLOCK_SPARSE = KernelRegistry("block_sparse_attention")
BLOCK_SPARSE.register("blockwise", block_sparse_blockwise, check=_block_sparse_check)
BLOCK_SPARSE.register("eager", block_sparse_eager)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, keep_ratio: float = 0.0,
                           tau: float = 1.0, sink_blocks: Sequence[int] | None = None,
                           sink_rows: Sequence[int] | None = None, tile_len: torch.Tensor | None = None,
                           pooled_tail: bool = True, coarse_gate: torch.Tensor | None = None,
                           scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Block-sparse self-attention over (B, heads, tokens, head_dim) tiles of 64 rows (see the section comment).

    keep_ratio > 0 ranks key tiles (SLA / VSA), else `tau` thresholds them (Sol-Attn); sink_blocks and
    sink_rows are (first, stop) tile ranges; tile_len (tiles,) live rows per tile; coarse_gate
    (B, heads, tokens, head_dim) adds VSA's coarse branch. Returns (B, heads, tokens, head_dim) in v's dtype.
    """
    check_arguments(q, k, v, None)
    if q.shape != k.shape:
        raise ValueError(f"block_sparse_attention is self-attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ")
    if coarse_gate is not None and coarse_gate.shape != q.shape:
        raise ValueError(f"block_sparse_attention: coarse_gate {tuple(coarse_gate.shape)} must match q {tuple(q.shape)}")
    if not 0.0 <= keep_ratio <= 1.0:
        raise ValueError(f"block_sparse_attention: keep_ratio must be within [0, 1], got {keep_ratio}")
    return BLOCK_SPARSE(q, k, v, keep_ratio=keep_ratio, tau=tau, sink_blocks=sink_blocks, sink_rows=sink_rows,
                        tile_len=tile_len, pooled_tail=pooled_tail, coarse_gate=coarse_gate, scale=scale,
                        backend=backend)
