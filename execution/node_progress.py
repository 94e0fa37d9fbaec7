"""Each node's own progress in one job, as the editor's `progress_state` event reports it.

As in ComfyUI: a node is pending until it starts (then running, 0 of 1); every progress update sets its
value and max; finishing sets its value to its max (finished). Each change sends the state of every node
that is no longer pending, so the editor can draw each node's bar, not only the current one.
"""
from __future__ import annotations

from typing import Any, Callable

from execution.graph import PromptNode


class NodeProgress:
    """The non-pending nodes of one job and their value, max and state; sends `progress_state` on change."""

    __slots__ = ("prompt_id", "emit", "listening", "node_of", "entries")

    def __init__(self, prompt_id: str, emit: Callable[[str, dict], None],
                 node_of: Callable[[str], PromptNode | None], *,
                 listening: Callable[[], bool] = lambda: True) -> None:
        self.prompt_id = prompt_id
        self.emit = emit
        # Each event copies every entry (ComfyUI's shape), so a job of N nodes builds O(N^2) data: build it
        # only while someone receives it (a headless run or a bench with no subscriber pays nothing).
        self.listening = listening
        self.node_of = node_of  # the job's node by id (expansions add nodes while it runs)
        self.entries: dict[str, dict[str, Any]] = {}

    def started(self, node: PromptNode) -> None:
        """`node` begins: running, 0 of 1."""
        self._set(node.id, node, "running", 0.0, 1.0)

    def updated(self, node_id: str, value: float, maximum: float) -> None:
        """A progress update of the node `node_id`: running, `value` of `maximum`."""
        self._set(node_id, None, "running", value, maximum)

    def finished(self, node: PromptNode) -> None:
        """`node` is done (run or served from the cache): finished, its value raised to its max."""
        entry = self.entries.get(node.id)
        maximum = entry["max"] if entry is not None else 1.0
        self._set(node.id, node, "finished", maximum, maximum)

    def _set(self, node_id: str, node: PromptNode | None, state: str, value: float, maximum: float) -> None:
        entry = self.entries.get(node_id)
        if entry is None:
            node = node or self.node_of(node_id)
            display = node.display_id if node is not None else node_id
            entry = self.entries[node_id] = {
                "value": value, "max": maximum, "state": state, "node_id": node_id, "prompt_id": self.prompt_id,
                "display_node_id": display, "parent_node_id": node.parent if node is not None else None,
                "real_node_id": (node.real_id or node.id) if node is not None else node_id}
        else:
            entry["value"], entry["max"], entry["state"] = value, maximum, state
        if not self.listening():
            return
        # A copy per event: subscribers may keep the data, and later changes must not rewrite it.
        self.emit("progress_state", {"prompt_id": self.prompt_id,
                                     "nodes": {key: dict(item) for key, item in self.entries.items()}})
