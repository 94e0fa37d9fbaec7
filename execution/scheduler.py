"""The scheduler: runs a validated prompt, pulling from its output nodes.

One job's state, all of it (each part is its own object; `_Job` wires them together):

    prompt       the job's copy of the graph; expansions add nodes to it and drop them again
    readiness    (execution.readiness) node id -> `Slot`, the node's state in this job, made for
                 every node the outputs need, sources first, when its signature is computed; the
                 ready stack; the count of needed, unfinished nodes; the signatures to keep cached
    structural   signatures that depend on the prompt alone, by position in the validated order,
                 kept with the validated prompt for its next run
    running      async node calls in flight (task -> slot)
    caller       (execution.node_call) gathers a node's inputs and calls it
    expansion    (execution.expansion) adds a node's returned graph and resolves its result
    profiler     (execution.profile) per-node time, CPU and peak-RSS rows, and the executed list
    result       the JobResult: status, UI outputs, executed and cached ids, profile, messages

A node's state, on its slot (edges hold slots, so following one is attribute access):

    phase        IDLE -> PENDING -> READY -> RUNNING -> FINISHED -> RELEASED (below)
    signature    structural cache key (computed once, sources first)
    stable       whether that signature is the prompt's alone (kept in `structural`)
    values       per-output tuples of items (list semantics) while FINISHED, else None
    uses         how many unfinished consumers still need its values; at zero they are released
    deps         while needed and unfinished: the slots whose values it reads (non-lazy inputs,
                 requested lazy inputs, and for an expanded node the nodes its result links to)
    blocked      how many of its deps have not finished
    waiters      slots among whose deps it is, while it has not finished
    requested    lazy inputs requested so far
    template     an expanded node's result: links into its expansion, resolved once those finish

Phases and their transitions:

    IDLE       signed, nothing needs it. `need` moves it to FINISHED when the cache has its
               signature, else to PENDING (deps to wait for) or READY (none)
    PENDING    waits for `blocked` deps; the last of them finishing makes it READY
    READY      on the ready stack, taken last in first out (depth first, so values are consumed
               and freed early)
    RUNNING    taken: its lazy-input check, its calls (an async node runs as a task) or its
               template's resolution. Lazy inputs it asks for, or an expansion it returns, send it
               back to PENDING/READY with the new deps; otherwise it completes
    FINISHED   values held (and cached unless salted); its waiters are woken
    RELEASED   no uses left: values dropped. An expansion node nothing waits on is forgotten (its
               slot and prompt node removed), so a long chain of expansions holds one link at a time

The rules:

- Only what the outputs need and the cache lacks runs. An output with a stand-in (the graph
  rewrite's `stand_ins`, execution.rewrite) is reached through its stand-in.
- Link inputs a node does not declare are passed as keyword arguments too (variadic pack nodes rely on
  it); constants it does not declare are not. A `rawLink` input gets the link itself, `[source, output]`,
  and its source still runs first.
- Lazy inputs are requested through `check_lazy_status`; the node is staged again until satisfied.
- A node not marked input-is-list is called once per element of its list inputs (shorter lists
  repeat their last element); outputs marked is-list concatenate.
- `ExecutionBlocker` values skip the calls that receive them: a mapped call whose own item is blocked,
  the single call of an input-is-list node with a blocked item anywhere; each skipped call puts a
  blocker in every output. An output node reached by a blocker with a message fails.
- Expansion ids, results and tail expansion: see execution.expansion.
- Interruption and cancellation are checked between nodes and inside progress callbacks.
- Every early end is a `RunFailure` (execution.failure), which renders the job's
  execution_error or execution_interrupted payload.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import Any

from execution import context as run_context
from execution.cache import CachedResult, NoCache, OutputCache
from execution.events import EventBus, timestamp_ms
from execution.expansion import Expansion
from execution.failure import ERROR, INTERRUPTED, RunFailure
from execution.graph import Prompt, PromptNode, collector_paused
from execution.node_progress import NodeProgress
from execution.node_call import NodeCaller, merge_ui
from execution.paths import Paths
from execution.profile import ProfileRows, Profiler
from execution.readiness import Readiness, Slot
from execution.spec import Registry
from execution.validation import ValidatedPrompt

_signature = attrgetter("signature")
# Events kept in JobResult.messages besides going to the bus (the history's status messages).
_RECORDED = frozenset(("execution_start", "execution_cached", "execution_success", ERROR, INTERRUPTED))


class JobControl:
    """Cooperative interruption of one job; set from any thread."""

    def __init__(self) -> None:
        self.interrupted = False  # read between nodes and in progress callbacks; set from any thread

    def interrupt(self) -> None:
        self.interrupted = True


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
        """Per node: class_type, display_node, cached, wall_ms, cpu_ms, peak_rss_growth_bytes, calls, runs (and
        notes, when the node added any)."""
        return self.profile_rows.as_dicts()

    def __repr__(self) -> str:  # asyncio reprs task results; a large job's profile must not be printed
        return (f"JobResult({self.prompt_id!r}, {self.status!r}, executed={len(self.executed)}, "
                f"cached={len(self.cached)})")


class Executor:
    """Runs prompts against a registry with one output cache shared across jobs."""

    def __init__(self, registry: Registry, *, cache: OutputCache | None = None, events: EventBus | None = None,
                 paths: Paths | None = None, runtime: run_context.Services | None = None) -> None:
        self.registry = registry
        self.cache = cache if cache is not None else NoCache()
        self.events = events or EventBus()
        self.paths = paths or Paths(".")
        self.runtime = runtime if runtime is not None else run_context.Services()  # shared by its node calls
        self._lock = threading.Lock()  # one prompt at a time: nodes share models and memory

    def run(self, validated: ValidatedPrompt, *, prompt_id: str, extra_data: dict | None = None,
            control: JobControl | None = None) -> JobResult:
        """Run a validated prompt to completion (blocking)."""
        with self._lock:
            return asyncio.run(self.run_async(validated, prompt_id=prompt_id, extra_data=extra_data,
                                              control=control))

    async def run_async(self, validated: ValidatedPrompt, *, prompt_id: str, extra_data: dict | None = None,
                        control: JobControl | None = None) -> JobResult:
        """Run a validated prompt within the running event loop."""
        # The job adds and drops expansion nodes in its own copy: the validated prompt can run again.
        job = _Job(self, validated.prompt.fork(), prompt_id, extra_data or {}, control or JobControl(),
                   validated.signatures if validated.order is not None else None)
        return await job.run(validated.outputs, validated.order)


class _Job:
    """One job: the parts of the module docstring, and the loop that drives them."""

    def __init__(self, executor: Executor, prompt: Prompt, prompt_id: str, extra_data: dict,
                 control: JobControl, structural: list[str | None] | None) -> None:
        self.bus = executor.events
        self.cache = executor.cache
        self.prompt = prompt
        self.prompt_id = prompt_id
        self.control = control
        self.result = JobResult(prompt_id, "success")
        self.roots: set[str] = set()  # the outputs the run was asked for (stand-ins resolved)
        self.progress = NodeProgress(prompt_id, self.emit, lambda node_id: self.prompt.nodes.get(node_id),
                                     listening=lambda: self.bus.active)
        self.readiness = Readiness(prompt, executor.registry, executor.cache,
                                   structural if structural is not None else [], self._served)
        self.caller = NodeCaller(prompt, prompt_id, extra_data, executor.paths, executor.runtime, self.emit,
                                 self._is_interrupted)
        self.expansion = Expansion(self.readiness)
        self.profiler = Profiler(self.result.profile_rows, self.result.executed)
        self.running: dict[asyncio.Task, Slot] = {}

    def _is_interrupted(self) -> bool:
        return self.control.interrupted

    def emit(self, event: str, data: dict) -> None:
        """Send an event to the bus (and keep the status ones in the result's messages). A node's
        `progress` is preceded by the `progress_state` it changes and by the step's text and preview
        (carried inside it), in ComfyUI's order: progress_state, preview, progress."""
        shown = data.pop(run_context.SHOWN_KEY, ()) if event == "progress" else ()
        if event in _RECORDED:
            self.result.messages.append((event, data))
        if self.bus.active:
            if event == "progress":
                self.progress.updated(data["node"], data["value"], data["max"])
                for shown_event, shown_data in shown:  # the step's text and preview, between the two
                    self.bus.emit(shown_event, shown_data)
            self.bus.emit(event, data)

    def __str__(self) -> str:
        return f"job {self.prompt_id}: {self.readiness}, {len(self.running)} running, {self.result!r}"

    # ------------------------------------------------------------------ the run
    async def run(self, outputs: list[str], order: list[str] | None = None) -> JobResult:
        """Run until the outputs finished or the job failed; returns the job's result."""
        self.emit("execution_start", {"prompt_id": self.prompt_id, "timestamp": timestamp_ms()})
        self.cache.begin_prompt()
        readiness = self.readiness
        paused = collector_paused()
        paused.__enter__()
        try:
            if order is None:
                order = self.prompt.ordered_ancestors(outputs)
                readiness.structural = []  # positions in an order of its own: nothing to keep
            readiness.sign_prompt(order)
            self.emit("execution_cached", {"nodes": self._cached_nodes(), "prompt_id": self.prompt_id,
                                           "timestamp": timestamp_ms()})
            stand_ins = self.prompt.stand_ins
            roots = list(dict.fromkeys(stand_ins.get(o, o) for o in outputs)) if stand_ins else outputs
            self.roots = set(roots)
            readiness.need([readiness.slot(root) for root in roots])
            await self._drive()
        except RunFailure as failure:
            self._failed(failure)
        except run_context.ExecutionInterrupted:
            self._failed(RunFailure.interrupted(None))
        except Exception as exc:  # a scheduler fault ends this job, never the process
            self._failed(RunFailure.fault(exc))
        finally:
            paused.__exit__(None, None, None)
            for task in list(self.running):
                task.cancel()
            # What the prompt holds is what the cache keeps (classic), whether or not it ran now:
            # an unchanged re-run stops at its cached outputs, yet their sources stay cached.
            used = readiness.used_signatures
            used.update(slot.signature for slot in readiness.slots.values() if slot.signature is not None)
            self.cache.end_prompt(used)
        if self.result.status == "success":
            self.emit("execution_success", {"prompt_id": self.prompt_id, "timestamp": timestamp_ms()})
        if self.bus.active:
            self.bus.emit("executing", {"node": None, "display_node": None, "prompt_id": self.prompt_id})
        return self.result

    def _cached_nodes(self) -> list[str]:
        """Every node of the prompt whose output the cache holds, reached by this run or not (a cached
        node behind another cached node included), in prompt order as ComfyUI lists them.

        Only the prompt's own nodes have slots yet. The test runs in C over the slots (a re-run of a
        large unchanged prompt pays no Python step per node); prompt order costs a sort only when
        some nodes are cached and others not."""
        slots, nodes = self.readiness.slots, self.prompt.nodes
        found = list(compress(slots.keys(), map(self.cache.held().__contains__, map(_signature, slots.values()))))
        if not found:
            return found
        if len(found) == len(nodes):
            return list(nodes)
        position = {node_id: index for index, node_id in enumerate(nodes)}
        return sorted(found, key=position.__getitem__)

    def _failed(self, failure: RunFailure) -> None:
        result = self.result
        result.status = "interrupted" if failure.event == INTERRUPTED else "error"
        result.error = failure.payload(self.prompt_id, result.executed)
        self.emit(failure.event, result.error)

    async def _drive(self) -> None:
        readiness = self.readiness
        ready, running, control = readiness.ready, self.running, self.control
        while ready or running:
            if control.interrupted:
                raise RunFailure.interrupted(None)
            if ready:
                slot = readiness.take()
                if slot.template is not None:
                    self.expansion.resolve(slot)
                    if self.bus.active:
                        self.progress.finished(slot.node)
                else:
                    await self._start(slot)
                continue
            done, _ = await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del running[task]
                task.result()  # re-raises the task's RunFailure
        if readiness.pending:
            stuck = readiness.stuck()
            raise RunFailure.stuck(self.prompt.nodes[stuck[0]], stuck)

    async def _start(self, slot: Slot) -> None:
        """Stage a RUNNING slot: ask for lazy inputs it still lacks, else call it."""
        spec = slot.spec
        gathered, unevaluated = self.caller.gather(slot, self.readiness.slots)
        if spec.check_lazy_status is not None and unevaluated:
            missing = await self.caller.lazy_wanted(slot, gathered, unevaluated)
            if missing:
                if slot.requested is None:
                    slot.requested = set()
                slot.requested.update(missing)
                readiness = self.readiness
                sources = dict.fromkeys(slot.node.inputs[name].node for name in missing)
                stack: list[Slot] = []
                readiness.wait_for(slot, [readiness.slot(source) for source in sources], stack)
                readiness.need(stack)
                return
        if spec.is_async:
            self.running[asyncio.ensure_future(self._run_node(slot, gathered))] = slot
        else:
            await self._run_node(slot, gathered)  # a sync node's call never suspends

    async def _run_node(self, slot: Slot, gathered: dict[str, list[Any]]) -> None:
        """One node's run: announced, called (or skipped by a blocker), profiled, then completed
        or expanded."""
        node, spec = slot.node, slot.spec
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        if self.control.interrupted:
            raise RunFailure.interrupted(node)
        if self.bus.active:
            self._announce(node)
        called = await self.caller.call(slot, gathered)  # blocked calls are skipped there, one by one
        self.profiler.ran(node, called.calls, wall0, cpu0, called.counts, called.notes)
        if called.ui:
            self._record_ui(node, called.ui)
        if called.expansions:
            self.expansion.expand(slot, called.outputs, called.expansions)
        else:
            self.readiness.complete(slot, called.outputs, called.ui, called.notes)
            if self.bus.active:
                self.progress.finished(node)

    # ------------------------------------------------------------------ what the editor sees
    def _announce(self, node: PromptNode) -> None:
        """A node starts: its progress_state (running), then `executing`, in ComfyUI's order."""
        self.progress.started(node)
        display = node.display_id
        self.emit("executing", {"node": display, "display_node": display, "prompt_id": self.prompt_id})

    def _served(self, slot: Slot, hit: CachedResult) -> None:
        node = slot.node
        self.result.cached.append(node.id)
        self.profiler.served(node, hit.notes)
        if hit.ui:
            self._record_ui(node, hit.ui)
        if node.id in self.roots and self.bus.active:
            # An output served from the cache finishes like one that ran (as ComfyUI's does); the
            # cached nodes behind it are only listed by execution_cached.
            self.progress.finished(node)

    def _record_ui(self, node: PromptNode, ui: dict) -> None:
        key = node.display_id
        merge_ui(self.result.outputs.setdefault(key, {}), ui)
        self.result.meta[key] = {"node_id": key, "display_node": key, "parent_node": node.parent,
                                 "real_node_id": node.real_id or node.id}
        self.emit("executed", {"node": key, "display_node": key, "output": ui, "prompt_id": self.prompt_id})


def print_profile_table(result: JobResult, prompt: Prompt, stream=sys.stdout) -> None:
    """A per-node time table for the terminal."""
    rows = sorted(result.profile.items(), key=lambda kv: -kv[1]["wall_ms"])
    print(f"{'node':>10}  {'class':<28} {'wall ms':>10} {'cpu ms':>10} {'rss +MB':>8}", file=stream)
    for node_id, row in rows[:40]:
        counts = "".join(f"  {name} {value:g}" for name, value in row.get("counts", {}).items())
        print(f"{row['display_node']:>10}  {row['class_type'][:28]:<28} {row['wall_ms']:>10.1f} {row['cpu_ms']:>10.1f} "
              f"{row['peak_rss_growth_bytes'] / 2**20:>8.1f}{counts}", file=stream)
    if len(rows) > 40:
        print(f"... {len(rows) - 40} more nodes", file=stream)
    if result.cached:
        print(f"{len(result.cached)} node(s) served from the cache", file=stream)
