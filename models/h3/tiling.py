"""Overlapping tiles with linear blending, shared by the video VAE's encode/decode and any VAE that wants them.

A 1-D plan covers `length` with tiles of `tile` units overlapping by at least `min_overlap`; the overlap
left over when the tiles do not fit exactly is spread over the seams in steps of `step` units. Blending
weights ramp linearly across the middle half of each seam and are 0 (or 1) over its outer quarters, so a
tile's outermost o/4 units (where a decoder sees the tile border) never reach the output, and where two
tiles meet their weights sum to 1: a decoder whose receptive field is under a quarter of the overlap
gives exactly the untiled result. Tiles are accumulated as `tile * weight` into one zero canvas; when a large leftover
makes three tiles overlap, dividing by the (separable, H x W only) weight sum keeps the blend exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TilePlan:
    """Tiles along one axis: `starts[i]`, `size` each, `overlaps[i]` between tile i and i + 1."""
    length: int
    size: int
    starts: tuple[int, ...]
    overlaps: tuple[int, ...]

    def weights(self, i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Blend weights (size,) of tile i: rising over the seam with the previous tile, falling over the next."""
        w = torch.ones(self.size, dtype=dtype)
        if i > 0:
            o = self.overlaps[i - 1]
            w[:o] = _ramp(o, dtype)
        if i < len(self.starts) - 1:
            o = self.overlaps[i]
            w[self.size - o:] = torch.minimum(w[self.size - o:], 1.0 - _ramp(o, dtype))
        return w

    def weight_sum(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(length,) sum of all tiles' weights: 1 wherever at most two tiles overlap."""
        total = torch.zeros(self.length, dtype=dtype)
        for i, start in enumerate(self.starts):
            total[start:start + self.size] += self.weights(i, dtype)
        return total

    @property
    def exact(self) -> bool:
        """True when weights already sum to 1 everywhere (no normalisation needed)."""
        return bool(torch.allclose(self.weight_sum(torch.float64), torch.ones(self.length, dtype=torch.float64)))

    def scaled(self, factor: float) -> "TilePlan":
        """The same plan in other units (e.g. latent pixels -> pixels with factor 16)."""
        f = lambda v: int(round(v * factor))  # noqa: E731
        return TilePlan(f(self.length), f(self.size), tuple(f(s) for s in self.starts), tuple(f(o) for o in self.overlaps))


def _ramp(overlap: int, dtype: torch.dtype) -> torch.Tensor:
    # 0 over the first quarter, linear over the middle half, 1 over the last quarter of the seam.
    margin = overlap // 4
    length = overlap - 2 * margin
    k = torch.arange(overlap, dtype=dtype)
    return ((k - margin + 1) / (length + 1)).clamp(0.0, 1.0)


def plan_tiles(length: int, tile: int, min_overlap: int, step: int = 1) -> TilePlan:
    """Cover `length` units with tiles of `tile` units overlapping by >= `min_overlap`, spreading the leftover in `step`s."""
    if tile >= length:
        return TilePlan(length, length, (0,), ())
    if min_overlap >= tile:
        raise ValueError(f"tile overlap {min_overlap} must be smaller than the tile size {tile}")
    count = math.ceil(length / tile)
    while True:
        overlaps = [min_overlap] * (count - 1)
        leftover = tile * count - sum(overlaps) - length
        if leftover >= 0:
            break
        count += 1
    for k in range(leftover // step):
        overlaps[k % (count - 1)] += step
    # A leftover that is not a whole number of steps goes to the first seam.
    overlaps[0] += leftover % step
    starts = [0]
    for o in overlaps:
        starts.append(starts[-1] + tile - o)
    return TilePlan(length, tile, tuple(starts), tuple(overlaps))


def blend_weights_2d(plan_h: TilePlan, plan_w: TilePlan, i: int, j: int) -> torch.Tensor:
    """(size_h, size_w) blend weights of tile (i, j)."""
    return plan_h.weights(i)[:, None] * plan_w.weights(j)[None, :]


def normalise(canvas: torch.Tensor, plan_h: TilePlan, plan_w: TilePlan) -> torch.Tensor:
    """Divide an accumulated canvas (..., H, W) by the weight sum, in place, when it is not 1 everywhere."""
    if not (plan_h.exact and plan_w.exact):
        total = plan_h.weight_sum()[:, None] * plan_w.weight_sum()[None, :]
        canvas /= total.to(canvas.device, canvas.dtype)
    return canvas
