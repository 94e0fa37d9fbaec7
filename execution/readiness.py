"""Readiness: which nodes of a run must run, which can run now, and when their values go.

The run's node table (`Readiness.slots`), each node's `Slot` with its explicit `Phase`, the ready
stack, signatures and cache lookups. The states and their transitions are described once, in the
`execution.scheduler` module docstring.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Any, Callable, Iterable

from execution.cache import CachedResult, OutputCache, node_signature
from execution.graph import Link, Prompt, PromptNode
from execution.spec import NodeSpec, Registry


class Phase(IntEnum):
    """Where a node is in one run (see the scheduler's module docstring for the transitions)."""

    IDLE = 0  # known to the run (signed), not needed by anything yet
    PENDING = 1  # needed; waits for `blocked` deps
    READY = 2  # needed; nothing to wait for; on the ready stack
    RUNNING = 3  # taken off the ready stack: its call (or its expansion's resolution) is under way
    FINISHED = 4  # its values are held for its consumers
    RELEASED = 5  # its values were dropped (the cache may still hold them)


# Module-level names: these are read on every transition of every node.
IDLE, PENDING, READY, RUNNING, FINISHED, RELEASED = Phase


class Slot:
    """One node's state in one run; the fields are the scheduler docstring's. Its edges (deps,
    waiters) hold slots, not ids: following one is attribute access, not a lookup in a prompt-sized
    table (whose cost per lookup grows with the prompt)."""

    __slots__ = ("node", "spec", "phase", "signature", "stable", "values", "uses", "deps", "blocked", "waiters",
                 "requested", "template")

    def __init__(self, node: PromptNode, spec: NodeSpec) -> None:
        self.node = node
        self.spec = spec
        self.phase = IDLE
        self.signature: str | None = None
        self.stable = False  # the signature depends on the prompt alone (see Readiness.sign_prompt)
        self.values: tuple[tuple[Any, ...], ...] | None = None
        self.uses = 0
        self.deps: list[Slot] | None = None
        self.blocked = 0
        self.waiters: list[Slot] | None = None
        self.requested: set[str] | None = None
        self.template: list[list[Any]] | None = None

    def __repr__(self) -> str:
        return f"Slot({self.node.id!r}, {self.phase.name})"


class Readiness:
    """The slots of one run and the rules that move them from phase to phase."""

    def __init__(self, prompt: Prompt, registry: Registry, cache: OutputCache, structural: list[str | None],
                 served: Callable[[Slot, CachedResult], None]) -> None:
        self.prompt = prompt
        self.registry = registry
        self.cache = cache
        self.structural = structural
        self.served = served  # told of each node the cache finished
        self.slots: dict[str, Slot] = {}
        self.ready: list[Slot] = []
        self.pending = 0  # slots in PENDING, READY or RUNNING (the run ends with none)
        self.used_signatures: set[str] = set()

    def slot(self, node_id: str) -> Slot:
        """The slot of `node_id`, made on first use."""
        slot = self.slots.get(node_id)
        if slot is None:
            node = self.prompt.nodes[node_id]
            slot = self.slots[node_id] = Slot(node, self.registry.get(node.class_type))
        return slot

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for slot in self.slots.values():
            counts[slot.phase.name] = counts.get(slot.phase.name, 0) + 1
        parts = ", ".join(f"{name.lower()} {counts[name]}" for name in Phase.__members__ if name in counts)
        return f"Readiness({parts}; ready stack {len(self.ready)})"

    # ------------------------------------------------------------------ signatures
    def _fingerprint(self, node: PromptNode, spec: NodeSpec) -> Any:
        fingerprint = spec.fingerprint
        if fingerprint is None:
            return node.salt
        # Linked inputs have no value yet: ComfyUI passes them as None, so a hook naming one still runs.
        arguments = {k: (None if type(v) is Link else v) for k, v in node.inputs.items()}
        try:
            mark = fingerprint(**spec.group_arguments(arguments))
        except Exception:  # a failing fingerprint means "cannot tell": always run
            mark = float("nan")
        if node.salt is None or (isinstance(mark, float) and mark != mark):
            return mark
        return (node.salt, mark)

    def _upstream_signature(self, node_id: str) -> str | None:
        slot = self.slots.get(node_id)
        return slot.signature if slot is not None else None

    def _sign(self, slot: Slot) -> None:
        slot.signature = node_signature(slot.node, slot.spec, self._upstream_signature, fingerprint=self._fingerprint)

    def sign_prompt(self, order: list[str]) -> None:
        """Slots and signatures for the prompt's nodes in `order` (sources first).

        A node whose signature cannot change between runs of the same validated prompt (no
        fingerprint, no salt, and the same holds for its sources) is computed once and kept in
        `structural` at its position in `order`, so an unchanged re-run costs a lookup per node."""
        structural = self.structural
        known = len(structural) == len(order)
        if not known:
            structural[:] = [None] * len(order)
        slots, nodes, spec_of = self.slots, self.prompt.nodes, self.registry.get
        for index, node_id in enumerate(order):
            node = nodes[node_id]
            slot = slots[node_id] = Slot(node, spec_of(node.class_type))
            signature = structural[index]
            if signature is not None:
                slot.signature, slot.stable = signature, True
                continue
            self._sign(slot)
            if not known and node.salt is None and slot.spec.fingerprint is None:
                for link in node.links():
                    source = slots.get(link.node)
                    if source is None or not source.stable:
                        break
                else:
                    slot.stable = True
                    structural[index] = slot.signature

    def sign(self, node_ids: list[str]) -> None:
        """Signatures for `node_ids` (expansion nodes, or ancestors reached late), sources first."""
        for node_id in self.prompt.topological_order(node_ids):
            self._sign(self.slot(node_id))

    # ------------------------------------------------------------------ needing nodes
    def _deps_of(self, slot: Slot) -> list[Slot]:
        """The slots `slot` reads now (its lazy inputs only once requested); may repeat a slot."""
        node, spec = slot.node, slot.spec
        requested = slot.requested or ()
        deps = []
        for name, link in node.inputs.items():
            if type(link) is not Link:
                continue
            inp = spec.input(name) if "." not in name else None
            lazy = inp.lazy if inp is not None else _dotted_lazy(spec, node, name)
            if not lazy or name in requested:
                deps.append(self.slot(link.node))
        return deps

    def need(self, roots: Iterable[Slot]) -> None:
        """Move `roots` and what they need out of IDLE (or RELEASED): to FINISHED from the cache,
        else to PENDING or READY, iteratively."""
        stack = list(roots)
        cache_get = self.cache.get
        while stack:
            slot = stack.pop()
            if slot.phase is not IDLE and slot.phase is not RELEASED:
                continue
            node = slot.node
            if slot.signature is None:  # an expansion linked to a node outside the outputs' ancestry
                self.sign([n for n in self.prompt.ancestors([node.id]) if self._upstream_signature(n) is None])
            signature = slot.signature
            if node.salt is None and node.parent is not None:
                # An expansion's node (a salted one is never stored, so the cache need not keep its
                # key); the prompt's own nodes are all kept at the end of the run.
                self.used_signatures.add(signature)
            hit = cache_get(signature)
            if hit is not None:
                slot.values = hit.outputs
                self.served(slot, hit)
                self.finish(slot)
                continue
            self.wait_for(slot, self._deps_of(slot), stack)

    def wait_for(self, slot: Slot, deps: Iterable[Slot], stack: list[Slot]) -> None:
        """`slot` reads `deps`: count the new ones as uses, wait for those not finished (pushed on
        `stack` for `need`). The slot becomes PENDING, or READY when it has nothing to wait for.

        Only a dep new to the node can be unfinished: every call names inputs the node did not
        read before (its first staging, requested lazy inputs, an expansion's result links)."""
        known = slot.deps
        if known is None:
            known = slot.deps = []
            self.pending += 1
        blocked = slot.blocked
        for dep in deps:
            if dep in known:
                continue
            known.append(dep)
            dep.uses += 1
            if dep.phase is not FINISHED:
                blocked += 1
                if dep.waiters is None:
                    dep.waiters = [slot]
                else:
                    dep.waiters.append(slot)
                stack.append(dep)
        slot.blocked = blocked
        if blocked:
            slot.phase = PENDING
        else:
            slot.phase = READY
            self.ready.append(slot)

    def take(self) -> Slot:
        """The next READY slot (last in, first out: depth first, so values are consumed early)."""
        slot = self.ready.pop()
        slot.phase = RUNNING
        return slot

    def complete(self, slot: Slot, outputs: list[list[Any]], ui: dict | None,
                 notes: dict[str, list] | None = None) -> None:
        """`slot` produced `outputs` (and `ui`, and profile `notes`): store them (unless salted), drop its inputs,
        wake its waiters."""
        # Held (and cached) as tuples: a one-item tuple is half the memory of a one-item list, and
        # a large prompt holds one per node output. Input-is-list nodes still receive lists.
        values = slot.values = tuple(map(tuple, outputs))
        if slot.node.salt is None:  # a salted node (a copy that opted out of caching) is never reused
            self.cache.put(slot.signature, CachedResult(values, ui, notes=notes))
        self.consumed(slot)
        self.finish(slot)

    def finish(self, slot: Slot) -> None:
        """`slot` is FINISHED: its waiters have one dep less; with no uses left it is released at once."""
        slot.phase = FINISHED
        waiters = slot.waiters
        if waiters is not None:
            slot.waiters = None
            ready = self.ready
            for waiter in waiters:
                blocked = waiter.blocked
                if blocked:
                    waiter.blocked = blocked - 1
                    if blocked == 1:
                        waiter.phase = READY
                        ready.append(waiter)
        if slot.uses <= 0:
            self.release(slot)

    def consumed(self, slot: Slot) -> None:
        """`slot` no longer needs its inputs' values; a dep with no uses left is released."""
        deps = slot.deps
        if deps is None:
            return
        slot.deps = None
        self.pending -= 1
        for dep in deps:
            dep.uses -= 1
            if dep.uses <= 0 and dep.phase is FINISHED:
                self.release(dep)

    def release(self, slot: Slot) -> None:
        """Drop `slot`'s values; an ephemeral node that nothing waits on is forgotten altogether."""
        slot.phase = RELEASED
        slot.uses = 0
        slot.values = None
        node = slot.node
        if node.parent is not None and slot.deps is None and slot.template is None \
                and self.slots.get(node.id) is slot:
            # So a long chain of expansions (loop iterations) holds one step at a time.
            self.forget(slot)

    def forget(self, slot: Slot) -> None:
        """Remove an ephemeral node from the run and its prompt."""
        slot.waiters = None
        del self.slots[slot.node.id]
        del self.prompt.nodes[slot.node.id]

    def held_values(self) -> int:
        """How many nodes' values the run holds now."""
        return sum(1 for slot in self.slots.values() if slot.phase is FINISHED)

    def stuck(self) -> list[str]:
        """Up to ten nodes still waiting (sorted), when the ready stack ran dry."""
        return sorted(node_id for node_id, slot in self.slots.items() if slot.deps is not None)[:10]


def _dotted_lazy(spec: NodeSpec, node: PromptNode, name: str) -> bool:
    inp = spec.instance_inputs(node.inputs).get(name)
    return bool(inp is not None and inp.lazy)
