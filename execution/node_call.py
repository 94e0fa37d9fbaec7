"""Calling a node: its inputs gathered, its lazy-input question, its calls over list inputs, its result.

One path serves sync and async nodes: `NodeCaller.call` is a coroutine that awaits a result only
when the node is async; the scheduler awaits it in place for a sync node (it never suspends) and
runs it as a task for an async one.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from execution import context as run_context
from execution.failure import RunFailure
from execution.graph import Link, Prompt, PromptNode, PromptReader, is_link_value
from execution.paths import Paths
from execution.readiness import Slot
from execution.spec import NodeSpec
from execution.types import ExecutionBlocker, NodeOutput, normalize_result


class Called:
    """A node's outputs gathered over its calls: per-output item lists, merged UI, expansions."""

    __slots__ = ("outputs", "ui", "expansions", "calls", "counts", "notes")

    def __init__(self, outputs: list[list[Any]], ui: dict | None = None, expansions: list[dict] | None = None,
                 calls: int = 0, notes: dict[str, list] | None = None) -> None:
        self.outputs = outputs
        self.ui = ui
        self.expansions = expansions
        self.calls = calls
        self.counts: dict[str, float] | None = None  # what the node counted (RunContext.count), for its profile
        self.notes = notes  # what the calls added to the node's profile row (RunContext.note_profile)


class NodeCaller:
    """Gathers a node's inputs and calls it, within one job."""

    def __init__(self, prompt: Prompt, prompt_id: str, extra_data: dict, paths: Paths,
                 runtime: run_context.Services,
                 emit: Callable[[str, dict], None], is_interrupted: Callable[[], bool]) -> None:
        self.prompt = prompt
        self.prompt_id = prompt_id
        self.extra_data = extra_data
        self.paths = paths
        self.runtime = runtime
        self.emit = emit
        self.is_interrupted = is_interrupted

    def gather(self, slot: Slot, slots: dict[str, Slot]) -> tuple[dict[str, list[Any]], list[str]]:
        """Per-input item lists for the node's calls, and the lazy inputs not evaluated yet."""
        node, spec = slot.node, slot.spec
        gathered: dict[str, list[Any]] = {}
        unevaluated: list[str] = []
        declared = spec.instance_inputs(node.inputs)
        # Linked inputs the node does not declare are passed too (ComfyUI does: a variadic node's editor
        # script grows `input2`, `input3`, ... and its execute takes **kwargs); constants only to a node
        # that takes every input.
        undeclared = [(name, None) for name, value in node.inputs.items()
                      if name not in declared and (type(value) is Link or spec.takes_every_input)]
        for name, inp in [*declared.items(), *undeclared]:
            if inp is not None and inp.executor_supplied:
                gathered[name] = [self._hidden(node, inp.type)]
                continue
            if name not in node.inputs:
                continue
            value = node.inputs[name]
            if type(value) is Link and inp is not None and inp.options.get("rawLink"):
                # The node asked for the link itself (a pack's loop close reads where its flow comes from);
                # the source still runs first, as a dependency.
                gathered[name] = [value.to_json()]
            elif type(value) is Link:
                source = slots.get(value.node)
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
            return PromptReader(self.prompt)
        return self.extra_data.get(kind.lower())

    def context(self, node: PromptNode) -> run_context.RunContext:
        """What the node sees through `execution.context.current()` while it is called."""
        return run_context.RunContext(
            prompt_id=self.prompt_id, node_id=node.id, display_node_id=node.display_id, paths=self.paths,
            emit=self.emit, is_interrupted=self.is_interrupted, runtime=self.runtime,
            parent_node_id=node.parent, real_node_id=node.real_id or node.id, extra_data=self.extra_data)

    async def lazy_wanted(self, slot: Slot, gathered: dict[str, list[Any]], unevaluated: list[str]) -> list[str]:
        """The unevaluated lazy inputs the node asks for (`check_lazy_status`)."""
        spec = slot.spec
        # Asked once per call the node will make (ComfyUI maps the hook like execute): with a list
        # input, each item may need a different lazy input, and the node gets the union.
        wanted: list[str] = []
        for args in call_arguments(spec.input_is_list, gathered):
            answer = await self._invoke(slot.node, spec.check_lazy_status, spec.group_arguments(args), gathered)
            if answer is None:
                continue
            for name in [answer] if isinstance(answer, str) else answer:
                if str(name) in unevaluated and str(name) not in wanted:
                    wanted.append(str(name))
        return wanted

    async def call(self, slot: Slot, gathered: dict[str, list[Any]]) -> Called:
        """Call the node once per element of its list inputs and gather what the calls return."""
        node, spec = slot.node, slot.spec
        execute, group = spec.execute, spec.group_arguments
        called = Called([[] for _ in spec.outputs], {}, [])
        calls = call_arguments(spec.input_is_list, gathered)
        context = self.context(node)
        invoked = 0
        for args in calls:
            blocker = blocker_in(args, spec.input_is_list)
            if blocker is not None:  # this call is skipped; its items downstream are blocked in turn
                if spec.output_node and blocker.message:
                    raise RunFailure.node_raised(node, RuntimeError(blocker.message), gathered)
                for values in called.outputs:
                    values.append(blocker)
                continue
            result = await self._invoke(node, execute, group(args), gathered, context, may_await=spec.is_async)
            _collect(node, spec, result, called, gathered)
            invoked += 1
        called.calls = invoked
        called.ui = called.ui or None
        called.counts = context.counts or None
        called.notes = context.profile_notes
        return called

    async def _invoke(self, node: PromptNode, fn: Callable[..., Any], kwargs: dict, gathered: dict,
                      context: run_context.RunContext | None = None, *, may_await: bool = True) -> Any:
        """One call of a node's function (its execute or a hook) inside its run context; what it raises
        becomes the job's failure, naming the node."""
        token = run_context.activate(context or self.context(node))
        try:
            result = fn(**kwargs)
            if type(result) is not tuple and inspect.isawaitable(result):   # a tuple never is: skip the check
                if not may_await:
                    raise TypeError(f"node '{node.class_type}' returned an awaitable from a non-async execute")
                result = await result
            return result
        except RunFailure:
            raise
        except run_context.ExecutionInterrupted as stop:
            raise RunFailure.interrupted(node) from stop
        except Exception as exc:
            raise RunFailure.node_raised(node, exc, gathered) from exc
        finally:
            run_context.deactivate(token)


def call_arguments(input_is_list: bool, gathered: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """One argument dict per call: list inputs are mapped, shorter lists repeat their last item."""
    if input_is_list:
        return [gathered]
    lengths = [len(v) for v in gathered.values()]
    if all(n == 1 for n in lengths):
        return [{k: v[0] for k, v in gathered.items()}]
    count = 0 if any(n == 0 for n in lengths) else max(lengths, default=1)
    return [{k: v[i] if i < len(v) else v[-1] for k, v in gathered.items()} for i in range(count)]


def blocker_in(args: dict[str, Any], input_is_list: bool) -> ExecutionBlocker | None:
    """The ExecutionBlocker that skips one call, if any: a mapped call is blocked by a blocked item of
    its own, a list node's single call by a blocked item anywhere in its lists (ComfyUI's rule)."""
    for value in args.values():
        if input_is_list:
            for item in value:
                if type(item) is ExecutionBlocker:
                    return item
        elif type(value) is ExecutionBlocker:
            return value
    return None


def merge_ui(into: dict, ui: dict) -> None:
    """Merge one call's UI dict into `into` (lists concatenate)."""
    for key, value in ui.items():
        if isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = into[key] + value
        else:
            into[key] = value


def _collect(node: PromptNode, spec: NodeSpec, result: Any, called: Called, gathered: dict) -> None:
    """Add one call's result to the node's per-output lists."""
    if type(result) is tuple and len(result) == len(spec.outputs):
        result = NodeOutput(result)
    else:
        try:
            result = normalize_result(spec, result)
        except TypeError as exc:
            raise RunFailure.node_raised(node, exc, gathered) from exc
    if result.ui:
        merge_ui(called.ui, result.ui)
    if result.expand:
        called.expansions.append(result.expand)
    values = result.values
    outputs = called.outputs
    for index, out_spec in enumerate(spec.outputs):
        value = values[index] if index < len(values) else None
        if out_spec.is_list and not (result.expand and is_link_value(value)):
            outputs[index].extend(value if isinstance(value, (list, tuple)) else [value])
        else:
            outputs[index].append(value)
