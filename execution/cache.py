"""The output cache: node results keyed by structural signatures.

A node's signature hashes (class, fingerprint, constant inputs, upstream signatures and output
indices); it does not depend on node ids, so the same sub-graph under other ids hits the cache.
Signatures are computed once per node per prompt, sources first, so the cost is linear in the
graph. Not-idempotent nodes add their id; a NaN fingerprint (IS_CHANGED) adds a fresh token so the
node and everything downstream runs every time. Nodes an expansion adds are keyed the same way, by
structure; one the expansion salts (`cache_salt`) mixes the salt into its key and is never stored.

Backends (`CacheKind`): classic (keeps what the latest prompt used), LRU by entry count, RAM
pressure (bytes, the default), none.
"""
from __future__ import annotations

from hashlib import blake2b
import itertools
import math
import os
import sys
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from execution.graph import Link, PromptNode
from execution.spec import NodeSpec

_fresh = itertools.count()


@dataclass(slots=True)
class CachedResult:
    """What a node produced: per-output value lists, its UI dict and its profile notes (RunContext.note_profile),
    so a run served from the cache shows the same notes on its profile row as the run that made it."""

    outputs: list[list[Any]]
    ui: dict | None
    size_bytes: int = 0
    notes: dict[str, list] | None = None


def _const_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # a value whose repr fails still gets a stable, unique-enough key
        return f"<{type(value).__name__}@{id(value)}>"


_PLAIN = (int, float, str, bool, type(None))


def node_signature(node: PromptNode, spec: NodeSpec | None, upstream: Callable[[str], str | None], *,
                   fingerprint: Callable[[PromptNode, NodeSpec | None], Any] | None = None) -> str:
    """The structural signature of `node`; `upstream(node_id)` gives a source's signature.

    A 128-bit digest over the node's class, cache marks, constants (with their types, so 1, 1.0
    and True differ) and its inputs' upstream signatures and output indices. `fingerprint` is only
    called for nodes that declare one or carry a salt.
    """
    key: list[Any] = [node.class_type]
    if spec is not None and spec.not_idempotent:
        key.append(("#id", node.id))
    if fingerprint is not None and (node.salt is not None or (spec is not None and spec.fingerprint is not None)):
        mark = fingerprint(node, spec)
        if isinstance(mark, float) and math.isnan(mark):
            key.append(("#fresh", os.getpid(), next(_fresh)))
        elif mark is not None:
            key.append(("#fp", _const_repr(mark)))
    inputs = node.inputs
    append = key.append
    for name in (sorted(inputs) if len(inputs) > 1 else inputs):
        value = inputs[name]
        kind = type(value)
        if kind is Link:
            append((name, upstream(value.node) or "?" + value.node, value.output))
        elif kind in _PLAIN:
            append((name, kind.__name__, value))
        else:
            append((name, "repr", _const_repr(value)))
    return blake2b(repr(tuple(key)).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def estimate_bytes(value: Any, _depth: int = 0) -> int:
    """A cheap size estimate of a cached value (tensors and arrays by their buffers)."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if hasattr(value, "element_size") and hasattr(value, "nelement"):
        return value.element_size() * value.nelement()
    if _depth > 3:
        return 64
    if isinstance(value, (list, tuple)):
        return 56 + sum(estimate_bytes(v, _depth + 1) for v in value[:1000])
    if isinstance(value, dict):
        return 232 + sum(estimate_bytes(v, _depth + 1) for v in list(value.values())[:1000])
    if isinstance(value, (str, bytes)):
        return 49 + len(value)
    return sys.getsizeof(value) if isinstance(value, (int, float, bool)) else 64


class CacheKind(str, Enum):
    """The cache backends; each value is the word its command-line flag carries (`--cache-<value>`)."""

    CLASSIC = "classic"
    LRU = "lru"
    RAM = "ram"
    NONE = "none"


class OutputCache:
    """Base class: a mapping from signature to CachedResult with a policy for what to keep."""

    kind: CacheKind

    def __init__(self) -> None:
        self._entries: "OrderedDict[str, CachedResult]" = OrderedDict()

    def get(self, signature: str) -> CachedResult | None:
        entry = self._entries.get(signature)
        if entry is not None:
            self._entries.move_to_end(signature)
        return entry

    def put(self, signature: str, result: CachedResult) -> None:
        self._entries[signature] = result
        self._entries.move_to_end(signature)
        self._trim()

    def begin_prompt(self) -> None:
        """Called before a prompt runs."""

    def end_prompt(self, used: set[str]) -> None:
        """Called after a prompt ran with every signature it used."""

    def _trim(self) -> None:
        pass

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> Container[str]:
        """The signatures held now, as a live view: membership without a Python call per test."""
        return self._entries.keys()


class ClassicCache(OutputCache):
    """Keeps exactly what the latest prompt used (ComfyUI's default behaviour)."""

    kind = CacheKind.CLASSIC

    def __init__(self) -> None:
        super().__init__()
        self._entries = {}  # type: ignore[assignment]  # no recency order to keep: a plain dict is leaner

    def get(self, signature: str) -> CachedResult | None:
        return self._entries.get(signature)

    def put(self, signature: str, result: CachedResult) -> None:
        self._entries[signature] = result

    def end_prompt(self, used: set[str]) -> None:
        for key in [k for k in self._entries if k not in used]:
            del self._entries[key]


class LRUCache(OutputCache):
    """Keeps the `max_entries` most recently used results."""

    kind = CacheKind.LRU

    def __init__(self, max_entries: int) -> None:
        super().__init__()
        self.max_entries = max(1, int(max_entries))

    def _trim(self) -> None:
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class RAMPressureCache(OutputCache):
    """Keeps results while their total size stays under `max_bytes` and the machine has headroom.

    Evicts least recently used entries first; with `min_free_bytes`, also evicts while the system's
    available memory is below it.
    """

    kind = CacheKind.RAM

    def __init__(self, max_bytes: int | None = None, *, min_free_bytes: int = 2 * 2**30,
                 available_bytes: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.total_bytes = 0
        self._available = available_bytes or _available_memory_bytes

    def put(self, signature: str, result: CachedResult) -> None:
        if not result.size_bytes:
            result.size_bytes = sum(estimate_bytes(v) for out in result.outputs for v in out)
        old = self._entries.get(signature)
        if old is not None:
            self.total_bytes -= old.size_bytes
        self.total_bytes += result.size_bytes
        super().put(signature, result)

    def _trim(self) -> None:
        while len(self._entries) > 1 and (
            (self.max_bytes is not None and self.total_bytes > self.max_bytes)
        ):
            _, entry = self._entries.popitem(last=False)
            self.total_bytes -= entry.size_bytes

    def end_prompt(self, used: set[str]) -> None:
        # Pressure is checked once per prompt: reading system memory per put would dominate cheap nodes.
        while self._entries and self._available() < self.min_free_bytes:
            _, entry = self._entries.popitem(last=False)
            self.total_bytes -= entry.size_bytes

    def clear(self) -> None:
        super().clear()
        self.total_bytes = 0


class NoCache(OutputCache):
    """Keeps nothing between prompts (or between nodes: intermediates are freed when consumed)."""

    kind = CacheKind.NONE

    def put(self, signature: str, result: CachedResult) -> None:
        return None


def _available_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # without psutil, fall back to /proc
        try:
            with open("/proc/meminfo") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return 1 << 62


def make_cache(kind: CacheKind | str = CacheKind.RAM, *, lru_size: int = 0,
               ram_gb: float | None = None) -> OutputCache:
    """Build the cache of `kind` (`--cache-classic`, `--cache-lru N`, `--cache-ram GB`, `--cache-none`)."""
    try:
        kind = CacheKind(kind)
    except ValueError:
        raise ValueError(f"unknown cache kind {kind!r}; known: {[k.value for k in CacheKind]}") from None
    if kind is CacheKind.CLASSIC:
        return ClassicCache()
    if kind is CacheKind.LRU:
        return LRUCache(lru_size or 100)
    if kind is CacheKind.NONE:
        return NoCache()
    min_free = int((ram_gb if ram_gb is not None else 4.0) * 2**30)
    return RAMPressureCache(min_free_bytes=min_free)
