"""The scheduler: runs a validated prompt, pulling from its output nodes.

State of one run (`_RunState`), all of it in one place:

    prompt       the graph; expansions add ephemeral nodes to it while the run goes on
    slots        node id -> its `_Slot`, the node's state in this run (below); made for every node
                 the outputs need, sources first, when its signature is computed
    structural   signatures that depend on the prompt alone, by position in the validated order,
                 kept with the validated prompt for its next run
    ready        pending slots with nothing to wait for, run last-in first-out (depth first, so
                 intermediates are consumed and freed early)
    running      async node calls in flight
    pending      how many slots have deps (the run ends with none)

A node's state, on its slot (edges hold slots, so following one is attribute access, not a lookup
in a prompt-sized table: a 50k-node run made some forty such lookups per node, each slower the
larger the tables, and its time per node grew with the prompt):

    signature    structural cache key (computed once, sources first)
    stable       whether that signature is the prompt's alone (kept in `structural`)
    values       per-output tuples of items (ComfyUI's list semantics) while the node's outputs
                 are held; None before it finished and once released (the cache may still hold them)
    uses         how many pending consumers still need its values; at zero the values are released
    deps         while pending (an output needs it and it has not finished): the slots whose values
                 it reads (non-lazy inputs, requested lazy inputs, and, for a node that expanded,
                 the nodes its result links point at)
    blocked      how many of its deps have not finished
    waiters      pending slots among whose deps it is, not finished yet
    requested    lazy inputs requested so far
    template     an expanded node's result, links into its expansion, resolved once that finished

Only what the outputs need and the cache lacks runs; an output that has a stand-in
(`prompt.stand_ins`: a loop body node) is reached through it. Link inputs a node does not declare are
plain dependencies: waited for and kept alive, never passed to execute. A salted node (never cached)
whose only waiter is the node that expanded it hands its own expansion to that node ("tail
expansion"), so a chain of steps (loop iterations) holds one step instead of one per iteration.
Lazy inputs are requested through
`check_lazy_status` and the node is re-staged until satisfied. A node not marked input-is-list is
called once per element of its list inputs (shorter lists repeat their last element); outputs marked
is-list concatenate. `ExecutionBlocker` values skip their consumers. Interruption and cancellation
are checked between nodes and inside progress callbacks.
"""
from __future__ import annotations

import asyncio
import gc
import inspect
import resource
import sys
import threading
import time
import traceback
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable

from execution import context as run_context
from execution.cache import CachedResult, NoCache, OutputCache, node_signature
from execution.events import EventBus, timestamp_ms
from execution.graph import Link, Prompt, PromptNode, collector_paused, is_link_value, parse_input_value
from execution.paths import Paths
from execution.types import ExecutionBlocker, NodeOutput, normalize_result
from execution.validation import ValidatedPrompt


class JobControl:
    """Cooperative interruption of one job; set from any thread."""

    def __init__(self) -> None:
        self.interrupted = False  # read between nodes and in progress callbacks; set from any thread

    def interrupt(self) -> None:
        self.interrupted = True


class ProfileRows:
    """The per-node profile of one job, stored column by column: a 50k-node job records 50k rows,
    and a row of Python objects per node was a good part of such a job's memory traffic.

    Ephemeral nodes (loop iterations) add up under one row keyed `display_id:class_type`."""

    NUMBERS = ("wall_ms", "cpu_ms", "peak_rss_growth_bytes", "calls", "runs")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.class_types: list[str] = []
        self.display_nodes: list[str] = []
        self.cached = bytearray()
        self.numbers = array("d")  # NUMBERS per row, row after row
        self._summed: dict[str, int] = {}  # key of an added-up row -> its row index

    def add(self, key: str, class_type: str, display_node: str, cached: bool, *numbers: float) -> None:
        """Record one node's row (numbers in NUMBERS order)."""
        self.keys.append(key)
        self.class_types.append(class_type)
        self.display_nodes.append(display_node)
        self.cached.append(cached)
        self.numbers.extend(numbers)

    def add_up(self, key: str, class_type: str, display_node: str, *numbers: float) -> None:
        """Add a run of an ephemeral node to its row under `key`."""
        index = self._summed.get(key)
        if index is None:
            self._summed[key] = len(self.keys)
            self.add(key, class_type, display_node, False, *numbers)
            return
        base = index * len(self.NUMBERS)
        for offset, value in enumerate(numbers):
            self.numbers[base + offset] += value

    def as_dicts(self) -> dict[str, dict]:
        """key -> {class_type, display_node, cached, wall_ms, cpu_ms, peak_rss_growth_bytes, calls, runs}."""
        width = len(self.NUMBERS)
        rows = {}
        for index, key in enumerate(self.keys):
            row = {"class_type": self.class_types[index], "display_node": self.display_nodes[index],
                   "cached": bool(self.cached[index])}
            for offset, name in enumerate(self.NUMBERS):
                value = self.numbers[index * width + offset]
                row[name] = value if name.endswith("_ms") else int(value)
            rows[key] = row
        return rows


@dataclass
class JobResult:
    """How a job ended, what its output nodes showed, and its per-node profile."""

    prompt_id: str
    status: str  # success | error | interrupted
    outputs: dict[str, dict] = field(default_factory=dict)  # display node id -> ui output
    error: dict | None = None
    executed: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    profile_rows: ProfileRows = field(default_factory=ProfileRows)
    messages: list[tuple[str, dict]] = field(default_factory=list)
    meta: dict[str, dict] = field(default_factory=dict)

    @property
    def profile(self) -> dict[str, dict]:
        """Per node: class_type, display_node, cached, wall_ms, cpu_ms, peak_rss_growth_bytes, calls, runs."""
        return self.profile_rows.as_dicts()

    def __repr__(self) -> str:  # asyncio reprs task results; a 50k-node profile must not be printed
        return f"JobResult({self.prompt_id!r}, {self.status!r}, executed={len(self.executed)}, cached={len(self.cached)})"


class _Collected:
    """A node's outputs gathered over its calls."""

    __slots__ = ("outputs", "ui", "expansions")

    def __init__(self, output_count: int) -> None:
        self.outputs: list[list[Any]] = [[] for _ in range(output_count)]
        self.ui: dict = {}
        self.expansions: list[dict] = []


class _CallGuard:
    """Around one call of a node: its context active, and what it raises turned into the job's error."""

    __slots__ = ("state", "node", "context", "gathered", "token")

    def __init__(self, state: "_RunState", node: PromptNode, gathered: dict) -> None:
        self.state, self.node, self.gathered = state, node, gathered
        self.context = state._context(node)

    def __enter__(self) -> None:
        self.token = run_context.activate(self.context)

    def __exit__(self, kind, exc, tb) -> bool:
        run_context.deactivate(self.token)
        if exc is None or isinstance(exc, NodeExecutionError):
            return False
        if isinstance(exc, run_context.ExecutionInterrupted):
            exc.node = self.node
            return False
        if isinstance(exc, Exception):
            raise NodeExecutionError(self.state._error_payload(self.node, exc, self.gathered)) from exc
        return False


class _NodeRun:
    """One node's run: started (events, blocker check, timers), its calls, then ended (profile, outputs)."""

    __slots__ = ("state", "slot", "wall0", "cpu0", "skipped", "calls", "collected", "guard")

    def __init__(self, state: "_RunState", slot: "_Slot", gathered: dict) -> None:
        self.state, self.slot = state, slot
        node, spec = slot.node, slot.spec
        self.wall0, self.cpu0 = time.perf_counter(), time.thread_time()
        blocked = state._begin(node, spec, gathered)
        self.skipped = blocked is not None
        if self.skipped:
            state._end(slot, [[blocked] for _ in spec.outputs], None, [], 0, self.wall0, self.cpu0)
            return
        self.calls = state._call_args(spec, gathered)
        self.collected = _Collected(len(spec.outputs))
        self.guard = _CallGuard(state, node, gathered)

    def end(self) -> None:
        collected = self.collected
        self.state._end(self.slot, collected.outputs, collected.ui or None, collected.expansions,
                        len(self.calls), self.wall0, self.cpu0)


class NodeExecutionError(Exception):
    """A node raised; carries the event payload for execution_error."""

    def __init__(self, payload: dict):
        super().__init__(payload.get("exception_message", ""))
        self.payload = payload


def _merge_ui(into: dict, ui: dict) -> None:
    for key, value in ui.items():
        if isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = into[key] + value
        else:
            into[key] = value


def _summarise(value: Any) -> Any:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__}{tuple(shape)} {getattr(value, 'dtype', '')}".strip()
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(value, str):
        return value if len(value) < 200 else value[:200] + "..."
    if isinstance(value, (list, tuple)):
        return [_summarise(v) for v in value[:8]]
    if isinstance(value, dict):
        return {str(k): _summarise(v) for k, v in list(value.items())[:16]}
    return type(value).__name__


class Executor:
    """Runs prompts against a registry with one output cache shared across jobs."""

    def __init__(self, registry, *, cache: OutputCache | None = None, events: EventBus | None = None,
                 paths: Paths | None = None, runtime: dict | None = None) -> None:
        self.registry = registry
        self.cache = cache if cache is not None else NoCache()
        self.events = events or EventBus()
        self.paths = paths or Paths(".")
        self.runtime = runtime if runtime is not None else {}
        self._lock = threading.Lock()  # one prompt at a time: nodes share models and memory

    def run(self, validated: ValidatedPrompt, *, prompt_id: str, extra_data: dict | None = None,
            control: JobControl | None = None) -> JobResult:
        """Run a validated prompt to completion (blocking)."""
        with self._lock:
            return asyncio.run(self.run_async(validated, prompt_id=prompt_id, extra_data=extra_data,
                                              control=control))

    async def run_async(self, validated: ValidatedPrompt, *, prompt_id: str, extra_data: dict | None = None,
                        control: JobControl | None = None) -> JobResult:
        # The run adds and drops expansion nodes in its own copy: the validated prompt can run again.
        state = _RunState(self, validated.prompt.fork(), prompt_id, extra_data or {}, control or JobControl(),
                          validated.signatures if validated.order is not None else None)
        return await state.run(validated.outputs, validated.order)


# The collector is paused over a run (graph.collector_paused). So that cyclic garbage cannot pile up
# in a long run (loop iterations), young objects are collected once this many have accumulated.
# Few large collections, not one per so many nodes: each young collection also ages the survivors,
# and ten of them make the next automatic collection traverse everything the run still holds.
YOUNG_OBJECTS_BEFORE_COLLECT = 1_000_000


class _Slot:
    """One node's state in one run; the fields are the module docstring's. Its edges (deps,
    waiters) hold slots, not ids: a node's bookkeeping is attribute access on one object instead of
    lookups in prompt-sized tables."""

    __slots__ = ("node", "spec", "signature", "stable", "values", "uses", "deps", "blocked", "waiters",
                 "requested", "template")

    def __init__(self, node: PromptNode, spec) -> None:
        self.node = node
        self.spec = spec
        self.signature: str | None = None
        self.stable = False  # the signature depends on the prompt alone (see _sign_prompt)
        self.values: tuple[tuple[Any, ...], ...] | None = None
        self.uses = 0
        self.deps: list[_Slot] | None = None
        self.blocked = 0
        self.waiters: list[_Slot] | None = None
        self.requested: set[str] | None = None
        self.template: list[list[Any]] | None = None

    def __repr__(self) -> str:
        return f"_Slot({self.node.id!r})"


class _RunState:
    """One prompt's scheduler state (see the module docstring for each field)."""

    def __init__(self, executor: Executor, prompt: Prompt, prompt_id: str, extra_data: dict,
                 control: JobControl, structural: list[str | None] | None = None) -> None:
        self.ex = executor
        self.registry = executor.registry
        self.cache = executor.cache
        self.bus = executor.events
        self.prompt = prompt
        self.prompt_id = prompt_id
        self.extra_data = extra_data
        self.control = control
        self.slots: dict[str, _Slot] = {}
        # Signatures that depend on the prompt alone, by position in the validated order, kept with
        # the validated prompt across its runs.
        self.structural: list[str | None] = structural if structural is not None else []
        self.ready: list[_Slot] = []
        self.running: dict[asyncio.Task, _Slot] = {}
        self.pending = 0  # slots whose deps are set
        self.used_signatures: set[str] = set()
        self.result = JobResult(prompt_id, "success")
        self.cached_now: list[str] = []
        self.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def _is_interrupted(self) -> bool:
        return self.control.interrupted

    def _slot(self, node_id: str) -> _Slot:
        slot = self.slots.get(node_id)
        if slot is None:
            node = self.prompt.nodes[node_id]
            slot = self.slots[node_id] = _Slot(node, self.registry.get(node.class_type))
        return slot

    # ------------------------------------------------------------------ events
    def emit(self, event: str, data: dict) -> None:
        if event in ("execution_start", "execution_cached", "execution_success", "execution_error",
                     "execution_interrupted"):
            self.result.messages.append((event, data))
        if self.bus.active:
            self.bus.emit(event, data)

    # ------------------------------------------------------------------ signatures
    def _fingerprint(self, node: PromptNode, spec) -> Any:
        fingerprint = getattr(spec, "fingerprint", None)
        if fingerprint is None:
            return node.salt
        constants = {k: v for k, v in node.inputs.items() if type(v) is not Link}
        try:
            mark = fingerprint(**spec.group_arguments(constants))
        except Exception:  # a failing fingerprint means "cannot tell": always run
            mark = float("nan")
        if node.salt is None or (isinstance(mark, float) and mark != mark):
            return mark
        return (node.salt, mark)

    def _upstream_signature(self, node_id: str) -> str | None:
        slot = self.slots.get(node_id)
        return slot.signature if slot is not None else None

    def _sign(self, slot: _Slot) -> None:
        slot.signature = node_signature(slot.node, slot.spec, self._upstream_signature, fingerprint=self._fingerprint)

    def _sign_prompt(self, order: list[str]) -> None:
        """Signatures of the prompt's nodes in `order` (sources first).

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
            slot = slots[node_id] = _Slot(node, spec_of(node.class_type))
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

    def compute_signatures(self, node_ids: list[str]) -> None:
        """Signatures for `node_ids` (expansion nodes, or ancestors reached late), sources first."""
        for node_id in self.prompt.topological_order(node_ids):
            self._sign(self._slot(node_id))

    # ------------------------------------------------------------------ needing nodes
    def _deps_of(self, slot: _Slot) -> list[_Slot]:
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
                deps.append(self._slot(link.node))
        return deps

    def need(self, roots: Iterable[_Slot]) -> None:
        """Make `roots` and what they need pending (or finished from the cache), iteratively."""
        stack = list(roots)
        while stack:
            slot = stack.pop()
            if slot.values is not None or slot.deps is not None:
                continue
            node = slot.node
            if slot.signature is None:  # an expansion linked to a node outside the outputs' ancestry
                self.compute_signatures([n for n in self.prompt.ancestors([node.id])
                                         if self._upstream_signature(n) is None])
            signature = slot.signature
            if node.salt is None and node.parent is not None:
                # An expansion's node (a salted one is never stored, so the cache need not keep its
                # key); the prompt's own nodes are all kept at the end of the run.
                self.used_signatures.add(signature)
            hit = self.cache.get(signature)
            if hit is not None:
                slot.values = hit.outputs
                self.result.cached.append(node.id)
                self.cached_now.append(node.id)
                if node.parent is None:
                    self.result.profile_rows.add(node.id, node.class_type, node.display_id, True, 0.0, 0.0, 0, 0, 0)
                if hit.ui:
                    self._record_ui(node, hit.ui)
                self._finish(slot)
                continue
            self._wait_for(slot, self._deps_of(slot), stack)

    def _wait_for(self, slot: _Slot, deps: Iterable[_Slot], stack: list[_Slot]) -> None:
        """`slot` reads `deps`: count the new ones as uses, wait for those not finished.

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
            if dep.values is None:
                blocked += 1
                if dep.waiters is None:
                    dep.waiters = [slot]
                else:
                    dep.waiters.append(slot)
                stack.append(dep)
        slot.blocked = blocked
        if not blocked:
            self.ready.append(slot)

    def _finish(self, slot: _Slot) -> None:
        waiters = slot.waiters
        if waiters is not None:
            slot.waiters = None
            ready = self.ready
            for waiter in waiters:
                blocked = waiter.blocked
                if blocked:
                    waiter.blocked = blocked - 1
                    if blocked == 1:
                        ready.append(waiter)
        if slot.uses <= 0:
            self._release(slot)

    def _consumed(self, slot: _Slot) -> None:
        """`slot` finished: it no longer needs its inputs' values."""
        deps = slot.deps
        if deps is None:
            return
        slot.deps = None
        self.pending -= 1
        for dep in deps:
            dep.uses -= 1
            if dep.uses <= 0 and dep.values is not None:
                self._release(dep)

    def _release(self, slot: _Slot) -> None:
        slot.uses = 0
        slot.values = None
        node = slot.node
        if node.parent is not None and slot.deps is None and slot.template is None \
                and self.slots.get(node.id) is slot:
            # An ephemeral node nobody waits on is forgotten, so a long loop holds one iteration at a time.
            del self.slots[node.id]
            del self.prompt.nodes[node.id]
            slot.waiters = None

    def held_values(self) -> int:
        """How many nodes' values the run holds now."""
        return sum(1 for slot in self.slots.values() if slot.values is not None)

    # ------------------------------------------------------------------ running
    async def run(self, outputs: list[str], order: list[str] | None = None) -> JobResult:
        self.emit("execution_start", {"prompt_id": self.prompt_id, "timestamp": timestamp_ms()})
        self.cache.begin_prompt()
        paused = collector_paused()
        paused.__enter__()
        try:
            if order is None:
                order = self.prompt.ordered_ancestors(outputs)
                self.structural = []  # positions in an order of its own: nothing to keep
            self._sign_prompt(order)
            stand_ins = self.prompt.stand_ins
            roots = list(dict.fromkeys(stand_ins.get(o, o) for o in outputs)) if stand_ins else outputs
            self.need([self._slot(root) for root in roots])
            if self.cached_now:
                self.emit("execution_cached", {"nodes": list(self.cached_now), "prompt_id": self.prompt_id,
                                               "timestamp": timestamp_ms()})
                self.cached_now = []
            await self._loop()
        except NodeExecutionError as failure:
            self.result.status = "error"
            self.result.error = failure.payload
            self.emit("execution_error", failure.payload)
        except run_context.ExecutionInterrupted as stop:
            self._interrupted(getattr(stop, "node", None))
        except Exception as exc:  # a scheduler fault ends this job, never the process
            self.result.status = "error"
            self.result.error = {
                "prompt_id": self.prompt_id, "node_id": None, "node_type": None,
                "executed": list(self.result.executed), "exception_message": str(exc),
                "exception_type": type(exc).__name__,
                "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)[-8:],
                "current_inputs": {}, "current_outputs": {}, "timestamp": timestamp_ms()}
            self.emit("execution_error", self.result.error)
        finally:
            paused.__exit__(None, None, None)
            for task in list(self.running):
                task.cancel()
            # What the prompt holds is what the cache keeps (classic), whether or not it ran now:
            # an unchanged re-run stops at its cached outputs, yet their sources stay cached.
            self.used_signatures.update(slot.signature for slot in self.slots.values() if slot.signature is not None)
            self.cache.end_prompt(self.used_signatures)
        if self.result.status == "success":
            self.emit("execution_success", {"prompt_id": self.prompt_id, "timestamp": timestamp_ms()})
        if self.bus.active:
            self.bus.emit("executing", {"node": None, "display_node": None, "prompt_id": self.prompt_id})
        return self.result

    def _interrupted(self, node: PromptNode | None) -> None:
        self.result.status = "interrupted"
        payload = {"prompt_id": self.prompt_id, "node_id": node.id if node else None,
                   "node_type": node.class_type if node else None, "executed": list(self.result.executed),
                   "timestamp": timestamp_ms()}
        self.result.error = payload
        self.emit("execution_interrupted", payload)

    async def _loop(self) -> None:
        while self.ready or self.running:
            if self.control.interrupted:
                stop = run_context.ExecutionInterrupted("interrupted")
                stop.node = None
                raise stop
            if self.ready:
                slot = self.ready.pop()
                if slot.template is not None:
                    self._resolve_expansion(slot)
                    continue
                await self._start(slot)
                continue
            done, _ = await asyncio.wait(list(self.running), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del self.running[task]
                task.result()  # re-raises NodeExecutionError / interruption
        if self.pending:
            stuck = sorted(node_id for node_id, slot in self.slots.items() if slot.deps is not None)[:10]
            raise NodeExecutionError({
                "prompt_id": self.prompt_id, "node_id": stuck[0], "node_type": self.prompt.nodes[stuck[0]].class_type,
                "executed": list(self.result.executed), "exception_message":
                    f"nodes {stuck} could never run: their inputs were not produced", "exception_type": "RuntimeError",
                "traceback": [], "current_inputs": {}, "current_outputs": {}, "timestamp": timestamp_ms()})

    def _gather_inputs(self, node: PromptNode, spec) -> tuple[dict[str, list[Any]], list[str]]:
        """Per-input item lists for a call, and the lazy inputs not evaluated yet."""
        flat = spec.instance_inputs(node.inputs)
        gathered: dict[str, list[Any]] = {}
        unevaluated: list[str] = []
        for name, inp in flat.items():
            if inp.kind == "hidden":
                gathered[name] = [self._hidden(node, inp.type)]
                continue
            if name not in node.inputs:
                continue
            value = node.inputs[name]
            if type(value) is Link:
                source = self.slots.get(value.node)
                produced = source.values if source is not None else None
                if produced is None:
                    unevaluated.append(name)
                    gathered[name] = [None]
                elif spec.input_is_list:
                    gathered[name] = list(produced[value.output])
                else:
                    gathered[name] = produced[value.output]
            else:
                gathered[name] = [value]
        return gathered, unevaluated

    def _hidden(self, node: PromptNode, kind: str) -> Any:
        if kind == "UNIQUE_ID":
            return node.id
        if kind == "PROMPT":
            return self.prompt.raw
        if kind == "EXTRA_PNGINFO":
            return self.extra_data.get("extra_pnginfo")
        if kind == "DYNPROMPT":
            return self.prompt
        return self.extra_data.get(kind.lower())

    def _context(self, node: PromptNode) -> run_context.RunContext:
        return run_context.RunContext(
            prompt_id=self.prompt_id, node_id=node.id, display_node_id=node.display_id, paths=self.ex.paths,
            emit=self.emit, is_interrupted=self._is_interrupted, runtime=self.ex.runtime,
            parent_node_id=node.parent, real_node_id=node.real_id or node.id)

    async def _start(self, slot: _Slot) -> None:
        node, spec = slot.node, slot.spec
        gathered, unevaluated = self._gather_inputs(node, spec)
        if spec.check_lazy_status is not None and unevaluated:
            wanted = await self._call_guarded(node, spec, self._lazy_status, spec, gathered, unevaluated)
            missing = [name for name in wanted if name in unevaluated]
            if missing:
                if slot.requested is None:
                    slot.requested = set()
                slot.requested.update(missing)
                sources = dict.fromkeys(node.inputs[name].node for name in missing)
                stack: list[_Slot] = []
                self._wait_for(slot, [self._slot(source) for source in sources], stack)
                self.need(stack)
                return
        if spec.is_async:
            task = asyncio.ensure_future(self._execute_async(slot, gathered))
            self.running[task] = slot
        else:
            self._execute_sync(slot, gathered)

    def _lazy_status(self, spec, gathered: dict[str, list[Any]], unevaluated: list[str]) -> list[str]:
        args = {k: (v if spec.input_is_list else (v[0] if v else None)) for k, v in gathered.items()}
        for name in unevaluated:
            args[name] = None
        wanted = spec.check_lazy_status(**spec.group_arguments(args))
        if wanted is None:
            return []
        if isinstance(wanted, str):
            wanted = [wanted]
        return [str(w) for w in wanted]

    async def _call_guarded(self, node: PromptNode, spec, fn, *args):
        token = run_context.activate(self._context(node))
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                result = await result
            return result
        except run_context.ExecutionInterrupted as stop:
            stop.node = node
            raise
        except Exception as exc:
            raise NodeExecutionError(self._error_payload(node, exc, args[1] if len(args) > 1 else {})) from exc
        finally:
            run_context.deactivate(token)

    def _error_payload(self, node: PromptNode, exc: BaseException, gathered: Any) -> dict:
        inputs = {}
        if isinstance(gathered, dict):
            inputs = {k: _summarise(v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v)
                      for k, v in gathered.items()}
        return {
            "prompt_id": self.prompt_id, "node_id": node.display_id, "node_type": node.class_type,
            "executed": list(self.result.executed), "exception_message": f"{exc}",
            "exception_type": type(exc).__name__,
            "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)[-8:],
            "current_inputs": inputs, "current_outputs": {}, "timestamp": timestamp_ms(),
            "real_node_id": node.id,
        }

    def _begin(self, node: PromptNode, spec, gathered: dict[str, list[Any]]) -> ExecutionBlocker | None:
        """Checks and events before a node's calls; returns the blocker that skips it, if any."""
        if self.control.interrupted:
            stop = run_context.ExecutionInterrupted("interrupted")
            stop.node = node
            raise stop
        if self.bus.active:
            self.emit("executing", {"node": node.display_id, "display_node": node.display_id,
                                    "prompt_id": self.prompt_id})
            self.emit("progress_state", {"prompt_id": self.prompt_id, "nodes": {node.display_id: {
                "value": 0, "max": 1, "state": "running", "node_id": node.display_id, "prompt_id": self.prompt_id,
                "display_node_id": node.display_id, "parent_node_id": node.parent, "real_node_id": node.real_id or node.id}}})
        blocked = self._blocker_in(gathered)
        if blocked is not None and spec.output_node and blocked.message:
            raise NodeExecutionError(self._error_payload(node, RuntimeError(blocked.message), gathered))
        return blocked

    def _execute_sync(self, slot: _Slot, gathered: dict[str, list[Any]]) -> None:
        run = _NodeRun(self, slot, gathered)
        node, spec = slot.node, slot.spec
        if run.skipped:
            return
        for args in run.calls:
            with run.guard:
                result = spec.execute(**spec.group_arguments(args))
                if inspect.isawaitable(result):
                    raise TypeError(f"node '{spec.node_id}' returned an awaitable from a non-async execute")
            self._collect(node, spec, result, run.collected, gathered)
        run.end()

    async def _execute_async(self, slot: _Slot, gathered: dict[str, list[Any]]) -> None:
        run = _NodeRun(self, slot, gathered)
        node, spec = slot.node, slot.spec
        if run.skipped:
            return
        for args in run.calls:
            with run.guard:
                result = spec.execute(**spec.group_arguments(args))
                if inspect.isawaitable(result):
                    result = await result
            self._collect(node, spec, result, run.collected, gathered)
        run.end()

    @staticmethod
    def _call_args(spec, gathered: dict[str, list[Any]]) -> list[dict[str, Any]]:
        """One argument dict per call: list inputs are mapped, shorter lists repeat their last item."""
        if spec.input_is_list:
            return [gathered]
        lengths = [len(v) for v in gathered.values()]
        if all(n == 1 for n in lengths):
            return [{k: v[0] for k, v in gathered.items()}]
        count = 0 if any(n == 0 for n in lengths) else max(lengths, default=1)
        return [{k: v[i] if i < len(v) else v[-1] for k, v in gathered.items()} for i in range(count)]

    def _collect(self, node: PromptNode, spec, result: Any, collected: "_Collected", gathered) -> None:
        """Add one call's result to the node's per-output lists."""
        if type(result) is tuple and len(result) == len(spec.outputs):
            result = NodeOutput(result)
        else:
            try:
                result = normalize_result(spec, result)
            except TypeError as exc:
                raise NodeExecutionError(self._error_payload(node, exc, gathered)) from exc
        if result.ui:
            _merge_ui(collected.ui, result.ui)
        if result.expand:
            collected.expansions.append(result.expand)
        values = result.values
        for index, out_spec in enumerate(spec.outputs):
            value = values[index] if index < len(values) else None
            if out_spec.is_list and not (result.expand and is_link_value(value)):
                collected.outputs[index].extend(value if isinstance(value, (list, tuple)) else [value])
            else:
                collected.outputs[index].append(value)

    def _end(self, slot: _Slot, outputs: list[list[Any]], ui: dict | None, expand: list,
             calls: int, wall0: float, cpu0: float) -> None:
        """Profile the node, record its UI, then complete it (or wait for its expansion)."""
        node = slot.node
        wall = time.perf_counter() - wall0
        # The process's peak RSS only grows; its growth since the previous node ended is this node's.
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu = time.thread_time() - cpu0
        growth = max(0, peak_rss - self.peak_rss) * 1024
        self.peak_rss = peak_rss
        if node.parent is None:
            self.result.profile_rows.add(node.id, node.class_type, node.display_id, False, wall * 1000, cpu * 1000,
                                         growth, calls, 1)
        else:  # ephemeral nodes (loop iterations) add up under the editor node they stand for
            self.result.profile_rows.add_up(f"{node.display_id}:{node.class_type}", node.class_type, node.display_id,
                                            wall * 1000, cpu * 1000, growth, calls, 1)
        executed = self.result.executed
        executed.append(node.id)
        if len(executed) % 1024 == 0 and gc.get_count()[0] > YOUNG_OBJECTS_BEFORE_COLLECT:
            gc.collect(0)
        if ui:
            self._record_ui(node, ui)
        if expand:
            self._expand(slot, outputs, expand)
            return
        self._complete(slot, outputs, ui)

    def _complete(self, slot: _Slot, outputs: list[list[Any]], ui: dict | None) -> None:
        # Held (and cached) as tuples: a one-item tuple is half the memory of a one-item list, and
        # a large prompt holds one per node output. Input-is-list nodes still receive lists.
        outputs = tuple(map(tuple, outputs))
        slot.values = outputs
        if slot.node.salt is None:  # a salted node (an iteration that opted out of caching) is never reused
            self.cache.put(slot.signature, CachedResult(outputs, ui))
        self._consumed(slot)
        self._finish(slot)

    def _record_ui(self, node: PromptNode, ui: dict) -> None:
        key = node.display_id
        merged = self.result.outputs.setdefault(key, {})
        _merge_ui(merged, ui)
        self.result.meta[key] = {"node_id": key, "display_node": key, "parent_node": node.parent,
                                 "real_node_id": node.real_id or node.id}
        self.emit("executed", {"node": key, "display_node": key, "output": ui, "prompt_id": self.prompt_id})

    @staticmethod
    def _blocker_in(gathered: dict[str, list[Any]]) -> ExecutionBlocker | None:
        for items in gathered.values():
            for item in items:
                if type(item) is ExecutionBlocker:
                    return item
        return None

    # ------------------------------------------------------------------ expansion
    def _expand(self, slot: _Slot, outputs: list[list[Any]], graphs: list[dict]) -> None:
        node = slot.node
        if len(graphs) > 1:
            raise NodeExecutionError(self._error_payload(
                node, RuntimeError("a node that expands cannot also be mapped over a list input"), {}))
        graph = graphs[0]
        # Child ids are prefixed with the parent's id; a child key starting with "/" is an absolute id
        # (the expanding node guarantees it unique), so repeated expansions such as loop iterations
        # do not grow their ids with every level.
        renamed = {str(child): (str(child)[1:] if str(child).startswith("/") else f"{node.id}.{child}")
                   for child in graph}
        for new_id in renamed.values():
            if new_id in self.prompt.nodes:
                raise NodeExecutionError(self._error_payload(
                    node, RuntimeError(f"expansion node id {new_id!r} is already in the graph"), {}))
        new_ids = []
        for child, body in graph.items():
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
                raise NodeExecutionError(self._error_payload(
                    node, RuntimeError(f"expansion uses unknown node type {new.class_type!r}"), {}))
            self.prompt.add(new)
            new_ids.append(new.id)
        self.compute_signatures(new_ids)  # the expansion's own nodes, sorted; outer sources are known
        # The parent's outputs: links into its expansion, resolved when those nodes finish.
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
        # Output nodes of the expansion run: those no other child consumes become targets; a consumed
        # one runs when its consumer does (so a loop step, not the whole loop, holds an iteration's).
        consumed = {link.node for child in new_ids for link in self.prompt.nodes[child].links()}
        for child in new_ids:
            child_spec = self.registry.get(self.prompt.nodes[child].class_type)
            if child_spec.output_node and child not in consumed:
                targets.add(child)
        parent = self.slots.get(node.parent) if node.parent is not None else None
        if node.salt is not None and parent is not None and parent.template is not None \
                and slot.waiters == [parent]:
            self._hand_over(slot, parent, template, targets, new_ids)
            return
        slot.template = template
        stack: list[_Slot] = []
        self._wait_for(slot, [self._slot(target) for target in targets], stack)
        self.need(stack)

    def _hand_over(self, slot: _Slot, parent: _Slot, template: list[list[Any]], targets: set[str],
                   new_ids: list[str]) -> None:
        """Tail expansion: the parent waits for `node`'s result only, so it adopts `node`'s expansion
        (result links, targets, children) and `node`, which has nothing left to do, is dropped."""
        node = slot.node
        parent_id = node.parent
        for items in parent.template:
            if any(type(item) is Link and item.node == node.id for item in items):
                items[:] = [part for item in items for part in (
                    template[item.output] if type(item) is Link and item.node == node.id else (item,))]
        for child in new_ids:
            self.prompt.nodes[child].parent = parent_id
        slot.waiters = None
        slot.uses = 0
        if parent.deps is not None and slot in parent.deps:
            parent.deps.remove(slot)
        if parent.blocked:  # the parent waited on `node`, which has not finished
            parent.blocked -= 1
        stack: list[_Slot] = []
        self._wait_for(parent, [self._slot(target) for target in targets], stack)
        self.need(stack)
        # Only now release what `node` read, so values its expansion also reads stay alive.
        self._consumed(slot)
        slot.requested = None
        del self.prompt.nodes[node.id]
        del self.slots[node.id]

    def _resolve_expansion(self, slot: _Slot) -> None:
        template, slot.template = slot.template, None
        outputs = []
        for items in template:
            resolved: list[Any] = []
            for item in items:
                if type(item) is Link:
                    resolved.extend(self.slots[item.node].values[item.output])
                else:
                    resolved.append(item)
            outputs.append(resolved)
        self._complete(slot, outputs, None)


def _dotted_lazy(spec, node: PromptNode, name: str) -> bool:
    flat = spec.instance_inputs(node.inputs)
    inp = flat.get(name)
    return bool(inp is not None and inp.lazy)


def print_profile_table(result: JobResult, prompt: Prompt, stream=sys.stdout) -> None:
    """A per-node time table for the terminal."""
    rows = sorted(result.profile.items(), key=lambda kv: -kv[1]["wall_ms"])
    print(f"{'node':>10}  {'class':<28} {'wall ms':>10} {'cpu ms':>10} {'rss +MB':>8}", file=stream)
    for node_id, row in rows[:40]:
        print(f"{row['display_node']:>10}  {row['class_type'][:28]:<28} {row['wall_ms']:>10.1f} {row['cpu_ms']:>10.1f} "
              f"{row['peak_rss_growth_bytes'] / 2**20:>8.1f}", file=stream)
    if len(rows) > 40:
        print(f"... {len(rows) - 40} more nodes", file=stream)
    if result.cached:
        print(f"{len(result.cached)} node(s) served from the cache", file=stream)
