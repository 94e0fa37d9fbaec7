"""ComfyUI's `comfy_execution.graph_utils` for node packs: build an expansion graph, block a branch.

A node that expands returns `{"result": (links...), "expand": graph}` (V3: `io.NodeOutput(*links,
expand=graph)`), where `graph` is `GraphBuilder.finalize()`'s {node id: {"class_type", "inputs"}} and
each link is `[node id, output index]` (`Node.out(i)`). Weft's executor prefixes every id of an
expansion with the expanding node's id, so the ids a builder makes only need to be unique within
one graph; the builder's prefix keeps two builders of one call apart.

`ExecutionBlocker` is Weft's own (`execution.types`), so a value a pack blocks with is the one the
executor recognises.
"""
from __future__ import annotations

import contextvars
from typing import Any

from execution.types import ExecutionBlocker

__all__ = ["ExecutionBlocker", "GraphBuilder", "Node", "add_graph_prefix", "is_link"]

# (root, call index, next graph index) for builders made without a prefix
_PREFIX_STATE: contextvars.ContextVar[tuple[str, int, int]] = contextvars.ContextVar(
    "weft_graph_builder_prefix", default=("", 0, 0))


def is_link(value: Any) -> bool:
    """Whether `value` is a link `[node id, output index]`."""
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], (int, float)) and not isinstance(value[1], bool))


class Node:
    """One node of a graph being built: its id, class and inputs (constants or links)."""

    def __init__(self, id: str, class_type: str, inputs: dict[str, Any]) -> None:
        self.id = id
        self.class_type = class_type
        self.inputs = dict(inputs)
        self.override_display_id: str | None = None

    def out(self, index: int) -> list:
        """A link to this node's output `index`."""
        return [self.id, index]

    def set_input(self, key: str, value: Any) -> None:
        """Set an input; None removes it."""
        if value is None:
            self.inputs.pop(key, None)
        else:
            self.inputs[key] = value

    def get_input(self, key: str) -> Any:
        """An input's value or link, or None."""
        return self.inputs.get(key)

    def set_override_display_id(self, override_display_id: str) -> None:
        """Show this node's progress and results under another node's id in the editor."""
        self.override_display_id = override_display_id

    def serialize(self) -> dict[str, Any]:
        """The node as a prompt entry."""
        entry: dict[str, Any] = {"class_type": self.class_type, "inputs": self.inputs}
        if self.override_display_id is not None:
            entry["override_display_id"] = self.override_display_id
        return entry


class GraphBuilder:
    """Builds a graph of prompt nodes: `node(class_type, **inputs)` adds one, `finalize()` gives the graph."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = GraphBuilder.alloc_prefix() if prefix is None else prefix
        self.nodes: dict[str, Node] = {}
        self._next_id = 1

    @classmethod
    def set_default_prefix(cls, prefix_root: str, call_index: int, graph_index: int = 0) -> None:
        """Where the prefixes of builders made without one start."""
        _PREFIX_STATE.set((prefix_root, call_index, graph_index))

    @classmethod
    def alloc_prefix(cls, root: str | None = None, call_index: int | None = None,
                     graph_index: int | None = None) -> str:
        """A fresh prefix "root.call.graph." (each call moves the default graph index on)."""
        default_root, default_call, default_graph = _PREFIX_STATE.get()
        prefix = (f"{default_root if root is None else root}."
                  f"{default_call if call_index is None else call_index}."
                  f"{default_graph if graph_index is None else graph_index}.")
        _PREFIX_STATE.set((default_root, default_call, default_graph + 1))
        return prefix

    def node(self, class_type: str, id: str | None = None, **inputs: Any) -> Node:
        """Add a node (or return the one already under `id`)."""
        if id is None:
            id = str(self._next_id)
            self._next_id += 1
        full_id = self.prefix + id
        if full_id not in self.nodes:
            self.nodes[full_id] = Node(full_id, class_type, inputs)
        return self.nodes[full_id]

    def lookup_node(self, id: str) -> Node | None:
        """The node added under `id`, or None."""
        return self.nodes.get(self.prefix + id)

    def remove_node(self, id: str) -> None:
        """Drop the node added under `id`."""
        del self.nodes[self.prefix + id]

    def replace_node_output(self, node_id: str, index: int, new_value: Any) -> None:
        """Every input linked to output `index` of `node_id` gets `new_value` instead (None unlinks it)."""
        target = [self.prefix + node_id, index]
        for node in self.nodes.values():
            for key, value in list(node.inputs.items()):
                if is_link(value) and list(value) == target:
                    node.set_input(key, new_value)

    def finalize(self) -> dict[str, dict[str, Any]]:
        """The graph: {node id: {"class_type", "inputs"[, "override_display_id"]}}."""
        return {node_id: node.serialize() for node_id, node in self.nodes.items()}


def add_graph_prefix(graph: dict[str, dict], outputs: Any, prefix: str) -> tuple[dict[str, dict], tuple]:
    """`graph` and `outputs` with every node id (and every link to one) prefixed by `prefix`."""
    renamed = {}
    for node_id, entry in graph.items():
        inputs = {key: [prefix + value[0], value[1]] if is_link(value) else value
                  for key, value in entry.get("inputs", {}).items()}
        renamed[prefix + node_id] = {"class_type": entry["class_type"], "inputs": inputs}
    return renamed, tuple([prefix + item[0], item[1]] if is_link(item) else item for item in outputs)
