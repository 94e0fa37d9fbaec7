"""How the H3 transformer attends: the dense backend and block-sparse attention over its packed sequence.

A MODEL handle carries the choice in its options (models/patcher.py), set by the ModelAttentionBackend
and BlockSparseAttention nodes:
- `attention_backend`: "sdpa" (the default) or "int8" (q and k quantised to int8 per 64-token block,
  kernels/attention.py). int8 holds the whole score matrix, so a call whose scores would pass
  INT8_MAX_SCORE_BYTES runs SDPA instead, with a warning.
- `sparse_attention`: a `SparseAttentionSettings`. For each DiT block call it either stays dense (the
  sigma is outside the window, the sequence is short, the block is listed dense) or runs
  `kernels.attention.block_sparse_attention`:
  - "vsa": the rows are regrouped into tiles first. Each segment before the target video (text,
    condition rows, target audio) fills its own zero-padded 64-row tiles; these prefix tiles are exact
    keys for every query and their query rows are dense. The target video is cut into 4x4x4 cubes of
    its (latent t, latent h/2, latent w/2) patch grid, 64 rows each, the grid padded to whole cubes and
    each cube's live rows first. Each query tile keeps its top keep-percent tiles plus the diagonal +-1,
    with no pooled tail, and the coarse branch gated by `attn.to_gate_compress(x)` when the checkpoint
    has that layer (FastH3); without it the fine branch runs alone.
  - "sla" (top keep-percent) and "sol-attn" (tau threshold): the rows in packed order, with a pooled
    tail; `sink_conditioning` makes the rows before the video exact keys ("exact_kv"), and also runs the
    target audio's query rows dense ("exact_kv_and_rows").
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field

import torch

from kernels.attention import SPARSE_TILE
from models.h3.packing import PackedLayout, SegmentRole

logger = logging.getLogger(__name__)

SPARSE_METHODS = ("sol-attn", "sla", "vsa")
SINK_CONDITIONING = ("exact_kv", "exact_kv_and_rows", "off")
DENSE_BACKENDS = ("sdpa", "int8")
VSA_CUBE = (4, 4, 4)                 # (t, h, w) patches per cube: 64 rows, one tile
INT8_MAX_SCORE_BYTES = 1 << 30       # above this the int8 path's float32 score matrix is not worth holding
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log `message` as a warning the first time it is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def parse_block_list(text: str) -> frozenset[int]:
    """The block numbers a comma list names, a-b standing for a through b (e.g. "3, 8-10" is {3, 8, 9, 10}).

    A part that is not a number or such a run raises ValueError quoting that part.
    """
    blocks: set[int] = set()
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", part)
        if match is None:
            raise ValueError(f"{part!r} is neither a block number nor a range such as 47-49")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        blocks.update(range(min(first, last), max(first, last) + 1))
    return frozenset(blocks)


def percent_to_sigma(percent: float, shift: float) -> float:
    """The video sigma at `percent` of the way through a shifted flow schedule (1 at 0, 0 at 1)."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    base = 1.0 - percent
    return shift * base / (1.0 + (shift - 1.0) * base)


@dataclass(frozen=True)
class SparseAttentionSettings:
    """What BlockSparseAttention chose; sparse while sigma_end <= sigma <= sigma_start."""

    method: str                      # one of SPARSE_METHODS
    keep_ratio: float = 0.1          # sla / vsa: fraction of tiles kept by rank
    tau: float = 1.3                 # sol-attn: threshold in standard deviations
    sigma_start: float = 1.0
    sigma_end: float = 0.0
    min_tokens: int = 12288
    dense_blocks: frozenset[int] = field(default_factory=frozenset)
    sink_conditioning: str = "exact_kv_and_rows"
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.method not in SPARSE_METHODS:
            raise ValueError(f"sparse attention method {self.method!r} is not one of {', '.join(SPARSE_METHODS)}")
        if self.sink_conditioning not in SINK_CONDITIONING:
            raise ValueError(f"sink_conditioning {self.sink_conditioning!r} is not one of {', '.join(SINK_CONDITIONING)}")

    def dense_reason(self, sigma: float, tokens: int, block: int | None = None) -> str | None:
        """What keeps this step (or this block of it) on full attention, as a log line; None when nothing does."""
        reasons = [
            (not self.sigma_end <= sigma <= self.sigma_start,
             lambda: f"sigma {sigma:.4g} lies outside the sparse window {self.sigma_end:.4g}..{self.sigma_start:.4g}"),
            (tokens < self.min_tokens, lambda: f"the sequence has {tokens} rows, under min_tokens={self.min_tokens}"),
            (block in self.dense_blocks, lambda: f"block {block} is listed in dense_blocks"),
        ]
        return next((describe() for applies, describe in reasons if applies), None)

    def note(self, message: str) -> None:
        """Log `message` once when verbose."""
        if self.verbose and message not in _warned:
            _warned.add(message)
            logger.info("BlockSparseAttention: %s", message)


@dataclass
class TilePlan:
    """Where each row of a packed sequence goes among the tiles VSA attends over."""

    source: torch.Tensor        # (padded rows,) long: the sequence row at each padded position, -1 for padding
    position: torch.Tensor      # (rows,) long: the padded position of each sequence row
    tile_len: torch.Tensor      # (tiles,) long: how many of each tile's 64 slots hold sequence rows (they come first)
    prefix_tiles: int           # tiles before the video cubes (the sinks)

    @property
    def padded_rows(self) -> int:
        """Rows including padding (a multiple of 64)."""
        return self.source.numel()

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """(rows, ...) in sequence order -> (padded rows, ...) in tile order, padding zero."""
        out = rows.new_zeros((self.padded_rows, *rows.shape[1:]))
        out[self.position] = rows
        return out

    def scatter(self, tiled: torch.Tensor) -> torch.Tensor:
        """Inverse of gather: (padded rows, ...) -> (rows, ...) in sequence order."""
        return tiled[self.position]


def _cube_slots(grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Where VSA puts each row of a (t, h, w) patch grid stored in (t, h, w) order: (slot (rows,), live (cubes,)).

    The grid is cut into VSA_CUBE cubes, in (t, h, w) order of cube; cubes at the far edges are cut short.
    Cube c owns slots [64c, 64c + 64) and fills the first `live[c]` of them with its rows in (t, h, w)
    order, so a row's slot is 64 * its cube + its rank inside the cube's live box.
    """
    coords = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")       # 3 x (t, h, w)
    cube_index = torch.zeros(grid, dtype=torch.long)
    rank = torch.zeros(grid, dtype=torch.long)
    extents = []
    for axis, (n, side) in enumerate(zip(grid, VSA_CUBE)):
        cube_of = coords[axis] // side
        # The cube's live length along this axis: `side`, or what is left at the grid's far edge.
        extent = (n - side * torch.arange(math.ceil(n / side))).clamp(max=side)
        cube_index = cube_index * extent.numel() + cube_of
        rank = rank * extent[cube_of] + coords[axis] % side
        extents.append(extent)
    live = (extents[0][:, None, None] * extents[1][None, :, None] * extents[2][None, None, :]).reshape(-1)
    return (cube_index * SPARSE_TILE + rank).reshape(-1), live


def vsa_plan(layout: PackedLayout, latent_t: int, latent_h: int, latent_w: int) -> TilePlan:
    """The VSA tiles of a packed sequence whose target video is a (latent_t, latent_h, latent_w) latent.

    Segments before the video keep their order, each starting a fresh tile; the video follows in cubes.
    """
    grid = (latent_t, latent_h // 2, latent_w // 2)
    position = torch.empty(layout.seq_len, dtype=torch.long)
    tile_len: list[torch.Tensor] = []
    tiles_before = prefix_tiles = 0
    for seg in layout.segments:
        rows = seg.stop - seg.start
        if seg.role is SegmentRole.VIDEO:
            if rows != math.prod(grid):
                raise ValueError(f"VSA: the video segment has {rows} rows, not the {grid} patch grid")
            slot, live = _cube_slots(grid)
        elif tiles_before > prefix_tiles:
            raise ValueError(f"VSA: segment {seg.role.value} follows the target video; the layout puts the video last")
        else:
            slot = torch.arange(rows)
            live = (rows - SPARSE_TILE * torch.arange(math.ceil(rows / SPARSE_TILE))).clamp(max=SPARSE_TILE)
        position[seg.start:seg.stop] = tiles_before * SPARSE_TILE + slot
        tile_len.append(live)
        tiles_before += live.numel()
        if seg.role is not SegmentRole.VIDEO:
            prefix_tiles = tiles_before
    source = torch.full((tiles_before * SPARSE_TILE,), -1, dtype=torch.long)
    source[position] = torch.arange(layout.seq_len)
    return TilePlan(source, position, torch.cat(tile_len), prefix_tiles)


@dataclass
class SparseCall:
    """How one forward's DiT blocks attend sparsely: the settings, and the tiles or sinks of its sequence."""

    settings: SparseAttentionSettings
    plan: TilePlan | None                    # vsa only
    sink_blocks: tuple[int, int] = (0, 0)    # sla / sol-attn, in packed-row tiles
    sink_rows: tuple[int, int] = (0, 0)

    def applies(self, block: int) -> bool:
        """Whether DiT block `block` runs sparse in this forward."""
        if block in self.settings.dense_blocks:
            self.settings.note(f"block {block} is in dense_blocks")
            return False
        return True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """(rows, heads, dim) q, k, v (and gate rows) -> (rows, heads, dim) attention output."""
        from kernels.attention import block_sparse_attention

        settings = self.settings
        if self.plan is not None:
            def tiled(rows):
                return self.plan.gather(rows).transpose(0, 1)[None]     # (1, heads, padded rows, dim)

            sinks = (0, self.plan.prefix_tiles)
            out = block_sparse_attention(
                tiled(q), tiled(k), tiled(v), keep_ratio=settings.keep_ratio, sink_blocks=sinks, sink_rows=sinks,
                tile_len=self.plan.tile_len, pooled_tail=False,
                coarse_gate=tiled(gate) if gate is not None else None)
            return self.plan.scatter(out[0].transpose(0, 1))
        out = block_sparse_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)),
            keep_ratio=settings.keep_ratio if settings.method == "sla" else 0.0, tau=settings.tau,
            sink_blocks=self.sink_blocks, sink_rows=self.sink_rows, pooled_tail=True)
        return out[0].transpose(0, 1)


def sparse_call(settings: SparseAttentionSettings | None, layout: PackedLayout, sigma: float, video_shape,
                has_gate: bool, device: torch.device | str = "cpu") -> SparseCall | None:
    """The sparse attention of one forward, or None when every block of it stays dense."""
    if settings is None:
        return None
    reason = settings.dense_reason(sigma, layout.seq_len)
    if reason is not None:
        settings.note(f"dense: {reason}")
        return None
    if settings.method == "vsa":
        if not has_gate:
            warn_once("VSA without attn.to_gate_compress weights (a FastH3 checkpoint has them): attention runs "
                      "on the chosen cubes only, with no pooled view of the others")
        plan = vsa_plan(layout, *video_shape)
        plan = TilePlan(plan.source.to(device), plan.position.to(device), plan.tile_len.to(device), plan.prefix_tiles)
        settings.note(f"VSA over {layout.seq_len} rows: {plan.padded_rows} padded rows, "
                      f"{plan.prefix_tiles} prefix tiles")
        return SparseCall(settings, plan)
    video = layout.segment(SegmentRole.VIDEO)
    blocks = rows = (0, 0)
    if settings.sink_conditioning != "off" and video.start > 0:
        blocks = (0, math.ceil(video.start / SPARSE_TILE))
        if settings.sink_conditioning == "exact_kv_and_rows":
            rows = (layout.segment(SegmentRole.AUDIO).start // SPARSE_TILE, blocks[1])
    settings.note(f"{settings.method} over {layout.seq_len} rows, sinks {blocks}, dense rows {rows}")
    return SparseCall(settings, None, blocks, rows)
