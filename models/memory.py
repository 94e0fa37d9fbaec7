"""Device memory: the one place that decides the compute device and dtype and what weights are resident.

Model code gets a module's weights with `take(module)` (or `with using(module) as (weight, bias):`)
just before its op and gives them back with `release(module)` after it. A configured
`MemoryManager` keeps copies of taken weights on the compute device, in the requested dtype, with
the active adapter patches applied (models/patcher.py), and keeps their total size under a budget by
evicting the least recently used copies that nobody holds. The module's own parameters are never
changed: they are the offload storage, and a patched model never mutates the cached base model.

Modes (`MemoryMode`, or its value, for `configure(mode=...)`; CLI flags in `add_cli_arguments`):
  normal    copies stay resident until the budget needs room (LRU eviction)
  highvram  copies stay resident; nothing is evicted
  lowvram   like normal, and `stream_blocks` also drops each block's copies once the block is done
  novram    a copy lives only while it is held: released weights are dropped at once

On a machine without a GPU the same logic runs with host copies standing in for device copies, so
the budget and the accounting (resident, peak resident, bytes moved, evictions) are real and tested.
With no manager configured, `take` returns the parameters cast to the requested dtype (patches
applied), which is what tests and small tools want.

A resident model costs nothing for being managed: when a module's unpatched copy becomes resident the
module is pointed at it (a weak reference in its own __dict__), and each later `take` re-checks only what
could invalidate that copy (dropped, another dtype, a patch for this module, its tensors replaced or
changed in place) before pinning it (`MemoryManager._resident_copy`); everything else takes the full path.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import math
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn

from kernels.options import FAST_OPTIONS
from models.memory_flags import add_cli_arguments  # noqa: F401 (the flags live in a torch-free module)
from models.patcher import active_patch_map, apply_patches

GIB = 1024 ** 3


class MemoryMode(StrEnum):
    """How long weight copies stay on the device (see the module docstring); values are the CLI's names."""

    NORMAL = "normal"
    HIGH_VRAM = "highvram"
    LOW_VRAM = "lowvram"
    NO_VRAM = "novram"

    @classmethod
    def parse(cls, value: MemoryMode | str) -> MemoryMode:
        """`value` as a MemoryMode; ValueError listing the modes for anything else."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"memory mode {value!r} is not one of {[m.value for m in cls]}") from None


# ----------------------------------------------------------------------------------------------
# Device and dtype

def default_device() -> torch.device:
    """The best device present: the current CUDA device, else Apple MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def compute_device() -> torch.device:
    """The device model ops run on: the configured manager's, else the best device present."""
    runtime = _current()
    return runtime.device if runtime is not None else default_device()


def compute_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The dtype activations and weights are computed in on `device` (default: the compute device)."""
    runtime = _current()
    if device is None and runtime is not None:
        return runtime.dtype
    return _default_dtype(torch.device(device) if device is not None else compute_device())


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        # bfloat16 keeps float32's range (no overflow in attention logits); float16 on older cards.
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    # CPU matmuls are fastest and exact enough in float32; bfloat16 halves memory but is slower on most CPUs.
    return torch.float32


def device_free_bytes(device: torch.device | str) -> int:
    """Memory a new allocation on `device` could use now (host RAM for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # Blocks torch's caching allocator holds but does not use are free to torch.
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        import psutil  # only where sysconf lacks the figure (macOS, Windows)
        return int(psutil.virtual_memory().available)


def _target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    # Only floating weights follow the compute dtype; int8 weights and integer buffers keep theirs.
    if dtype is not None and tensor.is_floating_point():
        return dtype
    return tensor.dtype


def _kept_as_stored(module: nn.Module) -> bool:
    """True for quantized layers (models/ops.py): their tensors move in their stored dtypes and are
    never patched here; the layer dequantizes them and adds adapter patches itself at its op."""
    return getattr(module, "holds_quantized_weights", False)


def _module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own parameters and buffers (not its children's), the ones its op needs."""
    # Read from the module's own tables rather than named_parameters(), whose generator and
    # duplicate check cost more than the rest of a resident take; a tensor registered under two
    # names is still listed once.
    named = [(name, t) for table in (module._parameters, module._buffers) for name, t in table.items()
             if t is not None]
    if len(named) > 1 and len({id(t) for _name, t in named}) < len(named):
        seen: set[int] = set()
        named = [(name, t) for name, t in named if not (id(t) in seen or seen.add(id(t)))]
    return named


def _materialize(module: nn.Module, name: str, source: torch.Tensor, device: torch.device,
                 dtype: torch.dtype, patched: bool, copy: bool) -> torch.Tensor:
    """`source` on `device` in `dtype` with the active patches of `module.name` applied."""
    if copy:
        # A resident copy is a new tensor owned by the manager; without a manager (copy=False) the
        # parameter itself is returned, so autograd still reaches it.
        source = source.detach()
    if not patched:
        moved = source.to(device=device, non_blocking=device.type == "cuda")
        return moved.to(dtype, copy=copy and moved is source)
    # Patch in float32 when the target is narrower, so small deltas are not rounded away twice.
    work_dtype = torch.float32 if dtype.is_floating_point and dtype.itemsize < 4 else dtype
    work = source.to(device=device, dtype=work_dtype, copy=True)
    return apply_patches(module, name, work).to(dtype)


# ----------------------------------------------------------------------------------------------
# The manager

@dataclass
class MemoryStats:
    """Counters of one manager; bytes are device bytes (host bytes standing in on the CPU)."""

    resident_bytes: int = 0  # size of the copies held now
    peak_resident_bytes: int = 0  # largest resident_bytes since the last reset_peak()
    bytes_moved: int = 0  # bytes copied onto the device (source dtype) since creation
    evictions: int = 0  # copies dropped to make room (or by lowvram/novram policy)
    takes: int = 0  # take() calls
    hits: int = 0  # take() calls served by a resident copy
    fast_takes: int = 0  # of the hits, those served by the resident fast path (MemoryManager._resident_copy)
    prefetched_bytes: int = 0  # bytes copied ahead of use by prefetch()


# The attribute (in the module's own __dict__) through which a module finds its unpatched resident copy:
# a weak reference to the `_Entry`, so a module never keeps a dropped copy or its manager alive.
_RESIDENT = "_weft_resident_copy"


class _Entry:
    """One module's weights resident on the device in one dtype under one patch set."""

    __slots__ = ("key", "module_ref", "tensors", "nbytes", "pins", "sources", "patch_map", "ready", "owner",
                 "live", "tables", "pair", "__weakref__")

    def __init__(self, key, module_ref, tensors, nbytes, sources, patch_map, ready, owner, tables):
        self.key = key
        self.module_ref = module_ref
        self.tensors: dict[str, torch.Tensor] = tensors
        self.nbytes: int = nbytes
        self.pins = 0
        # (tensor, version) of each source, so an in-place reload of the module invalidates the copy.
        self.sources: tuple[tuple[torch.Tensor, int], ...] = sources
        self.patch_map = patch_map  # held so its id cannot be reused while the entry lives
        self.ready = ready  # CUDA event the prefetch stream records; None when ready now
        self.owner = owner  # id() of the manager holding the entry (which outlives it: it owns it)
        self.live = True  # False once dropped
        # (name count, ((table, name, value, version), ...)): what the fast path checks the module still holds.
        self.tables = tables
        self.pair = (tensors.get("weight"), tensors.get("bias"))  # what take() returns


def _source_tables(module: nn.Module) -> tuple[int, tuple]:
    """What the resident fast path re-checks: how many names the module's two tables hold, and
    (table, name, value, version) for each (a None value, such as an absent bias, included)."""
    tables = tuple((table, name, value, value._version if value is not None else 0)
                   for table in (module._parameters, module._buffers) for name, value in table.items())
    return len(tables), tables


class MemoryManager:
    """Keeps taken weights resident on `device` under a byte budget, evicting least recently used."""

    def __init__(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 budget_bytes: int | None = None, reserve_bytes: int = 0,
                 mode: MemoryMode | str = MemoryMode.NORMAL) -> None:
        mode = MemoryMode.parse(mode)
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"memory budget must be >= 0 bytes, got {budget_bytes}")
        if reserve_bytes < 0:
            raise ValueError(f"reserved memory must be >= 0 bytes, got {reserve_bytes}")
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype if dtype is not None else _default_dtype(self.device)
        self.mode = mode
        self.reserve_bytes = int(reserve_bytes)
        # None: whatever the device has free minus the reserve, re-read at each decision.
        self.fixed_budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()  # least recently used first
        self._keys_by_module: dict[int, set[tuple]] = {}
        self._lock = threading.RLock()
        self._stats = MemoryStats()
        self._stream = None  # CUDA side stream for prefetch, created on first use

    # -- budget ---------------------------------------------------------------------------------
    def budget_bytes(self) -> int | float:
        """Bytes of weights allowed resident now (math.inf for highvram)."""
        if self.mode is MemoryMode.HIGH_VRAM:
            return math.inf
        if self.mode is MemoryMode.NO_VRAM:
            return 0
        if self.fixed_budget_bytes is not None:
            return self.fixed_budget_bytes
        return self._stats.resident_bytes + max(0, device_free_bytes(self.device) - self.reserve_bytes)

    def free_bytes(self) -> int:
        """Bytes callers (e.g. tiled decode) may allocate on the device now without crowding the weights."""
        device_free = max(0, device_free_bytes(self.device) - self.reserve_bytes)
        if self.fixed_budget_bytes is None or self.mode is MemoryMode.HIGH_VRAM:
            return device_free
        return int(max(0, min(device_free, self.fixed_budget_bytes - self._stats.resident_bytes)))

    def make_room(self, nbytes: int) -> int:
        """Evict unheld copies (least recently used first) until `nbytes` are free; returns free_bytes()."""
        with self._lock:
            for entry in list(self._entries.values()):
                if self.free_bytes() >= nbytes:
                    break
                if entry.pins == 0:
                    self._drop(entry, counted=True)
            return self.free_bytes()

    # -- take / release ------------------------------------------------------------------------
    def _resident_copy(self, module: nn.Module, dtype: torch.dtype | None) -> _Entry | None:
        """The fast path: `module`'s unpatched resident copy in `dtype` when nothing about it changed, else None.

        Decided once, when the copy became resident (`_acquire` points the module at it); per call this
        only re-checks what could invalidate it: the copy was dropped (evicted, streamed out, novram), the
        module is another one (a copy of it), another dtype is asked for, a patch or a prefetch is pending,
        or the module's tensors were replaced or changed in place. Anything else takes `_acquire`.
        """
        ref = module.__dict__.get(_RESIDENT)
        entry = ref() if ref is not None else None
        if entry is None or not entry.live or entry.owner != id(self) or entry.ready is not None:
            return None
        stored_dtype = entry.key[1]
        if stored_dtype is not None and stored_dtype is not (dtype if dtype is not None else self.dtype):
            return None
        if entry.module_ref() is not module:
            return None
        if stored_dtype is not None:  # a float module: patches apply at take time (quantized ones patch at their op)
            patch_map = active_patch_map()
            if patch_map and id(module) in patch_map:
                return None
        count, tables = entry.tables
        if len(module._parameters) + len(module._buffers) != count:
            return None
        for table, name, value, version in tables:
            if table.get(name) is not value or (value is not None and value._version != version):
                return None
        return entry

    def take_resident(self, module: nn.Module, *, dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`take(module)` (weight, bias), through the resident fast path when it holds."""
        entry = self._resident_copy(module, dtype)
        if entry is not None:
            with self._lock:
                if entry.live:
                    entry.pins += 1
                    self._entries.move_to_end(entry.key)
                    stats = self._stats
                    stats.takes += 1
                    stats.hits += 1
                    stats.fast_takes += 1
                    return entry.pair
        return self.take(module, dtype=dtype)

    def take_named(self, module: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Hold `module`'s own parameters and buffers on the device in `dtype` (default: compute dtype)."""
        with self._lock:
            self._stats.takes += 1
            entry = self._acquire(module, dtype if dtype is not None else self.dtype, prefetch=False)
            entry.pins += 1
            ready = entry.ready
            tensors = entry.tensors
        if ready is not None:
            # A prefetched copy: make the compute stream wait for its transfer, and tell the
            # allocator the compute stream uses it (it was allocated on the prefetch stream).
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for tensor in tensors.values():
                tensor.record_stream(stream)
            entry.ready = None
        return tensors

    def take(self, module: nn.Module, *, dtype: torch.dtype | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Hold `module`'s weights on the device and return `(weight, bias)` (None where absent)."""
        tensors = self.take_named(module, dtype=dtype)
        return tensors.get("weight"), tensors.get("bias")

    def release(self, module: nn.Module) -> None:
        """Stop holding `module`'s weights; they stay resident (except in novram mode) until evicted."""
        with self._lock:
            keys = self._keys_by_module.get(id(module), ())
            if len(keys) == 1 and self.mode is not MemoryMode.NO_VRAM:  # one copy: nothing to choose between
                ref = module.__dict__.get(_RESIDENT)
                entry = ref() if ref is not None else None
                if entry is not None and entry.live and entry.pins > 0 and entry.owner == id(self):
                    entry.pins -= 1
                    return
            held = [self._entries[key] for key in keys if self._entries[key].pins > 0]
            if not held:
                raise ValueError(f"release() of a {type(module).__name__} whose weights are not held (take() first)")
            if len(held) == 1:
                entry = held[0]
            else:  # the module is held in several dtypes at once: release the most recently used copy
                order = {key: rank for rank, key in enumerate(self._entries)}
                entry = max(held, key=lambda e: order[e.key])
            entry.pins -= 1
            if entry.pins == 0 and self.mode is MemoryMode.NO_VRAM:
                self._drop(entry, counted=True)

    def _acquire(self, module: nn.Module, dtype: torch.dtype, prefetch: bool) -> _Entry:
        patch_map = active_patch_map()
        patched = bool(patch_map) and id(module) in patch_map
        if _kept_as_stored(module):
            dtype, patched = None, False
        key = (id(module), dtype, id(patch_map) if patched else 0)
        sources = _module_tensors(module)
        entry = self._entries.get(key)
        if entry is not None:
            if entry.module_ref() is module and all(
                    cached is src and version == src._version
                    for (cached, version), (_name, src) in zip(entry.sources, sources)) \
                    and len(entry.sources) == len(sources):
                self._entries.move_to_end(key)
                if not prefetch:
                    self._stats.hits += 1
                if not patched:
                    module.__dict__[_RESIDENT] = weakref.ref(entry)  # the copy asked for last serves the fast path
                return entry
            if entry.pins:
                raise ValueError(f"the weights of a {type(module).__name__} changed while they were held")
            self._drop(entry, counted=False)
        nbytes = sum(src.numel() * _target_dtype(src, dtype).itemsize for _name, src in sources)
        if prefetch and not self._fits(nbytes):
            return None  # a prefetch never pushes resident bytes over the budget
        self._evict_for(nbytes)
        ready = None
        if prefetch and self.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            # The copy waits for work already queued (which may still read evicted memory), then
            # runs beside the compute stream.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                tensors = {name: _materialize(module, name, src, self.device, _target_dtype(src, dtype), patched, True)
                           for name, src in sources}
                ready = torch.cuda.Event()
                ready.record(self._stream)
        else:
            tensors = {name: _materialize(module, name, src, self.device, _target_dtype(src, dtype), patched, True)
                       for name, src in sources}
        moved = sum(src.numel() * src.element_size() for _name, src in sources)
        entry = _Entry(key, weakref.ref(module, self._forget_callback(id(module))), tensors, nbytes,
                       tuple((src, src._version) for _name, src in sources), patch_map if patched else None, ready,
                       id(self), _source_tables(module))
        self._entries[key] = entry
        if not patched:
            module.__dict__[_RESIDENT] = weakref.ref(entry)  # the fast path's decision (see _resident_copy)
        self._keys_by_module.setdefault(id(module), set()).add(key)
        stats = self._stats
        stats.resident_bytes += nbytes
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, stats.resident_bytes)
        stats.bytes_moved += moved
        if prefetch:
            stats.prefetched_bytes += moved
        return entry

    def _fits(self, nbytes: int) -> bool:
        unheld = sum(e.nbytes for e in self._entries.values() if e.pins == 0)
        return self._stats.resident_bytes - unheld + nbytes <= self.budget_bytes()

    def _evict_for(self, nbytes: int) -> None:
        # Evict least recently used unheld copies until the new one fits. Held copies cannot go, so
        # the peak can exceed the budget by at most what is held at once (one op's module when
        # the model takes one module per op).
        for entry in list(self._entries.values()):
            if self._stats.resident_bytes + nbytes <= self.budget_bytes():
                return
            if entry.pins == 0:
                self._drop(entry, counted=True)

    def _drop(self, entry: _Entry, *, counted: bool) -> None:
        del self._entries[entry.key]
        entry.live = False
        keys = self._keys_by_module.get(entry.key[0])
        if keys is not None:
            keys.discard(entry.key)
            if not keys:
                del self._keys_by_module[entry.key[0]]
        self._stats.resident_bytes -= entry.nbytes
        if counted:
            self._stats.evictions += 1

    def _forget_callback(self, module_id: int):
        manager_ref = weakref.ref(self)

        def forget(_ref) -> None:
            # The module is gone: its copies can never be taken again.
            manager = manager_ref()
            if manager is None:
                return
            with manager._lock:
                for key in list(manager._keys_by_module.get(module_id, ())):
                    entry = manager._entries.get(key)
                    if entry is not None and entry.module_ref() is None:
                        manager._drop(entry, counted=False)
        return forget

    # -- prefetch, eviction, blocks ------------------------------------------------------------
    def prefetch(self, modules: nn.Module | Iterable[nn.Module], *, dtype: torch.dtype | None = None) -> int:
        """Start copying the weights of `modules` (and their children) to the device on a side stream.

        Returns the bytes started. A no-op on the CPU, where a copy ahead of time would only move
        the same work earlier on the same cores. Stops at the first module that does not fit the budget.
        """
        if self.device.type != "cuda":
            return 0
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        started = 0
        with self._lock:
            for root in roots:
                for module in root.modules():
                    if not _module_tensors(module):
                        continue
                    before = self._stats.bytes_moved
                    if self._acquire(module, dtype if dtype is not None else self.dtype, prefetch=True) is None:
                        return started
                    started += self._stats.bytes_moved - before
        return started

    def evict(self, module: nn.Module | None = None) -> int:
        """Drop unheld copies of `module` and its children (everything when None); returns bytes freed."""
        with self._lock:
            if module is None:
                targets = [e for e in self._entries.values() if e.pins == 0]
            else:
                ids = {id(m) for m in module.modules()}
                targets = [e for e in self._entries.values() if e.pins == 0 and e.key[0] in ids]
            for entry in targets:
                self._drop(entry, counted=True)
            return sum(e.nbytes for e in targets)

    def stream_blocks(self, blocks: Sequence[nn.Module], *, dtype: torch.dtype | None = None) -> Iterator[nn.Module]:
        """Yield `blocks` in order, prefetching the next one while the current one runs.

        In lowvram mode each block's copies are dropped once the loop moves past it.
        """
        blocks = list(blocks)
        for index, block in enumerate(blocks):
            if index + 1 < len(blocks):
                self.prefetch(blocks[index + 1], dtype=dtype)
            yield block
            if self.mode is MemoryMode.LOW_VRAM:
                self.evict(block)

    # -- statistics -----------------------------------------------------------------------------
    def stats(self) -> MemoryStats:
        """A copy of the counters."""
        with self._lock:
            return MemoryStats(**asdict(self._stats))

    def reset_peak(self) -> None:
        """Start measuring peak resident bytes from now (e.g. at the start of a job)."""
        with self._lock:
            self._stats.peak_resident_bytes = self._stats.resident_bytes

    def resident_modules(self) -> list[nn.Module]:
        """Modules with a resident copy, least recently used first."""
        with self._lock:
            return [m for m in (e.module_ref() for e in self._entries.values()) if m is not None]

    def snapshot(self) -> dict:
        """Counters plus device, dtype, mode and budget, as plain JSON-ready values."""
        budget = self.budget_bytes()
        return {"configured": True, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "mode": self.mode.value, "budget_bytes": None if budget == math.inf else int(budget),
                **asdict(self.stats())}


# ----------------------------------------------------------------------------------------------
# The configured runtime (one per process)

_runtime: MemoryManager | None = None


def configure(*, vram_budget_gb: float | None = None, reserve_vram_gb: float | None = None,
              mode: MemoryMode | str = MemoryMode.NORMAL,
              device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MemoryManager:
    """Create the process's memory manager (replacing any earlier one) and return it."""
    global _runtime
    _by_device.clear()
    if vram_budget_gb is not None and vram_budget_gb < 0:
        raise ValueError(f"--vram-budget must be >= 0 GB, got {vram_budget_gb}")
    _runtime = MemoryManager(
        device=device, dtype=dtype, mode=mode,
        budget_bytes=None if vram_budget_gb is None else int(vram_budget_gb * GIB),
        reserve_bytes=int((reserve_vram_gb or 0.0) * GIB))
    return _runtime


def activate(runtime: MemoryManager | None) -> None:
    """Make an already built manager the configured runtime (None: unconfigure); benchmarks compare several."""
    global _runtime
    _by_device.clear()
    _runtime = runtime


def unconfigure() -> None:
    """Drop the configured manager (its copies go with it); take() then returns the parameters themselves."""
    global _runtime
    _by_device.clear()
    _runtime = None


def manager() -> MemoryManager | None:
    """The manager of the device the running model is placed on (see `placed_on`), else the configured
    one; None when configure() was not called."""
    return _current()


# A model placed on another device (SelectModelDevice and its siblings) runs under `placed_on(device)`:
# its weights are held, budgeted and evicted by a manager of that device, made like the configured one.
_placed: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("weft_placed_device", default=None)
_by_device: dict[torch.device, MemoryManager] = {}
_by_device_lock = threading.Lock()


def _current() -> MemoryManager | None:
    runtime, placed = _runtime, _placed.get()
    if runtime is None or placed is None or placed == runtime.device:
        return runtime
    with _by_device_lock:
        placed_manager = _by_device.get(placed)
        if placed_manager is None:
            placed_manager = _by_device[placed] = MemoryManager(
                device=placed, mode=runtime.mode, budget_bytes=runtime.fixed_budget_bytes,
                reserve_bytes=runtime.reserve_bytes)
        return placed_manager


def available_devices() -> list[torch.device]:
    """The devices a model can be placed on here: the CPU, then each CUDA device."""
    return [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


@contextlib.contextmanager
def placed_on(device: torch.device | str | None) -> Iterator[None]:
    """Inside the block, models run on `device` (None: where the configured manager puts them)."""
    token = _placed.set(torch.device(device) if device is not None else None)
    try:
        yield
    finally:
        _placed.reset(token)


def take_named(module: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`module`'s own parameters and buffers ready for its op (see MemoryManager.take_named)."""
    runtime = _current()
    if runtime is not None:
        return runtime.take_named(module, dtype=dtype)
    patch_map = active_patch_map()
    patched = bool(patch_map) and id(module) in patch_map
    if _kept_as_stored(module):
        dtype, patched = None, False
    return {name: _materialize(module, name, src, src.device, _target_dtype(src, dtype), patched, False)
            for name, src in _module_tensors(module)}


def take(module: nn.Module, *, dtype: torch.dtype | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(weight, bias)` of `module` ready for its op; pair every take with a release(module)."""
    runtime = _current()
    if runtime is not None:
        return runtime.take_resident(module, dtype=dtype)
    tensors = take_named(module, dtype=dtype)
    return tensors.get("weight"), tensors.get("bias")


def release(module: nn.Module) -> None:
    """Give back the weights of `module` taken for its op."""
    runtime = _current()
    if runtime is not None:
        runtime.release(module)


@contextlib.contextmanager
def using(module: nn.Module, *, dtype: torch.dtype | None = None) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """`with using(module, dtype=x.dtype) as (weight, bias):` take for the block, release after."""
    taken = take(module, dtype=dtype)
    try:
        yield taken
    finally:
        release(module)


@contextlib.contextmanager
def using_if_module(value: nn.Module | torch.Tensor | None, *, dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """`using(value)` when `value` is a module (a norm whose weights feed another op's prologue);
    otherwise `(value, None)` as given, with nothing to take or release."""
    if not isinstance(value, nn.Module):
        yield value, None
        return
    with using(value, dtype=dtype) as taken:
        yield taken


@contextlib.contextmanager
def using_named(module: nn.Module, *, dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """`with using_named(module, dtype=x.dtype) as own:` the module's own parameters and buffers by
    name (not its children's) for the block, released after."""
    tensors = take_named(module, dtype=dtype)
    try:
        yield tensors
    finally:
        release(module)


def prefetch(modules: nn.Module | Iterable[nn.Module], *, dtype: torch.dtype | None = None) -> int:
    """Start copying `modules`' weights to the device ahead of use (no-op without a manager or on CPU)."""
    runtime = _current()
    return runtime.prefetch(modules, dtype=dtype) if runtime is not None else 0


def stream_blocks(blocks: Sequence[nn.Module], *, dtype: torch.dtype | None = None) -> Iterator[nn.Module]:
    """Iterate transformer/encoder blocks with the next one prefetched (see MemoryManager.stream_blocks)."""
    runtime = _current()
    if runtime is None:
        return iter(list(blocks))
    return runtime.stream_blocks(blocks, dtype=dtype)


def free_bytes() -> int:
    """Bytes callers may allocate on the compute device now (what tiled decode sizes its batches by)."""
    runtime = _current()
    if runtime is not None:
        return runtime.free_bytes()
    return device_free_bytes(default_device())


def stats_snapshot() -> dict:
    """Memory figures for the job profile: device, dtype, mode, budget and the MemoryStats counters."""
    runtime = _current()
    if runtime is not None:
        return runtime.snapshot()
    device = default_device()
    return {"configured": False, "device": str(device), "dtype": str(_default_dtype(device)).removeprefix("torch."),
            "mode": None, "budget_bytes": None, **asdict(MemoryStats())}


def reset_peak() -> None:
    """Restart the configured manager's peak-resident measurement (no-op without one)."""
    runtime = _current()
    if runtime is not None:
        runtime.reset_peak()


# ----------------------------------------------------------------------------------------------
# Command line

def configure_from_args(args: argparse.Namespace) -> MemoryManager:
    """Configure the runtime (memory manager and kernel switches) from flags added by add_cli_arguments."""
    from kernels import registry  # kernels never import Weft; Weft configures them

    mode = (MemoryMode.HIGH_VRAM if args.highvram else MemoryMode.LOW_VRAM if args.lowvram
            else MemoryMode.NO_VRAM if args.novram else MemoryMode.NORMAL)
    if args.disable_fused_kernels:
        registry.disable_fused_kernels()
    if args.fast is not None:
        registry.set_fast_options(args.fast if args.fast else FAST_OPTIONS)
    return configure(vram_budget_gb=args.vram_budget, reserve_vram_gb=args.reserve_vram, mode=mode)
