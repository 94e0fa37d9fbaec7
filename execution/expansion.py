"""Expansion: a node that returns a graph is completed by that graph's nodes.

The rules (also in the scheduler's module docstring):

- Ids. A child id is prefixed with the expanding node's id (`parent.child`); a child key that
  starts with "/" is taken as an absolute id, which the expanding node guarantees unique, so a
  chain of expansions does not grow its ids with every level.
- Result. The node's outputs become a template of links into its expansion; the node waits for the
  linked nodes, and for the expansion's output nodes that no other child consumes, then its
  template is resolved into its values.
- Tail expansion. A salted node (never cached) whose only waiter is the node that expanded it, and
  that node is itself waiting for its expansion, hands its own expansion over to that node: the
  parent adopts the links, targets and children, and the handing node is dropped. A chain of steps
  that each expand the next (loop iterations) so holds one step, not one per link of the chain.
"""
from __future__ import annotations

from typing import Any

from execution.failure import RunFailure
from execution.graph import CycleError, Link, PromptNode, is_link_value, parse_input_value
from execution.readiness import RELEASED, Readiness, Slot


class Expansion:
    """Adds expansions to one run's prompt and readiness, and resolves their results."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness
        self.prompt = readiness.prompt
        self.registry = readiness.registry

    def expand(self, slot: Slot, outputs: list[list[Any]], graphs: list[dict]) -> None:
        """`slot` returned `graphs` (one per call) with `outputs` linking into them."""
        node = slot.node
        if len(graphs) > 1:
            raise RunFailure.node_raised(
                node, RuntimeError("a node that expands cannot also be mapped over a list input"))
        graph = graphs[0]
        renamed = {str(child): (str(child)[1:] if str(child).startswith("/") else f"{node.id}.{child}")
                   for child in graph}
        for new_id in renamed.values():
            if new_id in self.prompt.nodes:
                raise RunFailure.node_raised(
                    node, RuntimeError(f"expansion node id {new_id!r} is already in the graph"))
        new_ids = [self._add_child(node, child, body, renamed) for child, body in graph.items()]
        nodes = self.prompt.nodes
        for child in new_ids:
            for name, value in nodes[child].inputs.items():
                if type(value) is Link and value.node not in nodes:
                    raise RunFailure.node_raised(node, RuntimeError(
                        f"its expansion links input {name!r} of {nodes[child].class_type} to node "
                        f"{value.node!r}, which is not in the graph"))
        try:
            self.readiness.sign(new_ids)  # the expansion's own nodes, sorted; outer sources are known
        except CycleError as cycle:  # the node that expanded is the one a client can point at
            raise RunFailure.node_raised(node, RuntimeError(
                f"its expansion has a dependency cycle: {' -> '.join(cycle.labels)}")) from None
        template = []
        targets = set()
        for values in outputs:
            resolved = []
            for value in values:
                if is_link_value(value):
                    link = Link(renamed.get(str(value[0]), str(value[0])), value[1])
                    targets.add(link.node)
                    resolved.append(link)
                else:
                    resolved.append(value)
            template.append(resolved)
        # Output nodes no other child consumes are targets; a consumed one runs when its consumer does.
        consumed = {link.node for child in new_ids for link in nodes[child].links()}
        for child in new_ids:
            if self.registry.get(nodes[child].class_type).output_node and child not in consumed:
                targets.add(child)
        readiness = self.readiness
        parent = readiness.slots.get(node.parent) if node.parent is not None else None
        if node.salt is not None and parent is not None and parent.template is not None \
                and slot.waiters == [parent]:
            self._hand_over(slot, parent, template, targets, new_ids)
            return
        slot.template = template
        stack: list[Slot] = []
        readiness.wait_for(slot, [readiness.slot(target) for target in targets], stack)
        readiness.need(stack)

    def _add_child(self, node: PromptNode, child: Any, body: dict, renamed: dict[str, str]) -> str:
        inputs = {}
        for name, value in (body.get("inputs") or {}).items():
            value = parse_input_value(value)
            if type(value) is Link:
                value = Link(renamed.get(value.node, value.node), value.output)
            inputs[name] = value
        new = PromptNode(renamed[str(child)], body["class_type"], inputs, (body.get("_meta") or {}).get("title"),
                         parent=node.id, display_id=str(body.get("override_display_id") or node.display_id),
                         real_id=body.get("real_node_id"))
        new.salt = body.get("cache_salt")
        if self.registry.get(new.class_type) is None:
            raise RunFailure.node_raised(node, RuntimeError(f"expansion uses unknown node type {new.class_type!r}"))
        self.prompt.add(new)
        return new.id

    def _hand_over(self, slot: Slot, parent: Slot, template: list[list[Any]], targets: set[str],
                   new_ids: list[str]) -> None:
        """Tail expansion (module docstring): `parent` adopts `slot`'s expansion; `slot` is dropped."""
        node = slot.node
        for items in parent.template:
            if any(type(item) is Link and item.node == node.id for item in items):
                items[:] = [part for item in items for part in (
                    template[item.output] if type(item) is Link and item.node == node.id else (item,))]
        for child in new_ids:
            self.prompt.nodes[child].parent = node.parent
        readiness = self.readiness
        slot.waiters = None
        slot.uses = 0
        if parent.deps is not None and slot in parent.deps:
            parent.deps.remove(slot)
        if parent.blocked:  # the parent waited on `slot`, which has not finished
            parent.blocked -= 1
        stack: list[Slot] = []
        readiness.wait_for(parent, [readiness.slot(target) for target in targets], stack)
        readiness.need(stack)
        # Only now release what `slot` read, so values its expansion also reads stay alive.
        readiness.consumed(slot)
        slot.requested = None
        slot.phase = RELEASED
        readiness.forget(slot)

    def resolve(self, slot: Slot) -> None:
        """`slot`'s expansion finished: its template's links become its values."""
        template, slot.template = slot.template, None
        slots = self.readiness.slots
        outputs = []
        for items in template:
            resolved: list[Any] = []
            for item in items:
                if type(item) is Link:
                    resolved.extend(slots[item.node].values[item.output])
                else:
                    resolved.append(item)
            outputs.append(resolved)
        self.readiness.complete(slot, outputs, None)
