"""Per-node profiling of a job: wall and CPU time, peak-RSS growth, calls, stored column by column."""
from __future__ import annotations

import gc
import resource
import time
from array import array

from execution.graph import PromptNode

# The collector is paused over a run (graph.collector_paused). So that cyclic garbage cannot pile up
# in a long run (loop iterations), young objects are collected once this many have accumulated.
# Few large collections, not one per so many nodes: each young collection also ages the survivors,
# and ten of them make the next automatic collection traverse everything the run still holds.
YOUNG_OBJECTS_BEFORE_COLLECT = 1_000_000


class ProfileRows:
    """The per-node profile of one job, stored column by column (a row of Python objects per node
    would be a large share of a big job's allocations).

    Ephemeral nodes (expansion copies, such as loop iterations) add up under one row keyed
    `display_id:class_type`."""

    NUMBERS = ("wall_ms", "cpu_ms", "peak_rss_growth_bytes", "calls", "runs")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.class_types: list[str] = []
        self.display_nodes: list[str] = []
        self.cached = bytearray()
        self.numbers = array("d")  # NUMBERS per row, row after row
        self._summed: dict[str, int] = {}  # key of an added-up row -> its row index
        self.counts: dict[int, dict[str, float]] = {}  # row index -> what its node counted (few rows have any)
        self.notes: dict[int, dict[str, list]] = {}  # row index -> the node's notes (few rows have any)

    def add(self, key: str, class_type: str, display_node: str, cached: bool, *numbers: float) -> int:
        """Record one node's row (numbers in NUMBERS order); returns its index."""
        self.keys.append(key)
        self.class_types.append(class_type)
        self.display_nodes.append(display_node)
        self.cached.append(cached)
        self.numbers.extend(numbers)
        return len(self.keys) - 1

    def add_up(self, key: str, class_type: str, display_node: str, *numbers: float) -> int:
        """Add a run of an ephemeral node to its row under `key`; returns the row's index."""
        index = self._summed.get(key)
        if index is None:
            self._summed[key] = len(self.keys)
            return self.add(key, class_type, display_node, False, *numbers)
        base = index * len(self.NUMBERS)
        for offset, value in enumerate(numbers):
            self.numbers[base + offset] += value
        return index

    def note(self, index: int, notes: dict[str, list]) -> None:
        """Add a node run's notes (RunContext.note_profile) to row `index`; lists of one name concatenate."""
        held = self.notes.setdefault(index, {})
        for name, values in notes.items():
            held[name] = held.get(name, []) + list(values)

    def add_counts(self, index: int, counts: dict[str, float]) -> None:
        """Add a node's own counts (RunContext.count) to row `index` (summed over an added-up row's runs)."""
        row = self.counts.setdefault(index, {})
        for name, amount in counts.items():
            row[name] = row.get(name, 0) + amount

    def as_dicts(self) -> dict[str, dict]:
        """key -> {class_type, display_node, cached, wall_ms, cpu_ms, peak_rss_growth_bytes, calls, runs}, plus
        `counts` ({name: number}) on the rows of nodes that counted something (a sampler's skipped steps)."""
        width = len(self.NUMBERS)
        rows = {}
        for index, key in enumerate(self.keys):
            if self.cached[index] and key in rows:
                # It ran, its values were released, and a later node (a loop iteration) had them
                # served from the cache again: the row of its run says what it cost.
                continue
            row = {"class_type": self.class_types[index], "display_node": self.display_nodes[index],
                   "cached": bool(self.cached[index])}
            for offset, name in enumerate(self.NUMBERS):
                value = self.numbers[index * width + offset]
                row[name] = value if name.endswith("_ms") else int(value)
            if index in self.counts:
                row["counts"] = dict(self.counts[index])
            if index in self.notes:
                row["notes"] = self.notes[index]
            rows[key] = row
        return rows


class Profiler:
    """Records each node run of one job into its `rows` and `executed` list."""

    __slots__ = ("rows", "executed", "peak_rss")

    def __init__(self, rows: ProfileRows, executed: list[str]) -> None:
        self.rows = rows
        self.executed = executed
        self.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def served(self, node: PromptNode, notes: dict[str, list] | None = None) -> None:
        """`node` came from the cache (an editor node gets a row, with the `notes` of the run that made the
        value; copies do not)."""
        if node.parent is None:
            index = self.rows.add(node.id, node.class_type, node.display_id, True, 0.0, 0.0, 0, 0, 0)
            if notes:
                self.rows.note(index, notes)

    def ran(self, node: PromptNode, calls: int, wall0: float, cpu0: float,
            counts: dict[str, float] | None = None, notes: dict[str, list] | None = None) -> None:
        """`node` ran `calls` times since `wall0` (perf_counter) and `cpu0` (thread_time), counting `counts`
        and noting `notes`."""
        wall = time.perf_counter() - wall0
        # The process's peak RSS only grows; its growth since the previous node ended is this node's.
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu = time.thread_time() - cpu0
        growth = max(0, peak_rss - self.peak_rss) * 1024
        self.peak_rss = peak_rss
        if node.parent is None:
            index = self.rows.add(node.id, node.class_type, node.display_id, False, wall * 1000, cpu * 1000,
                                  growth, calls, 1)
        else:
            index = self.rows.add_up(f"{node.display_id}:{node.class_type}", node.class_type, node.display_id,
                                     wall * 1000, cpu * 1000, growth, calls, 1)
        if counts:
            self.rows.add_counts(index, counts)
        if notes:
            self.rows.note(index, notes)
        executed = self.executed
        executed.append(node.id)
        if len(executed) % 1024 == 0 and gc.get_count()[0] > YOUNG_OBJECTS_BEFORE_COLLECT:
            gc.collect(0)
