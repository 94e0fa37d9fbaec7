"""Start Loop / End Loop: loops drawn as a pair of nodes, run one iteration after another.

A loop is a Start Loop, its End Loop and the body: the nodes downstream of the Start that the End
(or an output node inside the loop) needs. Class names, input names and outputs are ComfyUI's, so
workflows made there load and run here; `break_when`, the iteration limit and the bounded memory
of a running loop are Weft's.

The three phases of a loop
--------------------------
1. Check (`check_loops`, a pure graph check run by validation): each End finds its Start
   (innermost loops first); malformed loops are refused with one structured error per fault.
2. Rewrite (`rewrite_loops`, declared with the check as `LOOPS`, applied by
   execution.rewrite after validation): each well-formed loop's End is replaced by a copy that no
   longer links into the body and instead holds a `LoopTemplate` under the declared input
   `__loop__` (what the Start received, the body nodes, the End's per-iteration inputs). Every
   body node and the Start get the outermost End as stand-in, so an output inside a body (a save
   wired to a termination) runs as part of its loop, never alone.
3. Run: the End expands into `LoopStep` #0, which evaluates what the Start received (count, range
   or list), plans the iterations, and expands iteration 0 together with `LoopStep` #1. An
   iteration is one `LoopIteration` node (the Start's outputs for that pass) plus a copy of each
   body node shown under the original's id. `LoopStep` #k+1 depends on all of iteration k
   (output_value, next_iteration_value, terminations, break_when, body outputs); it records the
   output and then either expands iteration k+1 with `LoopStep` #k+2 or returns the result. By the
   scheduler's tail-expansion rule (execution.expansion) each step's expansion passes to the End,
   so the chain keeps one step alive, and a finished iteration's nodes are dropped: memory stays
   near one iteration's worth plus what the cache holds.

Caching: the End itself always runs. With `cache_iterations`, an iteration's source node is keyed
on its index, on its first/last flags only if the body reads them (so lengthening a loop keeps the
earlier keys), on its list entry's content and on where the carried value comes from; body copies
are cached like any node, so editing the item of iteration 7 re-runs iteration 7 and what follows
from it. Without it, every copy is salted: run each time, never stored.

Known limits: nodes after an End re-run whenever the loop runs (a body node's change marks, such
as a file hash, exist only per copy, so the End cannot be served whole from the cache). An
ExecutionBlocker reaching a value the End reads ends the loop with a blocked result. A body node
behind a lazy input that is never requested lingers in the live graph until the run ends (a small
record per iteration). Loops must exist when the prompt is validated: a node that expands into a
Start/End pair at run time is refused as unpaired.
"""
from __future__ import annotations

import hashlib
import itertools
import uuid
from typing import Any, Callable, Iterable, Mapping

from execution.context import DEFAULT_MAX_LOOP_ITERATIONS, current
from execution.errors import node_error
from execution.graph import Link, Prompt, PromptNode, PromptReader
from execution.rewrite import GraphRewrite, RewriteResult
from nodes.spec import MATCH_TYPE, Input, InputSpec, NodeOutput, NodeSpec, Output

START = "StartLoop"
END = "EndLoop"
LOOP_KEY = "__loop__"  # the input the loop rewrite adds to an End Loop: its LoopTemplate (declared in LOOPS)
END_BODY_INPUTS = ("output_value", "next_iteration_value", "break_when")
TERMINATIONS = "terminations."
CATEGORY = "utilities/looping"


def _is_body_side(name: str) -> bool:
    """End Loop inputs that carry per-iteration values (they move into the loop's template)."""
    return name in END_BODY_INPUTS or name.startswith(TERMINATIONS)


# ---------------------------------------------------------------------- content keys
def content_key(value: Any) -> str:
    """A digest of a value's content, for cache keys: tensors by their bytes, containers recursively.

    Values whose content cannot be read (models, handles) get a unique token: never reused."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, value, 0)
    return digest.hexdigest()


_unique = itertools.count()


def _feed(digest, value: Any, depth: int) -> None:
    kind = type(value)
    if value is None or kind in (bool, int, float, str, bytes):
        digest.update(f"{kind.__name__}:{value!r};".encode("utf-8", "surrogatepass"))
        return
    if depth > 32:
        raise ValueError("a loop value nests more than 32 levels deep")
    if hasattr(value, "detach") and hasattr(value, "shape") and hasattr(value, "dtype"):  # a torch tensor
        import torch

        flat = value.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"tensor:{tuple(value.shape)}:{value.dtype};".encode())
        digest.update(flat.view(torch.uint8).numpy())
        return
    if hasattr(value, "tobytes") and hasattr(value, "shape") and hasattr(value, "dtype"):  # a numpy array
        digest.update(f"array:{tuple(value.shape)}:{value.dtype};".encode())
        digest.update(value.tobytes())
        return
    if isinstance(value, (list, tuple)):
        digest.update(f"{kind.__name__}[{len(value)}];".encode())
        for item in value:
            _feed(digest, item, depth + 1)
        return
    if isinstance(value, dict):
        digest.update(f"dict[{len(value)}];".encode())
        for key in sorted(value, key=repr):
            digest.update(f"{key!r}=".encode("utf-8", "surrogatepass"))
            _feed(digest, value[key], depth + 1)
        return
    # Content we cannot read: never equal to anything else, so a cache never serves a stale copy.
    digest.update(f"opaque:{kind.__qualname__}:{uuid.uuid4().hex}:{next(_unique)};".encode())


class Keyed:
    """A value handed to an expansion as a constant, keyed by its content.

    Its repr is the content digest, so a node signature stays short and content-based however large
    the value (an image, a mixed list of images and strings)."""

    __slots__ = ("value", "_key")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._key: str | None = None

    @property
    def key(self) -> str:
        """The content digest, computed once."""
        if self._key is None:
            self._key = content_key(self.value)
        return self._key

    def __repr__(self) -> str:
        return f"Keyed({self.key})"


def _unwrap(value: Any) -> Any:
    return value.value if type(value) is Keyed else value


# ---------------------------------------------------------------------- loop templates
class BodyNode:
    """One body node as the loop copies it: class, inputs (links and constants), editor id."""

    __slots__ = ("id", "class_type", "inputs", "display_id", "title")

    def __init__(self, id: str, class_type: str, inputs: Mapping[str, Any], display_id: str,
                 title: str | None = None) -> None:
        self.id = id
        self.class_type = class_type
        self.inputs = dict(inputs)
        self.display_id = display_id
        self.title = title


class LoopTemplate:
    """What each iteration of one loop copies, prepared at validation.

    Ids inside are the original prompt's; links that leave the loop point at live nodes (`renamed`
    maps them when an outer loop copies this one). An inner End Loop's body node holds the inner
    loop's template under `__loop__`; the inner Start and body are not copied by the outer loop."""

    __slots__ = ("start_id", "start_display", "start_inputs", "end_display", "end_inputs", "body",
                 "output_ids", "used_outputs", "external", "outside", "key")

    def __init__(self, *, start_id: str, start_display: str, start_inputs: Mapping[str, Any], end_display: str,
                 end_inputs: Mapping[str, Any], body: Iterable[BodyNode], output_ids: Iterable[str]) -> None:
        self.start_id = start_id
        self.start_display = start_display
        self.start_inputs = dict(start_inputs)
        self.end_display = end_display
        self.end_inputs = dict(end_inputs)
        self.body = tuple(body)
        self.output_ids = tuple(output_ids)  # body output nodes: each iteration waits for them
        inside = {b.id for b in self.body} | {start_id}
        used: set[int] = set()
        external: list[Link] = []
        for link in self._links():
            if link.node == start_id:
                used.add(link.output)
            elif link.node not in inside:
                external.append(link)
        self.used_outputs = frozenset(used)  # Start outputs the loop reads
        self.external = tuple(external)  # every link that leaves the loop
        self.outside = tuple({link.node: link for link in reversed(external)}.values())  # one per node read
        self.key = self._digest()

    def _links(self):
        """Every link of the loop; of an inner loop, those that leave it (they may read this loop's nodes)."""
        for value in itertools.chain(self.start_inputs.values(), self.end_inputs.values()):
            if type(value) is Link:
                yield value
        for body in self.body:
            for value in body.inputs.values():
                if type(value) is Link:
                    yield value
                elif type(value) is LoopTemplate:
                    yield from value.external

    def _digest(self) -> str:
        parts = [self.start_id, repr(sorted(self.start_inputs.items())), repr(sorted(self.end_inputs.items()))]
        for body in self.body:
            parts.append(f"{body.id}|{body.class_type}|{body.display_id}|{sorted(body.inputs.items())!r}")
        return hashlib.blake2b("\x1f".join(parts).encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()

    def __repr__(self) -> str:  # node signatures repr constants: keep it short and structural
        return f"LoopTemplate({self.key})"

    def renamed(self, relink: Callable[[Link], Link]) -> "LoopTemplate":
        """This template with every link passed through `relink` (an outer loop's copy of it)."""
        def move(value: Any) -> Any:
            if type(value) is Link:
                return relink(value)
            if type(value) is LoopTemplate:
                return value.renamed(relink)
            return value

        return LoopTemplate(
            start_id=self.start_id, start_display=self.start_display,
            start_inputs={k: move(v) for k, v in self.start_inputs.items()}, end_display=self.end_display,
            end_inputs={k: move(v) for k, v in self.end_inputs.items()},
            body=[BodyNode(b.id, b.class_type, {k: move(v) for k, v in b.inputs.items()}, b.display_id, b.title)
                  for b in self.body],
            output_ids=self.output_ids)


# ---------------------------------------------------------------------- one run of a loop
def _constant(value: Any) -> Any:
    """A constant for an expansion graph: wrapped where it would read as a link or a wrapper."""
    if isinstance(value, list) or (isinstance(value, dict) and len(value) == 1 and "__value__" in value):
        return {"__value__": value}
    return value


class LoopRun:
    """The state of one loop while it runs: its plan, the outputs so far and the carried value's source.

    Passed to each `LoopStep` as a constant; its repr is constant-size so signatures stay cheap."""

    __slots__ = ("template", "end_id", "accumulate", "token", "salt", "values", "items", "count", "done",
                 "outputs", "previous_next", "max_iterations")

    def __init__(self, template: LoopTemplate, end_id: str, accumulate: bool) -> None:
        self.template = template
        self.end_id = end_id
        self.accumulate = accumulate
        self.token = uuid.uuid4().hex[:12]
        self.salt: str | None = None
        self.values: range | None = None  # iteration_index of each planned iteration
        self.items: list | None = None  # List mode: one item per iteration
        self.count = 0
        self.done = 0
        self.outputs: list = []
        self.previous_next: Link | None = None  # live link to the last iteration's next_iteration_value
        self.max_iterations = DEFAULT_MAX_LOOP_ITERATIONS

    def __repr__(self) -> str:
        return f"LoopRun({self.end_id}, {self.token})"

    # -------------------------------------------------------------- planning
    def plan(self, *, mode: str, num_iterations: Any, start_iteration_index: Any, max_iteration: Any,
             step: Any, items: list | None, cache_iterations: bool) -> None:
        """Fix the iterations from the Start Loop's evaluated inputs; refuse more than the cap."""
        where = f"Start Loop {self.template.start_display}"
        if mode == "simple":
            count = _int(num_iterations, where, "mode.num_iterations")
            if count < 0:
                raise ValueError(f"{where}: mode.num_iterations is {count}; it must be 0 or more")
            self.values = range(count)
        elif mode == "For":
            step_value = _int(step, where, "mode.step")
            if step_value < 1:
                raise ValueError(f"{where}: mode.step is {step_value}; it must be at least 1")
            self.values = range(_int(start_iteration_index, where, "mode.start_iteration_index"),
                                _int(max_iteration, where, "mode.max_iteration"), step_value)
        elif mode == "List":
            self.items = list(items or [])
            self.values = range(len(self.items))
        else:
            raise ValueError(f"{where}: mode is {mode!r}; expected simple, For or List")
        self.count = len(self.values)
        if self.count > self.max_iterations:
            raise ValueError(f"{where}: the loop would run {self.count} iterations, more than the limit of "
                             f"{self.max_iterations} (--max-loop-iterations)")
        self.salt = None if cache_iterations else f"loop:{self.token}"

    # -------------------------------------------------------------- one iteration
    def expansion(self) -> tuple[dict, str]:
        """The graph of iteration `done` and the step that follows it; returns (graph, step key)."""
        template, k = self.template, self.done
        prefix = f"{self.end_id}.{k}."
        live = {b.id: prefix + b.id for b in template.body}
        iteration_id = f"{self.end_id}.{k}#iteration"
        live[template.start_id] = iteration_id
        in_graph = set(live.values())
        # The carried value: body nodes read it straight from where it comes from (the previous
        # iteration's next_iteration_value, or the initial value), so a node that does not read it
        # does not depend on the previous iteration, and keeps its cache key when that one changes.
        initial = template.start_inputs.get("initial_iteration_value")
        if k > 0 and self.previous_next is not None:
            carried = self.previous_next
        elif type(initial) is Link:
            carried = initial
        else:
            carried = Link(iteration_id, 4)  # a constant initial value (or none), held by the source node

        def relink(link: Link) -> Link:
            if link.node == template.start_id and link.output == 4:
                return carried
            return Link(live[link.node], link.output) if link.node in live else link

        def ref(value: Any) -> Any:
            if type(value) is Link:
                target = relink(value)
                return ["/" + target.node if target.node in in_graph else target.node, target.output]
            return _constant(value)

        graph: dict[str, dict] = {}
        used = template.used_outputs
        sources: dict[str, Any] = {
            "iteration_index": self.values[k],
            # The flags are constant False when the body does not read them, so a longer or shorter
            # loop keeps the other iterations' cache keys.
            "is_first": 1 in used and k == 0,
            "is_last": 2 in used and k == self.count - 1,
        }
        if self.items is not None:
            sources["list_item"] = Keyed(self.items[k])
        if carried.node == iteration_id and initial is not None:
            sources["current_iteration_value"] = Keyed(initial)
        parent = template.start_inputs.get("parent_iteration")
        if parent is not None:
            sources["parent_iteration"] = ref(parent)
        graph["/" + iteration_id] = self._entry("LoopIteration", sources, template.start_display)

        for body in template.body:
            inputs = {name: ref(value) for name, value in body.inputs.items() if name != LOOP_KEY}
            inner = body.inputs.get(LOOP_KEY)
            if type(inner) is LoopTemplate:
                inputs[LOOP_KEY] = inner.renamed(relink)
            graph["/" + live[body.id]] = self._entry(body.class_type, inputs, body.display_id, body.title)

        step_inputs: dict[str, Any] = {"loop": self, "after_iteration": ["/" + iteration_id, 0]}
        for name in ("output_value", "break_when"):
            if name in template.end_inputs:
                step_inputs[name] = ref(template.end_inputs[name])
        if carried.node != iteration_id:  # keep the carried value until this iteration is done
            step_inputs["keep_carried"] = ref(Link(template.start_id, 4))
        next_value = template.end_inputs.get("next_iteration_value")
        if type(next_value) is Link:
            step_inputs["after_next"] = ref(next_value)
            self.previous_next = relink(next_value)
        # Undeclared link inputs are plain dependencies: the step waits for this iteration's side
        # effects (so iterations run in order) and keeps what the loop reads from outside alive.
        for name, value in template.end_inputs.items():
            if name.startswith(TERMINATIONS) and type(value) is Link:
                step_inputs["after_" + name[len(TERMINATIONS):]] = ref(value)
        for index, output_id in enumerate(template.output_ids):
            step_inputs[f"after_output{index}"] = ["/" + live[output_id], 0]
        for index, link in enumerate(template.outside):
            step_inputs[f"keep{index}"] = [link.node, link.output]
        step_key = f"{self.end_id}#step{k + 1}"
        graph["/" + step_key] = self._entry("LoopStep", step_inputs, template.start_display, salt=f"{self.token}:{k + 1}")
        return graph, "/" + step_key

    def _entry(self, class_type: str, inputs: dict, display_id: str, title: str | None = None, *,
               salt: str | None = None) -> dict:
        entry = {"class_type": class_type, "inputs": inputs, "override_display_id": display_id,
                 "real_node_id": display_id}
        if title:
            entry["_meta"] = {"title": title}
        salt = salt or self.salt
        if salt is not None:
            entry["cache_salt"] = salt
        return entry

    # -------------------------------------------------------------- progress
    def report(self, text: str) -> None:
        """Progress on the Start Loop node: iterations done of planned, and a line of text."""
        ctx = current()
        start = self.template.start_display
        ctx.emit("progress", {"value": self.done, "max": self.count, "prompt_id": ctx.prompt_id, "node": start,
                              "display_node": start})
        ctx.emit("progress_text", {"node": start, "text": text, "prompt_id": ctx.prompt_id})
        ctx.check_interrupted()


def _int(value: Any, where: str, name: str) -> int:
    """A count or index from a Start Loop input (linked values are checked only here)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"{where}: {name} must be an integer, got {value!r}")


def _first(values: list | None, default: Any = None) -> Any:
    return values[0] if values else default


# ---------------------------------------------------------------------- node functions
def _start_loop(**_: Any) -> tuple:
    raise ValueError("Start Loop runs only through its End Loop, and this one was not paired at validation "
                     "(is the nodes.loops graph check registered?)")


def _end_loop(accumulate: list, dynprompt: list | None = None, unique_id: list | None = None, **_: Any) -> NodeOutput:
    reader, end_id = _first(dynprompt), _first(unique_id)
    node = reader.prompt.nodes.get(end_id) if isinstance(reader, PromptReader) else None
    template = node.inputs.get(LOOP_KEY) if node is not None else None
    if type(template) is not LoopTemplate:
        raise ValueError(f"End Loop {end_id} was not paired with a Start Loop at validation; "
                         "run the prompt through validate_prompt with the built-in node packs")
    run = LoopRun(template, end_id, bool(_first(accumulate, False)))
    start = template.start_inputs
    inputs: dict[str, Any] = {"loop": run}
    for name, key in (("mode", "mode"), ("num_iterations", "mode.num_iterations"),
                      ("start_iteration_index", "mode.start_iteration_index"), ("max_iteration", "mode.max_iteration"),
                      ("step", "mode.step"), ("list", "mode.list"), ("cache_iterations", "cache_iterations")):
        if key in start:
            value = start[key]
            inputs[name] = [value.node, value.output] if type(value) is Link else _constant(value)
    for index, link in enumerate(template.outside):
        inputs[f"keep{index}"] = [link.node, link.output]
    key = f"/{end_id}#step0"
    graph = {key: {"class_type": "LoopStep", "inputs": inputs, "override_display_id": template.start_display,
                   "real_node_id": template.start_display, "cache_salt": f"{run.token}:0"}}
    return NodeOutput(([key, 0],), expand=graph)


def _end_fingerprint(**_: Any) -> float:
    return float("nan")  # the loop always runs; its iterations are what cache_iterations caches


def _loop_step(loop: list, output_value: list | None = None, break_when: list | None = None,
               mode: list | None = None, num_iterations: list | None = None,
               start_iteration_index: list | None = None, max_iteration: list | None = None,
               step: list | None = None, list: list | None = None,  # noqa: A002 (the Start's input name)
               cache_iterations: list | None = None, **_: Any) -> NodeOutput | tuple:
    run: LoopRun = loop[0]
    if run.values is None:  # step 0: plan from the Start's inputs
        run.max_iterations = current().runtime.max_loop_iterations
        run.plan(mode=_first(mode, "simple"), num_iterations=_first(num_iterations, 4),
                 start_iteration_index=_first(start_iteration_index, 0), max_iteration=_first(max_iteration, 4),
                 step=_first(step, 1), items=list, cache_iterations=bool(_first(cache_iterations, False)))
        stop = False
    else:  # iteration `done` finished
        items = [] if output_value is None else output_value
        if run.accumulate:
            run.outputs.extend(items)
        else:
            run.outputs = [*items]
        run.done += 1
        stop = bool(break_when) and any(bool(_unwrap(v)) for v in break_when)
    if run.done >= run.count or stop:
        how = "stopped by break_when" if stop and run.done < run.count else "done"
        run.report(f"Iteration {run.done}/{run.count} ({how})")
        return (run.outputs,)
    run.report(f"Iteration {run.done + 1}/{run.count}")
    graph, step_key = run.expansion()
    return NodeOutput(([step_key, 0],), expand=graph)


def _loop_iteration(iteration_index: list, is_first: list, is_last: list, list_item: list | None = None,
                    current_iteration_value: list | None = None, parent_iteration: list | None = None) -> tuple:
    carried = [None] if current_iteration_value is None else [_unwrap(v) for v in current_iteration_value]
    return (iteration_index[0], bool(is_first[0]), bool(is_last[0]),
            _unwrap(list_item[0]) if list_item else None, carried)


def _split_text(text: str, delimiter: str, skip_empty: bool) -> tuple:
    parts = text.splitlines() if delimiter in ("", "\\n", "\n") else text.split(delimiter)
    parts = [p.strip() for p in parts]
    return ([p for p in parts if p] if skip_empty else parts,)


# ---------------------------------------------------------------------- validation (graph check)
def _walk(seeds: Iterable[str], edges: Mapping[str, set], stop: set | frozenset = frozenset()) -> tuple[set, set]:
    """Nodes reached from `seeds` along `edges` without passing through `stop`; (found, stops reached)."""
    found: set[str] = set()
    stops: set[str] = set()
    pending = [*seeds]
    while pending:
        node_id = pending.pop()
        if node_id in found:
            continue
        found.add(node_id)
        if node_id in stop:
            stops.add(node_id)
        else:
            pending.extend(edges.get(node_id, ()))
    return found, stops


class _LoopErrors:
    """Collects loop errors, attached to every node they name."""

    def __init__(self, prompt: Prompt) -> None:
        self.prompt = prompt
        self.by_node: dict[str, list[dict]] = {}
        self.involved: set[str] = set()

    def add(self, kind: str, message: str, details: str, node_ids: Iterable[str], *, input_name: str | None = None,
            received: Any = None) -> None:
        ids = sorted(set(node_ids))
        error = node_error(kind, message, details)
        error["extra_info"] = {"loop_error_type": kind, "node_ids": ids}
        if input_name is not None:
            error["extra_info"].update(input_name=input_name, received_value=received)
        for node_id in ids:
            self.by_node.setdefault(node_id, []).append(error)
        self.involved.update(ids)

    def label(self, node_id: str) -> str:
        return self.prompt.nodes[node_id].label


class _LoopAnalysis:
    """Loops of one prompt as the check finds them: errors, pairs (innermost first), bodies, and
    each End Loop's inputs with their names and `accumulate` normalized."""

    def __init__(self, errors: _LoopErrors, pairs: list[tuple[str, str]], bodies: dict[str, set],
                 outputs: set[str], ends: set[str], end_inputs: dict[str, dict[str, Any]]) -> None:
        self.errors = errors
        self.pairs = pairs
        self.bodies = bodies
        self.outputs = outputs
        self.ends = ends
        self.end_inputs = end_inputs


def check_loops(prompt: Prompt, registry, options: Mapping[str, Any]) -> dict[str, list[dict]]:
    """Pair every End Loop with its Start Loop and refuse malformed loops (a pure check).

    Errors (`type` and `extra_info.loop_error_type`): loop_end_without_start, loop_start_without_end,
    ambiguous_loop_nesting, loop_end_cycle, loop_accumulate_from_body, loop_escape (an output node or an
    unpaired End reached from a Start without passing its End), loop_too_many_iterations."""
    analysis = _analyse(prompt, registry, options)
    return analysis.errors.by_node if analysis is not None else {}


def rewrite_loops(prompt: Prompt, registry, options: Mapping[str, Any]) -> RewriteResult:
    """The graph the loops of a checked prompt run as (see the module docstring): each End Loop of
    a well-formed loop is replaced by one holding its `LoopTemplate` under `__loop__` and no links
    into its body, and every body node (and Start) stands in for by its outermost End."""
    analysis = _analyse(prompt, registry, options)
    if analysis is None:
        return RewriteResult()
    replaced: dict[str, PromptNode] = {}
    stand_ins: dict[str, str] = {}
    bodies, ends = analysis.bodies, analysis.ends
    for start, end in analysis.pairs:  # innermost first: an outer loop copies its inner Ends as rewritten
        body = bodies[start]
        if analysis.errors.involved & (body | {start, end}):
            continue
        if not body & ends <= replaced.keys():
            continue
        replaced[end] = _prepare(prompt, replaced, analysis, start, end)
        for node_id in body | {start}:
            stand_ins[node_id] = end  # outer loops are prepared later and take over their inner ones
        for node_id, stand_in in list(stand_ins.items()):
            if stand_in in body:
                stand_ins[node_id] = end
    return RewriteResult(replaced, stand_ins)


def _analyse(prompt: Prompt, registry, options: Mapping[str, Any]) -> _LoopAnalysis | None:
    nodes = prompt.nodes
    starts = {i for i, n in nodes.items() if n.class_type == START}
    ends = {i for i, n in nodes.items() if n.class_type == END}
    if not starts and not ends:
        return None
    errors = _LoopErrors(prompt)
    end_spec = registry.get(END)
    end_inputs: dict[str, dict[str, Any]] = {}
    for end in ends:
        # Every End is checked here: one reached only through an output inside its body (a save
        # wired to a termination) is upstream of no output, so the per-node checks skipped it.
        node = nodes[end]
        inputs = end_inputs[end] = dict(end_spec.normalize_input_names(node.inputs))
        accumulate = inputs.get("accumulate", False)
        if isinstance(accumulate, str) and accumulate.lower() in ("true", "false"):
            inputs["accumulate"] = accumulate.lower() == "true"
        elif type(accumulate) is not Link and not isinstance(accumulate, bool):
            errors.add("invalid_input_type", f"Node {node.label}: input 'accumulate' expects BOOLEAN",
                       f"accumulate: received {accumulate!r}", [end], input_name="accumulate", received=accumulate)
    outputs = {i for i, n in nodes.items() if registry.get(n.class_type).output_node}
    parents = {i: {link.node for link in n.links() if link.node in nodes} for i, n in nodes.items()}
    children: dict[str, set] = {i: set() for i in nodes}
    for node_id, sources in parents.items():
        for source in sources:
            children[source].add(node_id)

    # The nodes that matter: what the outputs need, plus what follows an output up to the End Loops
    # it feeds (a SaveImage inside a body makes its loop matter even when the End's value is unused).
    relevant, _ = _walk(outputs, parents)
    following, _ = _walk(outputs, children, starts)
    following -= starts - relevant
    upstream_of_ends, _ = _walk(following & ends, parents, starts)
    relevant |= following | upstream_of_ends
    par = {i: parents[i] & relevant for i in relevant}
    chi = {i: children[i] & relevant for i in relevant}
    starts &= relevant
    ends &= relevant
    terminal = {o for o in outputs & relevant if not chi[o]}

    nested = {s: _walk(chi[s], chi, starts)[1] for s in starts}  # Starts directly inside each Start
    inside = {s: _walk(nested[s], nested)[0] for s in starts}  # every Start inside each Start
    ends_above = {e: _walk(par[e], par, ends)[1] for e in ends}  # the nearest Ends upstream of each End

    pairs: list[tuple[str, str]] = []  # innermost first
    open_starts, open_ends = set(starts), set(ends)
    excused: set[str] = set()  # Starts already blamed in another error
    while open_ends:
        end = next((e for e in sorted(open_ends) if not ends_above[e] & open_ends), None)
        if end is None:
            names = ", ".join(errors.label(e) for e in sorted(open_ends))
            errors.add("loop_end_cycle", "End Loops depend on each other",
                       f"End Loops {names} depend on each other (a cycle through End Loop), so none can close first",
                       open_ends)
            excused |= open_starts
            break
        open_ends.discard(end)
        candidates = _walk(par[end], par, open_starts)[1]
        if not candidates:
            errors.add("loop_end_without_start", "End Loop has no Start Loop",
                       f"End Loop {errors.label(end)} has no Start Loop upstream of it", [end])
            continue
        closest = [c for c in candidates if all(o == c or c in inside[o] for o in candidates)]
        if len(closest) != 1:
            names = ", ".join(errors.label(c) for c in sorted(candidates))
            errors.add("ambiguous_loop_nesting", "End Loop has ambiguous Start Loops",
                       f"End Loop {errors.label(end)} can close several Start Loops that are not nested in one "
                       f"another: {names}", candidates | {end})
            excused |= candidates
            continue
        start = closest[0]
        open_starts.discard(start)
        pairs.append((start, end))
        escapes = _walk(chi[start], chi, open_ends | terminal | {end})[1] - {end}
        if escapes:
            names = ", ".join(errors.label(x) for x in sorted(escapes))
            errors.add("loop_escape", "Loop body is not closed",
                       f"Start Loop {errors.label(start)} reaches {names} without passing through End Loop "
                       f"{errors.label(end)}; wire output nodes inside a loop into the End Loop's termination "
                       f"inputs", escapes | {start, end})
    for start in sorted(open_starts - excused):
        errors.add("loop_start_without_end", "Start Loop has no End Loop",
                   f"Start Loop {errors.label(start)} is not closed by any End Loop downstream of it", [start])

    bodies: dict[str, set] = {}
    for start, end in pairs:
        body = _walk(chi[start], chi, {end})[0] - {end}
        bodies[start] = body
        accumulate = end_inputs[end].get("accumulate")
        if type(accumulate) is Link and (accumulate.node == start or accumulate.node in body):
            errors.add("loop_accumulate_from_body", "End Loop accumulate depends on its loop body",
                       f"End Loop {errors.label(end)}: accumulate comes from {errors.label(accumulate.node)} inside "
                       f"the loop of Start Loop {errors.label(start)}; it must be fixed before the loop starts",
                       {start, end, accumulate.node}, input_name="accumulate", received=accumulate.to_json())
        _check_count(errors, nodes[start], int(options.get("max_loop_iterations") or DEFAULT_MAX_LOOP_ITERATIONS))
    return _LoopAnalysis(errors, pairs, bodies, outputs & relevant, ends, end_inputs)


def _check_count(errors: _LoopErrors, start, limit: int) -> None:
    inputs = start.inputs
    mode = inputs.get("mode")
    count = None
    try:
        if mode == "simple" and type(inputs.get("mode.num_iterations")) is int:
            count, name = inputs["mode.num_iterations"], "mode.num_iterations"
        elif mode == "For" and all(type(inputs.get(f"mode.{k}")) is int
                                   for k in ("start_iteration_index", "max_iteration", "step")):
            step = inputs["mode.step"]
            if step >= 1:
                count = len(range(inputs["mode.start_iteration_index"], inputs["mode.max_iteration"], step))
            name = "mode.max_iteration"
    except OverflowError:  # a range longer than sys.maxsize is certainly over any limit
        count, name = limit + 1, "mode.max_iteration"
    if count is not None and count > limit:
        errors.add("loop_too_many_iterations", "Loop has too many iterations",
                   f"Start Loop {errors.label(start.id)} would run {count} iterations, more than the limit of {limit} "
                   f"(--max-loop-iterations)", [start.id], input_name=name, received=inputs.get(name))


def _prepare(prompt: Prompt, replaced: Mapping[str, PromptNode], analysis: _LoopAnalysis, start: str,
             end: str) -> PromptNode:
    """The End Loop of one loop as it runs: its template added, its links into the body cut."""
    nodes = prompt.nodes
    body, bodies = analysis.bodies[start], analysis.bodies
    end_inputs = analysis.end_inputs[end]
    # An inner loop is inside its rewritten End's template: the outer loop copies only that End.
    owned: set[str] = set()
    for inner_start, inner_end in analysis.pairs:
        if inner_start in body:
            owned |= bodies[inner_start] | {inner_start}
            owned.discard(inner_end)
    own_outputs = sorted((analysis.outputs & body) - owned)
    seeds = [v.node for k, v in end_inputs.items() if _is_body_side(k) and type(v) is Link]
    seeds += own_outputs
    needed: set[str] = set()
    pending = [s for s in seeds if s in body]
    while pending:  # what the End's body-side inputs and the body's outputs read, inside the body
        node_id = pending.pop()
        if node_id in needed or node_id not in body or node_id in owned:
            continue
        needed.add(node_id)
        pending.extend(link.node for link in nodes[node_id].links())
    body_nodes = []
    for node_id in sorted(needed):
        node = replaced.get(node_id) or nodes[node_id]
        body_nodes.append(BodyNode(node_id, node.class_type, node.inputs, node.display_id, node.title))
    end_node = nodes[end]
    template = LoopTemplate(
        start_id=start, start_display=nodes[start].display_id, start_inputs=nodes[start].inputs,
        end_display=end_node.display_id, end_inputs={k: v for k, v in end_inputs.items() if _is_body_side(k)},
        body=body_nodes, output_ids=own_outputs)
    inputs = {k: v for k, v in end_inputs.items() if not _is_body_side(k)}
    inputs[LOOP_KEY] = template
    return PromptNode(end, end_node.class_type, inputs, end_node.title, parent=end_node.parent,
                      display_id=end_node.display_id, real_id=end_node.real_id)


# ---------------------------------------------------------------------- node declarations
_LIST_T, _CARRIED_T, _OUTPUT_T = "list_item", "carried_value", "output_value"


def _int_input(name: str, default: int, tooltip: str, **bounds: int) -> InputSpec:
    # Only the bounds given here are declared, so the widget limits match the ComfyUI editor's.
    return InputSpec(name, "INT", "required", {"default": default, **bounds, "tooltip": tooltip})


START_LOOP = NodeSpec(
    node_id=START, display_name="Start Loop", category=CATEGORY, python_module="comfy_extras.nodes_loop",
    description="Where a loop begins. Everything wired from here to the matching End Loop is repeated, "
                "and each pass finishes before the next one starts.",
    input_is_list=True,
    inputs=[
        Input.dynamic_combo("mode", {
            "simple": [_int_input("num_iterations", 4, "How many passes the loop makes.", min=0)],
            "For": [
                _int_input("start_iteration_index", 0, "The iteration_index of the first pass."),
                _int_input("max_iteration", 4, "The loop stops before iteration_index reaches this value.",
                           max=2**64 - 1),
                _int_input("step", 1, "How much iteration_index grows from one pass to the next.", min=1),
            ],
            "List": [Input.match_type("list", _LIST_T, tooltip="A list to walk through: one pass per entry, "
                                                                 "in order.")],
        }, tooltip="simple: a fixed number of passes; For: a counted range; List: one pass per list "
                   "entry."),
        InputSpec("cache_iterations", "BOOLEAN", "required", {
            "default": False, "advanced": True,
            "tooltip": "Keep each pass's results in the cache, so a pass whose inputs did not change is not run "
                       "again next time. Off: every pass runs on every run."}),
        InputSpec("parent_iteration", "INT", "optional", {
            "forceInput": True,
            "tooltip": "For a loop inside another: wire the outer Start Loop's iteration_index here."}),
        Input.match_type("initial_iteration_value", _CARRIED_T, optional=True,
                         tooltip="What current_iteration_value holds during the first pass."),
    ],
    outputs=[
        Output("INT", "iteration_index", tooltip="This pass's index: 0, 1, 2... (in For mode, counted from "
                                                 "start_iteration_index by step)."),
        Output("BOOLEAN", "is_first", tooltip="Whether this is the opening pass."),
        Output("BOOLEAN", "is_last", tooltip="Whether this is the closing pass as planned (break_when may stop the "
                                             "loop earlier)."),
        Output(MATCH_TYPE, "list_item", match_type=_LIST_T,
               tooltip="In List mode, the entry for this pass; in the other modes, nothing."),
        Output(MATCH_TYPE, "current_iteration_value", match_type=_CARRIED_T,
               tooltip="The value handed from pass to pass: initial_iteration_value at first, afterwards "
                       "whatever End Loop received as next_iteration_value in the pass before."),
    ],
    execute=_start_loop,
    search_aliases=("loop", "for", "repeat", "iterate", "for each"),
)

END_LOOP = NodeSpec(
    node_id=END, display_name="End Loop", category=CATEGORY, python_module="comfy_extras.nodes_loop",
    description="Where a loop ends. Gives back what output_value received (in the closing pass, or in "
                "every pass) and hands next_iteration_value on to the following pass.",
    input_is_list=True,
    inputs=[
        Input.match_type("output_value", _OUTPUT_T, optional=True,
                         tooltip="What the loop gives back: the closing pass's value, or every pass's "
                                 "value when accumulate is on."),
        Input.match_type("next_iteration_value", _CARRIED_T, optional=True,
                         tooltip="Becomes current_iteration_value at Start Loop in the following pass."),
        Input.boolean("accumulate", False, tooltip="On: collect output_value from all passes into "
                                                   "the result list. Off: keep only the closing pass's value."),
        Input.autogrow("terminations", Input.link(
            "termination", "*", tooltip="A node to run in each pass for its effect (a preview, a "
                                        "save); its value is ignored."),
            prefix="termination", min=0, max=50,
            tooltip="Nodes to run in each pass for their effect; their values are ignored."),
        Input.boolean("break_when", False, optional=True, force_input=True,
                      tooltip="Weft only: once this is true, the pass now running is the last one."),
        Input.hidden("dynprompt", "DYNPROMPT"),
        Input.hidden("unique_id", "UNIQUE_ID"),
    ],
    outputs=[Output(MATCH_TYPE, "outputs", is_list=True, match_type=_OUTPUT_T,
                    tooltip="output_value of the closing pass, or of every pass in order with "
                            "accumulate on.")],
    execute=_end_loop, fingerprint=_end_fingerprint,
    search_aliases=("loop", "end loop", "repeat"),
)

LOOP_STEP = NodeSpec(
    node_id="LoopStep", display_name="Loop Step (internal)", category=CATEGORY + "/internal", dev_only=True,
    description="Internal to Start Loop / End Loop: plans a loop, collects one iteration and expands the next. "
                "Made by End Loop; not for use in the editor.",
    input_is_list=True,
    inputs=[Input.link("loop", "*"),
            *(Input.link(name, "*", optional=True) for name in (
                "output_value", "break_when", "mode", "num_iterations", "start_iteration_index", "max_iteration",
                "step", "list", "cache_iterations"))],
    outputs=[Output("*", "outputs", is_list=True)],
    execute=_loop_step,
)

LOOP_ITERATION = NodeSpec(
    node_id="LoopIteration", display_name="Loop Iteration (internal)", category=CATEGORY + "/internal", dev_only=True,
    description="Internal to Start Loop / End Loop: what Start Loop's outputs are in one iteration. Made by "
                "LoopStep; not for use in the editor.",
    input_is_list=True,
    inputs=[Input.link("iteration_index", "INT"), Input.link("is_first", "BOOLEAN"), Input.link("is_last", "BOOLEAN"),
            Input.link("list_item", "*", optional=True), Input.link("current_iteration_value", "*", optional=True),
            Input.link("parent_iteration", "INT", optional=True)],
    outputs=[Output("INT", "iteration_index"), Output("BOOLEAN", "is_first"), Output("BOOLEAN", "is_last"),
             Output("*", "list_item"), Output("*", "current_iteration_value", is_list=True)],
    execute=_loop_iteration,
)

SPLIT_TEXT = NodeSpec(
    node_id="SplitTextToList", display_name="Split Text to List", category=CATEGORY,
    description="Splits a text into a list of strings (one per line by default), e.g. prompts for a List loop.",
    inputs=[Input.string("text", "", multiline=True, tooltip="The text to split."),
            Input.string("delimiter", "\\n", tooltip="Where to split; \\n (the default) splits at line ends."),
            Input.boolean("skip_empty", True, tooltip="Leave out empty pieces (after trimming spaces).")],
    outputs=[Output("STRING", "items", is_list=True, tooltip="The pieces, trimmed, as a list.")],
    execute=_split_text,
)

NODES = [START_LOOP, END_LOOP, LOOP_STEP, LOOP_ITERATION, SPLIT_TEXT]
# Validation runs the check; the rewrite then gives each End Loop its template (a declared input).
LOOPS = GraphRewrite("loops", check_loops, rewrite_loops, adds_inputs={END: (LOOP_KEY,)})
GRAPH_CHECKS = [LOOPS]
