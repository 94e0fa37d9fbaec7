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
#   blockwise  never holds more than a bounded working set beyond the output: per head, per group of
#              query tiles, it gathers the chosen key tiles a few at a time and folds them into an
#              online softmax; memory O(tokens * head_dim)
#   eager      the reference: the full masked score matrix of each head

SPARSE_TILE = 64
_LOG2E = 1.4426950408889634
# Bytes the blockwise backend's gathered keys, values and scores may take at once.
SPARSE_WORKING_BYTES = {"cpu": 4 << 20}
SPARSE_WORKING_BYTES_DEFAULT = 256 << 20


def _tile_lengths(tokens: int, tiles: int, tile_len: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(tiles,) float32 live rows per tile: `tile_len` clamped to [1, rows the tile has], else full tiles."""
    last = tokens - (tiles - 1) * SPARSE_TILE
    if tile_len is None:
        lengths = torch.full((tiles,), float(SPARSE_TILE), device=device)
    else:
        if tile_len.numel() != tiles:
            raise ValueError(f"block_sparse_attention: tile_len has {tile_len.numel()} entries for {tiles} tiles "
                             f"of {tokens} tokens")
        lengths = tile_len.to(device=device, dtype=torch.float32).flatten().clamp(1, SPARSE_TILE)
    if last < SPARSE_TILE:
        lengths = lengths.clone()
        lengths[-1] = lengths[-1].clamp(max=last)
    return lengths


def _live_rows(padded_tokens: int, lengths: torch.Tensor) -> torch.Tensor:
    """(padded_tokens,) bool: whether each row sits in the live front part of its tile."""
    rows = torch.arange(padded_tokens, device=lengths.device)
    return (rows % SPARSE_TILE) < lengths[rows // SPARSE_TILE]


def _tile_means(x: torch.Tensor, live: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(N*64, D) rows -> (N, D) float32 mean over each tile's live rows, without a masked copy of x."""
    tiles = lengths.numel()
    weights = live.view(tiles, 1, SPARSE_TILE)
    sums = torch.bmm(weights.float(), x.view(tiles, SPARSE_TILE, -1).float()).squeeze(1)
    return sums / lengths[:, None]


def _topk_count(tiles: int, ratio: float) -> int:
    """Tiles a query tile keeps by rank: round(ratio * tiles) within [1, tiles - 1]; 0 when tiles <= 1."""
    return max(0, min(tiles - 1, max(1, round(ratio * tiles))))


def _span(pair: Sequence[int] | None, tiles: int) -> tuple[int, int]:
    start, stop = (tuple(pair) + (0, 0))[:2] if pair else (0, 0)
    start, stop = max(0, min(int(start), tiles)), max(0, min(int(stop), tiles))
    return start, max(start, stop)


def select_tiles(q_mean: torch.Tensor, k_mean: torch.Tensor, *, scale: float, keep_ratio: float, tau: float,
                 sink_blocks: tuple[int, int], sink_rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's tile choice: (exact (N, N) bool, tile-mean scores (N, N) of the keys centred on their mean).

    q_mean, k_mean: (N, D) float32 tile means. See the section comment for the rules.
    """
    tiles = q_mean.shape[0]
    centred = k_mean - k_mean.mean(dim=0, keepdim=True)   # shifts each row by a constant; the tail needs it
    scores = (q_mean @ centred.T) * scale                  # natural-log units
    s0, s1 = sink_blocks
    if keep_ratio > 0:
        ranked = scores.clone()
        ranked[:, s0:s1] = float("-inf")                   # sinks ride on top of the budget
        count = _topk_count(tiles - (s1 - s0), keep_ratio)
        if count:
            exact = ranked >= ranked.topk(count, dim=1).values[:, -1:]
        else:
            exact = torch.zeros_like(ranked, dtype=torch.bool)
    else:
        # tau standard deviations of the proxy scores q_mean . k_mean(j) over j, in base-2 units as the
        # published threshold is stated.
        log2_scale = scale * _LOG2E
        variance = (q_mean.pow(2) * centred.pow(2).mean(dim=0)).sum(-1)
        threshold = tau * torch.sqrt(variance * log2_scale * log2_scale + 1e-6)
        exact = scores * _LOG2E > threshold[:, None]
    index = torch.arange(tiles, device=q_mean.device)
    exact |= (index[None, :] - index[:, None]).abs() <= 1
    exact[:, s0:s1] = True
    r0, r1 = sink_rows
    exact[r0:r1, :] = True
    return exact, scores


def _coarse_rows(q_mean: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor, scale: float) -> torch.Tensor:
    """VSA's coarse branch per tile: softmax(q_mean k_mean^T * scale) v_mean, (N, D) float32."""
    return torch.softmax((q_mean @ k_mean.T) * scale, dim=-1) @ v_mean


class _HeadTiles:
    """One head's q, k, v as tiles with their means and choice, shared by both backends."""

    def __init__(self, q, k, v, lengths, live, *, scale, keep_ratio, tau, sink_blocks, sink_rows):
        self.q, self.k, self.v = q, k, v                     # (N*64, D), padded to whole tiles
        self.q_mean = _tile_means(q, live, lengths)
        self.k_mean = _tile_means(k, live, lengths)
        self.v_mean = _tile_means(v, live, lengths)
        self.exact, self.scores = select_tiles(self.q_mean, self.k_mean, scale=scale, keep_ratio=keep_ratio,
                                               tau=tau, sink_blocks=sink_blocks, sink_rows=sink_rows)
        # Token scores are centred on the same mean key as the tile scores, so both share one softmax.
        self.key_centre = self.k_mean.mean(dim=0)


def _prepare(q, k, v, tile_len, coarse_gate, sink_blocks, sink_rows, scale):
    batch, heads, tokens, dim = q.shape
    tiles = -(-tokens // SPARSE_TILE)
    padded = tiles * SPARSE_TILE
    lengths = _tile_lengths(tokens, tiles, tile_len, q.device)
    live = _live_rows(padded, lengths)
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
            head = _HeadTiles(q[b, h].float(), k[b, h].float(), v[b, h].float(), lengths, live, scale=scale,
                              keep_ratio=keep_ratio, tau=tau, sink_blocks=sinks, sink_rows=rows)
            token_scores = (head.q @ (head.k - head.key_centre).T) * scale
            keep = head.exact[tile_of_row][:, tile_of_row] & live[None, :]
            token_scores = token_scores.masked_fill(~keep, float("-inf"))
            values = head.v
            if pooled_tail:
                # One pooled key per tile not chosen; it stands for `length` keys of the tile's mean value.
                tail = head.scores[tile_of_row].masked_fill(head.exact[tile_of_row], float("-inf"))
                tail = tail + torch.log(lengths)[None, :]
                token_scores = torch.cat([token_scores, tail], dim=1)
                values = torch.cat([values, head.v_mean], dim=0)
            result = torch.softmax(token_scores, dim=-1) @ values
            if gate is not None:
                coarse = _coarse_rows(head.q_mean, head.k_mean, head.v_mean, scale)
                result = result + gate[b, h].float() * coarse[tile_of_row]
            out[b, h] = result
    return out[:, :, :tokens].to(out_dtype)


def _working_bytes(device: torch.device) -> int:
    return SPARSE_WORKING_BYTES.get(device.type, SPARSE_WORKING_BYTES_DEFAULT)


def block_sparse_blockwise(q, k, v, *, keep_ratio=0.0, tau=1.0, sink_blocks=None, sink_rows=None, tile_len=None,
                           pooled_tail=True, coarse_gate=None, scale=None) -> torch.Tensor:
    """Gathers only the chosen key tiles, a bounded number at a time, into an online softmax."""
    tokens, dim = q.shape[2], q.shape[3]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    q, k, v, gate, lengths, live, tiles, sinks, rows, scale = _prepare(q, k, v, tile_len, coarse_gate,
                                                                       sink_blocks, sink_rows, scale)
    budget = _working_bytes(q.device)
    # Per gathered key tile: its keys and values (float32) and one score row per query row.
    tile_cost = SPARSE_TILE * (2 * dim + SPARSE_TILE) * 4
    live_keys = live.view(tiles, SPARSE_TILE)
    log_lengths = torch.log(lengths)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            head = _HeadTiles(q[b, h], k[b, h], v[b, h], lengths, live, scale=scale, keep_ratio=keep_ratio,
                              tau=tau, sink_blocks=sinks, sink_rows=rows)
            counts = head.exact.sum(dim=1)
            k_tiles = head.k.view(tiles, SPARSE_TILE, dim)
            v_tiles = head.v.view(tiles, SPARSE_TILE, dim)
            coarse = _coarse_rows(head.q_mean, head.k_mean, head.v_mean, scale) if gate is not None else None
            # Dense query rows (sink_rows) want every tile; the others their few. Keep them in separate groups.
            bounds = sorted({0, tiles, *rows})
            for lo, hi in zip(bounds, bounds[1:]):
                width = int(counts[lo:hi].max())
                # Each query tile's chosen tiles first (any order: the softmax is folded online).
                chosen = head.exact[lo:hi].to(torch.uint8).topk(width, dim=1).indices
                per_group = max(1, min(width, budget // tile_cost))
                group_tiles = max(1, min(hi - lo, budget // (tile_cost * per_group)))
                for start in range(lo, hi, group_tiles):
                    stop = min(hi, start + group_tiles)
                    result = _attend_group(head, start, stop, chosen[start - lo:stop - lo], counts[start:stop],
                                           k_tiles, v_tiles, live_keys, scale, per_group,
                                           log_lengths if pooled_tail else None, dim)
                    if coarse is not None:
                        rows_gate = gate[b, h, start * SPARSE_TILE:stop * SPARSE_TILE].float()
                        result = result.view(-1, SPARSE_TILE, dim).addcmul_(
                            rows_gate.view(-1, SPARSE_TILE, dim), coarse[start:stop, None]).view(-1, dim)
                    first, last = start * SPARSE_TILE, min(stop * SPARSE_TILE, tokens)
                    if last > first:
                        out[b, h, first:last] = result[:last - first].to(out.dtype)
    return out


def _attend_group(head: _HeadTiles, start: int, stop: int, chosen: torch.Tensor, counts: torch.Tensor,
                  k_tiles, v_tiles, live_keys, scale: float, per_group: int, log_lengths, dim: int) -> torch.Tensor:
    """Rows of query tiles [start, stop): online softmax over their chosen key tiles, `per_group` tiles at a time."""
    group = stop - start
    queries = head.q[start * SPARSE_TILE:stop * SPARSE_TILE].float().view(group, SPARSE_TILE, dim)
    # Scores against centred keys: q . (k - c) = q . k - q . c, one constant per query row.
    shift = (queries @ head.key_centre)[..., None]                      # (G, 64, 1)
    running_max = torch.full((group, SPARSE_TILE, 1), -1e30, device=queries.device)
    running_sum = torch.zeros((group, SPARSE_TILE, 1), device=queries.device)
    acc = torch.zeros((group, SPARSE_TILE, dim), device=queries.device)
    width = chosen.shape[1]
    slots = torch.arange(width, device=chosen.device)
    for s0 in range(0, width, per_group):
        s1 = min(width, s0 + per_group)
        index = chosen[:, s0:s1]                                          # (G, S)
        usable = (slots[s0:s1][None, :] < counts[:, None])                # (G, S)
        keys = k_tiles[index].float().view(group, -1, dim)                # (G, S*64, D)
        values = v_tiles[index].float().view(group, -1, dim)
        scores = torch.baddbmm(-shift * scale, queries, keys.transpose(1, 2), alpha=scale)   # (G, 64, S*64)
        valid = (live_keys[index] & usable[..., None]).view(group, 1, -1)
        scores.masked_fill_(~valid, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        correction = torch.exp(running_max - new_max)
        scores.sub_(new_max).exp_()
        running_sum.mul_(correction).add_(scores.sum(dim=-1, keepdim=True))
        acc.mul_(correction).baddbmm_(scores, values)
        running_max = new_max
    if log_lengths is not None:
        # The tiles not chosen, one pooled key each, weighted by their live rows.
        tail = head.scores[start:stop] + log_lengths[None, :]            # (G, N)
        tail = tail.masked_fill(head.exact[start:stop], float("-inf"))[:, None, :]   # (G, 1, N)
        new_max = torch.maximum(running_max, tail.amax(dim=-1, keepdim=True))
        correction = torch.exp(running_max - new_max)
        weights = torch.exp(tail - new_max)                               # (G, 64, N)
        running_sum.mul_(correction).add_(weights.sum(dim=-1, keepdim=True))
        acc.mul_(correction).add_(weights @ head.v_mean)
    return (acc / running_sum.clamp_min(1e-30)).view(-1, dim)


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
