"""Overlapping tiles composed in sequence, shared by the video VAE's encode/decode and any VAE that wants them.

A 1-D plan covers `length` with tiles of `tile` units overlapping by at least `min_overlap`; the overlap
left over when the tiles do not fit exactly is spread over the seams in steps of `step` units.

Composition follows the H3 reference VAEs (ComfyUI's and diffusers'): tiles are taken in raster order and
each one is cross-faded into its upper neighbour over the whole vertical overlap, then into its left
neighbour over the whole horizontal overlap, the incoming tile's weight rising linearly as k / overlap
(k = 0 .. overlap - 1) from its leading edge. Each neighbour enters as it was decoded, not as already
blended, and every output position belongs to the last tile (in raster order) that starts at or before it.
At a corner where four tiles meet, the owner (i, j) therefore mixes three tiles:

    out = wx * (wy * T[i, j] + (1 - wy) * T[i - 1, j]) + (1 - wx) * T[i, j - 1]

with T[i - 1, j - 1] absent. That is the same as every tile adding `tile * weight` into one zero canvas
with the non-separable weight map of `blend_weights_2d`, whose maps sum to exactly 1 everywhere, so tiles
can be decoded in any order and in batches.

Also here, for every decoder that sizes its work by memory: `free_bytes()` (the memory manager's figure),
`is_out_of_memory(err)`, and `measure_peak_bytes(fn, device)`, which runs `fn` and reports the most bytes
its tensors held at once (the CUDA allocator's peak on a GPU; on other devices, the live bytes of every
tensor the ops created, tracked through a dispatch mode).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class TilePlan:
    """Tiles along one axis: `starts[i]`, `size` each, `overlaps[i]` between tile i and i + 1."""
    length: int
    size: int
    starts: tuple[int, ...]
    overlaps: tuple[int, ...]

    def owned_stop(self, i: int) -> int:
        """End (tile-local) of the span tile i owns: up to where tile i + 1 starts, or its whole size if last."""
        return self.size - self.overlaps[i] if i < len(self.starts) - 1 else self.size

    def lead_ramp(self, i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(size,) weight of tile i against its predecessor: k / overlap over the leading overlap, then 1."""
        w = torch.ones(self.size, dtype=dtype)
        if i > 0:
            o = self.overlaps[i - 1]
            w[:o] = torch.arange(o, dtype=dtype) / o
        return w

    def scaled(self, factor: float) -> "TilePlan":
        """The same plan in other units (e.g. latent pixels -> pixels with factor 16)."""
        f = lambda v: int(round(v * factor))  # noqa: E731
        return TilePlan(f(self.length), f(self.size), tuple(f(s) for s in self.starts), tuple(f(o) for o in self.overlaps))


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
    """(size_h, size_w) weight of tile (i, j) in the sequential composition (see the module docstring).

    Three disjoint parts: the span the tile owns (its own ramps, one per axis), the band below it that
    tile (i + 1, j) owns (1 - that tile's vertical ramp, times this tile's horizontal ramp), and the band
    to its right that tile (i, j + 1) owns (1 - that tile's horizontal ramp, no vertical factor).
    """
    rows, cols = plan_h.lead_ramp(i), plan_w.lead_ramp(j)
    own_h, own_w = plan_h.owned_stop(i), plan_w.owned_stop(j)
    w = torch.zeros(plan_h.size, plan_w.size)
    w[:own_h, :own_w] = rows[:own_h, None] * cols[None, :own_w]
    if i < len(plan_h.starts) - 1:
        n = min(plan_h.overlaps[i], plan_h.owned_stop(i + 1))
        below = 1.0 - plan_h.lead_ramp(i + 1)[:n]
        w[own_h:own_h + n, :own_w] = below[:, None] * cols[None, :own_w]
    if j < len(plan_w.starts) - 1:
        n = min(plan_w.overlaps[j], plan_w.owned_stop(j + 1))
        right = 1.0 - plan_w.lead_ramp(j + 1)[:n]
        w[:own_h, own_w:own_w + n] = right[None, :]
    return w


# Memory figures for decoders that size their work by memory ------------------------------------

def free_bytes() -> int:
    """Bytes a decoder may allocate on the compute device now (models/memory.free_bytes)."""
    from models import memory
    return int(memory.free_bytes())


def is_out_of_memory(err: BaseException) -> bool:
    """True for torch.OutOfMemoryError and for RuntimeErrors that report running out of memory."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested, ...)
        return None
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage.data_ptr())


class _LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of storages that ops create while active, and the peak of their sum.

    Views and in-place results share an existing storage and add nothing; a storage stops counting when
    the last tensor created on it while tracking is gone. Tensors made before tracking are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[tuple[str, int], list[int]] = {}  # storage key -> [bytes, tracked tensors on it]
        self.current = 0
        self.peak = 0

    def _drop(self, key: tuple[str, int]) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.current -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key is None:
                continue
            entry = self.live.get(key)
            if entry is None:
                if key in inputs:
                    continue  # an in-place result or a view of an untracked tensor
                entry = self.live[key] = [t.untyped_storage().nbytes(), 0]
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(t, self._drop, key)
        return out


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str) -> tuple[Any, int]:
    """Run fn() and return (its result, the most bytes of new tensors alive at once while it ran, on `device`).

    Weight copies the memory manager made resident during the call are subtracted: they stay after it and
    are already out of free_bytes(), so they are not part of what the next call of the same size needs.
    """
    from models import memory

    device = torch.device(device)
    manager = memory.manager()
    resident0 = manager.stats().resident_bytes if manager is not None else 0
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        # torch.compile refuses to run under a dispatch mode (and the compiled kernel backend would remember
        # the refusal for the shape class), so compiled functions run their Python bodies eagerly for the
        # measured call; other kernels (SDPA, ...) are unchanged. The stance is process-wide: other threads
        # only lose speed for that long, never correctness. Unfused ops need at least a fused kernel's
        # memory, so the figure errs on the safe side.
        tracker = _LiveTensorBytes()
        with torch.compiler.set_stance("force_eager"), tracker:
            result = fn()
        peak = tracker.peak
    grown = (manager.stats().resident_bytes - resident0) if manager is not None else 0
    return result, int(max(1, peak - max(0, grown)))
