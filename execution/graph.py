"""The prompt graph: API-format prompts parsed into typed links and named constants.

API format in: `{id: {"class_type": str, "inputs": {name: value}, "_meta": {"title": str}}}`, where a
value `[src_id, out_index]` is a link and `{"__value__": [...]}` wraps a list-valued constant.
Expansion adds ephemeral nodes that carry their parent's id and a display id for the editor.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


class Link:
    """A connection from output `output` of node `node` (immutable; a plain class for speed)."""

    __slots__ = ("node", "output")

    def __init__(self, node: str, output: int) -> None:
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "output", output)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Link is immutable")

    def __eq__(self, other: object) -> bool:
        return type(other) is Link and other.node == self.node and other.output == self.output

    def __hash__(self) -> int:
        return hash((self.node, self.output))

    def __repr__(self) -> str:
        return f"Link({self.node!r}, {self.output})"

    def to_json(self) -> list:
        return [self.node, self.output]


@dataclass(slots=True)
class PromptNode:
    """One node instance: its class, its inputs (Link or constant) and where it came from."""

    id: str
    class_type: str
    inputs: dict[str, Any]
    title: str | None = None
    parent: str | None = None  # the node whose expansion created this one
    display_id: str = ""  # the UI node the editor highlights for this one
    real_id: str | None = None  # for expansions that stand for an original body node (loops)
    salt: str | None = None  # set by an expansion to opt out of the cache: mixed into the key, never stored
    _links: list | None = None

    def __post_init__(self):
        if not self.display_id:
            self.display_id = self.id

    def links(self) -> list[Link]:
        """The Links among its inputs, in input order; computed once (call `inputs_changed` after
        replacing links). A large prompt holds one such list per node, so it holds no names:
        iterate `inputs` where the input's name matters."""
        if self._links is None:
            self._links = [value for value in self.inputs.values() if type(value) is Link]
        return self._links

    def inputs_changed(self) -> None:
        self._links = None

    @property
    def label(self) -> str:
        """`5 'My title' (KSampler)`: how messages name a node."""
        title = self.title or self.class_type
        return f"{self.id} '{title}' ({self.class_type})"


def is_link_value(value: Any) -> bool:
    """ComfyUI's rule: any two-item list whose first item is a string id and second an int is a link."""
    return (
        isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int))
        and not isinstance(value[0], bool) and isinstance(value[1], int) and not isinstance(value[1], bool)
    )


@dataclass(frozen=True, slots=True)
class MalformedLink:
    """A two-item list that reads as a link but is not a valid one (validation reports it)."""

    raw: Any


def parse_input_value(value: Any) -> Any:
    kind = type(value)
    if kind is list:
        if len(value) == 2:
            if is_link_value(value):
                return Link(str(value[0]), value[1])
            return MalformedLink(value)
    elif kind is dict and len(value) == 1 and "__value__" in value:
        return value["__value__"]
    return value


class CycleError(ValueError):
    """A dependency cycle; `path` lists node ids from a node back to itself."""

    def __init__(self, path: list[str], labels: list[str]):
        super().__init__("dependency cycle: " + " -> ".join(labels))
        self.path = path
        self.labels = labels


@dataclass
class Prompt:
    """A parsed prompt. Node order follows the input; expansions append."""

    nodes: dict[str, PromptNode] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    # Node -> the node that runs in its place when an output needs it (a loop body node -> its End
    # Loop, which copies the body per iteration); set by the graph rewrites (execution.rewrite).
    stand_ins: dict[str, str] = field(default_factory=dict)
    _nodes_shared: bool = field(default=False, repr=False, compare=False)  # see fork()

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> "Prompt":
        """Parse an API prompt already checked structurally (see validation.check_structure)."""
        nodes = {}
        for node_id, body in data.items():
            node_id = str(node_id)
            meta = body.get("_meta")
            title = meta.get("title") if type(meta) is dict else None
            inputs: dict[str, Any] = {}
            links: list[Link] = []
            for name, value in (body.get("inputs") or {}).items():
                kind = type(value)
                if kind is list:
                    if len(value) == 2:  # parse_input_value's rule, inlined: this loop is per input
                        source, index = value
                        if type(index) is int and type(source) in (str, int):
                            value = Link(str(source), index)
                            links.append(value)
                        else:
                            value = MalformedLink(value)
                elif kind is dict and len(value) == 1 and "__value__" in value:
                    value = value["__value__"]
                inputs[name] = value
            node = PromptNode(node_id, body["class_type"], inputs, title if type(title) is str else None)
            node._links = links
            nodes[node_id] = node
        return cls(nodes, data)

    def fork(self, raw: dict[str, Any] | None = None) -> "Prompt":
        """A copy that a run may add expansion nodes to and drop them from without touching this
        one (a validated prompt can be run again). The node table is copied on the first `add`
        (most prompts never expand); the nodes themselves are shared."""
        fork = Prompt(self.nodes, self.raw if raw is None else raw, self.stand_ins)
        fork._nodes_shared = True
        return fork

    def __contains__(self, node_id: str) -> bool:
        return node_id in self.nodes

    def __getitem__(self, node_id: str) -> PromptNode:
        return self.nodes[node_id]

    def add(self, node: PromptNode) -> None:
        """Add an expansion's node (only added nodes are ever removed again)."""
        if node.id in self.nodes:
            raise ValueError(f"node id {node.id!r} already exists in the prompt")
        if self._nodes_shared:
            self.nodes = dict(self.nodes)
            self._nodes_shared = False
        self.nodes[node.id] = node

    def ordered_ancestors(self, roots: list[str], visit: Callable[[PromptNode], None] | None = None) -> list[str]:
        """`roots` and everything upstream of them, sources first; CycleError names a cycle.

        One iterative depth-first pass (no recursion, so 50k-node chains are fine). `visit(node)` is
        called for each node as it takes its place in the order, its sources already visited: work
        done there finds the node's memory just read, not read again in a pass of its own (on a
        large prompt, every pass over the nodes is a pass over memory that is no longer in cache)."""
        nodes = self.nodes
        # Node id -> its frame [node, its links still to visit]; the second item is None once done.
        # The frame is the mark, so a node costs one table insert and no second lookup to finish.
        frames: dict[str, list] = {}
        order: list[str] = []
        for root in roots:
            if root in frames or root not in nodes:
                continue
            node = nodes[root]
            frame = frames[root] = [node, iter(node.links())]
            stack = [frame]
            while stack:
                frame = stack[-1]
                for link in frame[1]:
                    source = link.node
                    seen = frames.get(source)
                    if seen is None:
                        node = nodes.get(source)
                        if node is None:
                            continue
                        seen = frames[source] = [node, iter(node.links())]
                        stack.append(seen)
                        break
                    if seen[1] is not None:  # on the current path
                        path = [entry[0].id for entry in stack]
                        cycle = path[path.index(source):] + [source]
                        cycle.reverse()
                        cycle = cycle[:-1]
                        cycle = cycle + [cycle[0]]
                        raise CycleError(cycle, [nodes[i].label for i in cycle])
                else:
                    frame[1] = None
                    node = frame[0]
                    order.append(node.id)
                    if visit is not None:
                        visit(node)
                    stack.pop()
        return order

    def ancestors(self, roots: list[str]) -> list[str]:
        """Every node reachable upstream from `roots` (roots included), iteratively."""
        seen: set[str] = set()
        order: list[str] = []
        stack = list(reversed(roots))
        while stack:
            node_id = stack.pop()
            if node_id in seen or node_id not in self.nodes:
                continue
            seen.add(node_id)
            order.append(node_id)
            for link in self.nodes[node_id].links():
                if link.node not in seen:
                    stack.append(link.node)
        return order

    def topological_order(self, node_ids: list[str] | None = None) -> list[str]:
        """Node ids sources-first (Kahn's algorithm); raises CycleError naming a cycle's path."""
        ids = list(self.nodes) if node_ids is None else node_ids
        members = set(ids)
        indegree = dict.fromkeys(ids, 0)
        consumers: dict[str, list[str]] = {i: [] for i in ids}
        for node_id in ids:
            for link in self.nodes[node_id].links():
                if link.node in members:
                    indegree[node_id] += 1
                    consumers[link.node].append(node_id)
        ready = [i for i in ids if indegree[i] == 0]
        order = []
        while ready:
            node_id = ready.pop()
            order.append(node_id)
            for consumer in consumers[node_id]:
                indegree[consumer] -= 1
                if indegree[consumer] == 0:
                    ready.append(consumer)
        if len(order) < len(ids):
            remaining = {i for i in ids if indegree[i] > 0}
            path = self._find_cycle(remaining)
            raise CycleError(path, [self.nodes[i].label for i in path])
        return order

    def _find_cycle(self, candidates: set[str]) -> list[str]:
        """A concrete cycle among `candidates` (nodes left over by Kahn's algorithm)."""
        start = min(candidates, key=lambda i: (len(i), i))
        # Walk upstream inside the candidate set until a node repeats.
        visited: dict[str, int] = {}
        path: list[str] = []
        current = start
        while current not in visited:
            visited[current] = len(path)
            path.append(current)
            nxt = next((link.node for link in self.nodes[current].links() if link.node in candidates), None)
            if nxt is None:  # pragma: no cover - every leftover node has an upstream leftover
                break
            current = nxt
        cycle = path[visited.get(current, 0):]
        cycle.reverse()  # upstream walk reversed gives data-flow order
        return cycle + [cycle[0]]


@contextlib.contextmanager
def collector_paused(*, keep_as_old: bool = False) -> Iterator[None]:
    """Pause the cyclic garbage collector around work over a whole graph.

    A prompt allocates a few objects per node; with the collector on, its full collections rescan
    every live object again and again, so the time per node would grow with the prompt's size.
    Reference counting still frees everything acyclic at once; cycles wait for the end (or for
    the scheduler's young collections in long runs). Nested use is fine.

    `keep_as_old`: what the block allocated and still holds is long-lived (validation's parsed
    graph: plain data, no tensors). Left young, the first collection after the block would scan it
    all, at a cost per object that grows with the heap; instead it joins the oldest generation,
    for Python's full collections, without a scan (gc.freeze then unfreeze: two list splices). Skipped if the application froze
    objects itself, so its frozen set stays as it made it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if keep_as_old and gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()


class PromptReader:
    """The run's prompt as a node that asks for the hidden DYNPROMPT value reads it.

    Packs written for ComfyUI walk the live graph (expansions included) through a small read API:
    `get_node(id)` gives the node as API-format data, links as `[source_id, output_index]` lists, which
    is what a pack's own graph walk compares and copies into a `GraphBuilder`. Each call builds fresh
    data, so a pack editing what it got changes nothing in the run. Weft's own nodes read `prompt`.
    """

    __slots__ = ("prompt",)

    def __init__(self, prompt: Prompt) -> None:
        self.prompt = prompt

    def _node(self, node_id: Any) -> PromptNode:
        node = self.prompt.nodes.get(str(node_id))
        if node is None:
            raise KeyError(f"node {node_id!r} is not in this run's graph")
        return node

    def get_node(self, node_id: Any) -> dict[str, Any]:
        node = self._node(node_id)
        inputs = {name: value.to_json() if type(value) is Link else value for name, value in node.inputs.items()}
        data: dict[str, Any] = {"class_type": node.class_type, "inputs": inputs}
        if node.title is not None:
            data["_meta"] = {"title": node.title}
        return data

    def has_node(self, node_id: Any) -> bool:
        return str(node_id) in self.prompt.nodes

    def all_node_ids(self) -> set[str]:
        return set(self.prompt.nodes)

    def get_original_prompt(self) -> dict[str, Any]:
        return self.prompt.raw

    def get_real_node_id(self, node_id: Any) -> str:
        node = self._node(node_id)
        return node.real_id or node.id

    def get_parent_node_id(self, node_id: Any) -> str | None:
        return self._node(node_id).parent

    def get_display_node_id(self, node_id: Any) -> str:
        return self._node(node_id).display_id
