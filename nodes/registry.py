"""The node registry: every NodeSpec the application knows, built-ins and plugins alike."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from execution.spec import GraphCheck, NodeDefinitionError, NodeSpec


class NodeRegistry:
    """Node id -> NodeSpec (execution's `Registry`). Registration refuses duplicates unless an
    override is asked for."""

    def __init__(self) -> None:
        self._specs: dict[str, NodeSpec] = {}
        self._origin: dict[str, str] = {}
        # Checks over the whole prompt (such as loop pairing), run by validation after the per-node checks.
        self.graph_checks: list[GraphCheck] = []
        self.generation = 0  # grows with every registration, so memos keyed on it notice changes
        # Sources that failed to register (plugin name -> (reason, "does it declare this node id?")),
        # so an unknown node id can be traced to the pack that would have provided it.
        self._failed_sources: dict[str, tuple[str, Callable[[str], bool]]] = {}

    def register(self, spec: NodeSpec, *, origin: str = "built-in", override: bool = False) -> None:
        if not isinstance(spec, NodeSpec):
            raise NodeDefinitionError(f"{origin}: expected a NodeSpec, got {type(spec).__name__}")
        if spec.node_id in self._specs and not override:
            raise NodeDefinitionError(
                f"node '{spec.node_id}' from {origin}: id already registered by {self._origin[spec.node_id]}"
            )
        self._specs[spec.node_id] = spec
        self._origin[spec.node_id] = origin
        self.generation += 1

    def register_all(self, specs: Iterable[NodeSpec], *, origin: str = "built-in", override: bool = False) -> None:
        """Register a batch atomically: either every node is added or none is."""
        specs = list(specs)
        ids = [s.node_id for s in specs]
        if not override:
            for spec in specs:
                if spec.node_id in self._specs:
                    raise NodeDefinitionError(
                        f"node '{spec.node_id}' from {origin}: id already registered by "
                        f"{self._origin[spec.node_id]}"
                    )
        dupes = {i for i in ids if ids.count(i) > 1}
        if dupes:
            raise NodeDefinitionError(f"{origin}: node id(s) {sorted(dupes)} declared twice")
        for spec in specs:
            self.register(spec, origin=origin, override=override)

    def get(self, node_id: str) -> NodeSpec | None:
        return self._specs.get(node_id)

    def origin(self, node_id: str) -> str | None:
        return self._origin.get(node_id)

    def note_failed_source(self, source: str, reason: str, provides: Callable[[str], bool]) -> None:
        """Remember that `source` (a plugin) failed for `reason`; `provides(node_id)` tells its nodes."""
        self._failed_sources[source] = (reason, provides)

    def forget_failed_source(self, source: str) -> None:
        """`source` loaded after all (a re-load): stop blaming it."""
        self._failed_sources.pop(source, None)

    def missing_cause(self, node_id: str) -> dict[str, str] | None:
        """`{source, reason}` of a failed source that declares the unregistered `node_id`, or None."""
        for source, (reason, provides) in self._failed_sources.items():
            if provides(node_id):
                return {"source": source, "reason": reason}
        return None

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._specs

    def __iter__(self) -> Iterator[NodeSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)


def builtin_registry() -> NodeRegistry:
    """A registry holding every built-in node pack, collected from their explicit NODES lists."""
    from nodes import builtin_packs

    registry = NodeRegistry()
    for module in builtin_packs():
        registry.register_all(module.NODES, origin=module.__name__)
        registry.graph_checks.extend(getattr(module, "GRAPH_CHECKS", ()))
    return registry
