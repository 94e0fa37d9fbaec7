"""Adapter from ComfyUI's V3 node classes (`comfy_api.latest.io.ComfyNode`) to NodeSpec.

A V3 class is read once, when its pack registers: `define_schema()` gives the inputs, outputs and
flags, which become a `NodeSpec` like any other, so the executor, validation, the cache and
`/object_info` never see the class. Each plain input writes its options with `as_dict()` in the
names a classic node's INPUT_TYPES uses and goes through the same reading as a classic input
(`nodes.classic.input_from_declaration`); dynamic combos and auto-grow groups become the spec's own
dynamic inputs.

At run time the class's hooks are called on a per-call subclass whose `hidden` holds the hidden
values the schema asked for (`cls.hidden.unique_id`, ...), as ComfyUI's V3 nodes expect; the values
are not passed as arguments. `fingerprint_inputs` runs before the node's inputs are known, so there
`cls.hidden` is empty. What a V3 result holds (`io.NodeOutput` with `ui`, `expand`,
`block_execution`; a tuple; a dict) becomes Weft's `NodeOutput`.

`accept_all_inputs` gives the node every input of its prompt entry, constants it does not declare
included (`NodeSpec.takes_every_input`).

Refused at registration, naming the node and the feature: API nodes (`is_api_node`, `price_badge`),
`loop_boundary`, async `validate_inputs` or `fingerprint_inputs`, and inputs of
kinds Weft's contract cannot express. Pack discovery (`comfy_entrypoint()` and `ComfyExtension`) is
`specs_from_entrypoint`; `nodes/plugins.py` calls it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import sys
import types
from typing import Any, Callable

from execution.spec import AUTOGROW, DYNAMIC_COMBO, InputSpec, NodeDefinitionError, NodeSpec, OutputSpec
from execution.types import ExecutionBlocker, NodeOutput
from nodes.classic import input_from_declaration

IO_MODULE = "comfy_api.latest._io"  # importable once nodes/compat is on sys.path (see nodes/plugins.py)
API_MODULE = "comfy_api.latest"
# Schema flags Weft cannot honour, and why.
REFUSED_FLAGS = {
    "is_api_node": "API nodes call a remote service with the editor's account, which Weft does not provide",
    "price_badge": "price badges belong to API nodes, which Weft does not run",
    "loop_boundary": "Weft's loops are its own nodes (nodes/loops.py); a V3 loop boundary is not supported",
}


def _io() -> types.ModuleType | None:
    """The V3 io module, when some pack has imported it (no V3 class can exist before that)."""
    return sys.modules.get(IO_MODULE)


def is_v3_node(obj: Any) -> bool:
    """Whether `obj` is a V3 node class (a subclass of `comfy_api.latest.io.ComfyNode`)."""
    io = _io()
    return io is not None and inspect.isclass(obj) and issubclass(obj, io.ComfyNode)


def _fail(node_id: str, field: str, message: str) -> None:
    raise NodeDefinitionError(f"node '{node_id}': {field}: {message}")


# ---------------------------------------------------------------------- declaration
def _input(node_id: str, item: Any, io: types.ModuleType, label: str) -> InputSpec:
    if not isinstance(item, io.Input):
        _fail(node_id, label, f"is a {type(item).__name__}, not a comfy_api io input")
    try:
        item.validate()
    except ValueError as exc:
        _fail(node_id, f"input '{item.id}'", str(exc))
    kind = "optional" if item.optional else "required"
    if isinstance(item, io.DynamicCombo.Input):
        options: dict[str, tuple[InputSpec, ...]] = {}
        for option in item.options:
            options[str(option.key)] = tuple(
                _input(node_id, sub, io, f"input '{item.id}' option {option.key!r}") for sub in option.inputs)
        return InputSpec(item.id, DYNAMIC_COMBO, kind, item.as_dict(), dynamic_options=options)
    if isinstance(item, io.Autogrow.Input):
        template = item.template
        slot = _input(node_id, template.input, io, f"input '{item.id}' template")
        if isinstance(template, io.Autogrow.TemplateNames):
            return InputSpec(item.id, AUTOGROW, kind, item.as_dict(), template=slot, grow_min=template.min,
                             grow_max=len(template.names), names=tuple(template.names))
        return InputSpec(item.id, AUTOGROW, kind, item.as_dict(), template=slot, prefix=template.prefix,
                         grow_min=template.min, grow_max=template.max)
    if isinstance(item, io.DynamicInput):
        _fail(node_id, f"input '{item.id}'", f"{type(item).__qualname__} is a dynamic input Weft does not support")
    return input_from_declaration(node_id, item.id, kind, (item.get_io_type(), item.as_dict()))


def _output(node_id: str, index: int, item: Any, io: types.ModuleType) -> OutputSpec:
    if not isinstance(item, io.Output):
        _fail(node_id, f"output {index}", f"is a {type(item).__name__}, not a comfy_api io output")
    match = item.template.template_id if isinstance(item, io.MatchType.Output) else None
    return OutputSpec(item.get_io_type(), item.display_name or item.get_io_type(), bool(item.is_output_list),
                      item.tooltip or None, match)


def _schema(node_id: str | None, cls: type, io: types.ModuleType) -> Any:
    label = node_id or cls.__name__
    try:
        schema = cls.define_schema()
    except NodeDefinitionError:
        raise
    except Exception as exc:
        raise NodeDefinitionError(f"node '{label}': define_schema() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(schema, io.Schema):
        _fail(label, "define_schema()", f"must return an io.Schema, got {type(schema).__name__}")
    label = node_id or (schema.node_id if isinstance(schema.node_id, str) and schema.node_id else label)
    try:
        schema.finalize()
        schema.validate()
    except ValueError as exc:
        _fail(label, "schema", str(exc))
    return schema


def spec_from_v3_class(cls: type, *, node_id: str | None = None, python_module: str = "custom_nodes",
                       display_name: str | None = None) -> NodeSpec:
    """Build a NodeSpec from a V3 node class; `node_id` (a mapping key) overrides the schema's id."""
    io = _io()
    if not is_v3_node(cls):
        raise NodeDefinitionError(f"node '{node_id or cls!r}': not a comfy_api io.ComfyNode class")
    schema = _schema(node_id, cls, io)
    node_id = node_id or schema.node_id
    if not isinstance(node_id, str) or not node_id:
        _fail(cls.__name__, "Schema.node_id", f"must be a non-empty string, got {node_id!r}")
    for flag, reason in REFUSED_FLAGS.items():
        if getattr(schema, flag):
            _fail(node_id, f"Schema.{flag}", f"not supported: {reason}")
    if not io.overrides(cls, "execute"):
        _fail(node_id, "execute", f"{cls.__name__} does not define execute()")
    inputs = [_input(node_id, item, io, f"input {i}") for i, item in enumerate(schema.inputs)]
    hidden = {}
    for value in schema.hidden:
        member = value if isinstance(value, io.Hidden) else None
        if member is None:
            try:
                member = io.Hidden(value)
            except ValueError:
                _fail(node_id, "Schema.hidden", f"unknown hidden value {value!r}; known: "
                      f"{', '.join(m.name for m in io.Hidden)}")
        # Hidden values live apart from the inputs (`cls.hidden`): an input may share a hidden value's
        # name (an input `prompt` beside io.Hidden.prompt), so that value then travels under another key.
        key = member.name
        while any(spec.name == key for spec in inputs):
            key = f"{key}_hidden"
        hidden[key] = member
        inputs.append(InputSpec(key, member.value, "hidden"))
    outputs = [_output(node_id, i, item, io) for i, item in enumerate(schema.outputs)]
    hooks = _Hooks(cls, node_id, hidden, io, len(outputs), schema.enable_expand)
    lazy = any(spec.lazy for spec in inputs)
    validate = hooks.bound("validate_inputs")
    return NodeSpec(
        node_id=node_id,
        display_name=display_name or schema.display_name or node_id,
        category=schema.category or "sd",
        description=schema.description or "",
        inputs=inputs,
        outputs=outputs,
        execute=hooks.execute(),
        output_node=bool(schema.is_output_node),
        input_is_list=bool(schema.is_input_list),
        not_idempotent=bool(schema.not_idempotent),
        may_expand=bool(schema.enable_expand),
        fingerprint=hooks.bound("fingerprint_inputs"),
        validate_inputs=validate,
        validate_takes=_named_parameters(validate) if validate is not None else frozenset(),
        # ComfyUI's default asks for every lazy input; a node without lazy inputs never needs asking.
        check_lazy_status=hooks.bound("check_lazy_status", default=lazy),
        python_module=python_module,
        deprecated=bool(schema.is_deprecated),
        experimental=bool(schema.is_experimental),
        search_aliases=tuple(schema.search_aliases or ()),
        has_intermediate_output=bool(schema.has_intermediate_output),
        dev_only=bool(schema.is_dev_only),
        essentials_category=schema.essentials_category,
        lenient=True,
        takes_every_input=bool(schema.accept_all_inputs),
    )


def _named_parameters(fn: Callable[..., Any]) -> frozenset[str]:
    params = inspect.signature(fn).parameters.values()
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                     and p.name not in ("cls", "self", "input_types"))


# ---------------------------------------------------------------------- run time
class _Hooks:
    """The class's hooks as NodeSpec functions, each called on a subclass holding the hidden values."""

    def __init__(self, cls: type, node_id: str, hidden: dict[str, Any], io: types.ModuleType, output_count: int,
                 may_expand: bool) -> None:
        self.cls = cls
        self.node_id = node_id
        self.hidden = hidden  # input name -> io.Hidden member
        self.io = io
        self.output_count = output_count
        self.may_expand = may_expand

    def _runner(self, kwargs: dict[str, Any]) -> type:
        """A subclass of the node class whose `hidden` holds the hidden values taken out of `kwargs`."""
        values = {member: kwargs.pop(name) for name, member in self.hidden.items() if name in kwargs}
        holder = self.io.HiddenHolder.from_dict(values)
        return type(self.cls.__name__, (self.cls,), {
            "hidden": holder, "__module__": self.cls.__module__, "__qualname__": self.cls.__qualname__})

    def bound(self, name: str, *, default: bool = False) -> Callable[..., Any] | None:
        """The hook `name` (only when the class declares it, or `default` asks for the base one),
        taking the keyword arguments its signature accepts."""
        if not self.io.overrides(self.cls, name) and not default:
            return None
        declared = getattr(self.cls, name)
        if name in ("validate_inputs", "fingerprint_inputs") and inspect.iscoroutinefunction(declared):
            _fail(self.node_id, name, "is async; Weft calls it while checking a prompt and signing the cache, "
                  "which wait for no coroutine")
        accepted = _accepted_names(declared)

        @functools.wraps(declared)
        def call(**kwargs: Any) -> Any:
            runner = self._runner(kwargs)
            if accepted is not None:
                kwargs = {key: value for key, value in kwargs.items() if key in accepted}
            return getattr(runner, name)(**kwargs)

        return call

    def execute(self) -> Callable[..., Any]:
        """`execute` as Weft calls it: hidden values moved to `cls.hidden`, the result made a NodeOutput."""
        declared = self.cls.execute
        if inspect.iscoroutinefunction(declared):
            async def run(**kwargs: Any) -> NodeOutput:
                runner = self._runner(kwargs)
                return self.result(await runner.execute(**kwargs))
        else:
            def run(**kwargs: Any) -> NodeOutput:
                runner = self._runner(kwargs)
                return self.result(runner.execute(**kwargs))
        return run

    def result(self, returned: Any) -> Any:
        """What a V3 execute returned, as Weft's NodeOutput (a plain tuple passes unchanged)."""
        io = self.io
        if isinstance(returned, ExecutionBlocker):  # every output blocked (silently when it has no message)
            return NodeOutput(tuple(returned for _ in range(self.output_count)))
        if isinstance(returned, dict):
            returned = io.NodeOutput.from_dict(returned)
        if not isinstance(returned, io.NodeOutput):
            return returned
        if returned.expand is not None and not self.may_expand:
            raise RuntimeError(f"node '{self.node_id}' returned an expansion, but its schema does not set "
                               "enable_expand=True")
        if returned.block_execution is not None:
            values = tuple(ExecutionBlocker(returned.block_execution) for _ in range(self.output_count))
        else:
            values = tuple(returned.args)
        ui = returned.ui.as_dict() if isinstance(returned.ui, io._UIOutput) else returned.ui
        return NodeOutput(values, ui, returned.expand)


def _accepted_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword names `fn` accepts, or None when it takes any (**kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


# ---------------------------------------------------------------------- pack discovery
def _run(coroutine_function: Callable[[], Any]) -> Any:
    """Run a pack's coroutine to completion from synchronous start-up code, in a thread of its own
    when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine_function())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(coroutine_function())).result()


def _call(fn: Callable[[], Any]) -> Any:
    """Call a sync or async pack function with no arguments and return its result."""
    if inspect.iscoroutinefunction(fn):
        return _run(fn)
    result = fn()
    if inspect.isawaitable(result):
        return _run(lambda: result)
    return result


def specs_from_entrypoint(entrypoint: Callable[[], Any], *, python_module: str) -> list[NodeSpec]:
    """NodeSpecs of the nodes a pack's `comfy_entrypoint()` extension lists (its `on_load()` runs first).

    Raises NodeDefinitionError (naming the pack module) for an entry point that returns no
    ComfyExtension, a node list that is not a list of V3 node classes, or a node refused."""
    api = sys.modules.get(API_MODULE)
    if not callable(entrypoint):
        raise NodeDefinitionError(f"{python_module}: comfy_entrypoint is not callable")
    extension = _call(entrypoint)
    if api is None or not isinstance(extension, api.ComfyExtension):
        raise NodeDefinitionError(f"{python_module}: comfy_entrypoint() returned {type(extension).__name__}, "
                                  "not a comfy_api ComfyExtension")
    _call(extension.on_load)
    node_list = _call(extension.get_node_list)
    if not isinstance(node_list, list):
        raise NodeDefinitionError(f"{python_module}: get_node_list() returned {type(node_list).__name__}, not a list "
                                  "of node classes")
    specs = []
    for index, cls in enumerate(node_list):
        if not is_v3_node(cls):
            raise NodeDefinitionError(f"{python_module}: get_node_list() item {index} is {cls!r}, not a comfy_api "
                                      "io.ComfyNode class")
        specs.append(spec_from_v3_class(cls, python_module=python_module))
    return specs
