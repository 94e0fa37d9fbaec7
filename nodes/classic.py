"""Adapter from classic ComfyUI node classes (INPUT_TYPES, RETURN_TYPES, FUNCTION, ...) to NodeSpec."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from execution.spec import (
    AUTOGROW, DYNAMIC_COMBO, InputSpec, NodeDefinitionError, NodeSpec, OutputSpec,
)

def _fail(node_id: str, field: str, message: str) -> None:
    raise NodeDefinitionError(f"node '{node_id}': {field}: {message}")


def input_from_declaration(node_id: str, name: str, kind: str, declaration: Any) -> InputSpec:
    """One input from its classic declaration `(TYPE or [choices], {options})` (hidden: the value name)."""
    if kind == "hidden":
        value = declaration[0] if isinstance(declaration, (list, tuple)) and declaration else declaration
        options = declaration[1] if isinstance(declaration, (list, tuple)) and len(declaration) > 1 else None
        if not isinstance(value, str) or not value:
            _fail(node_id, f"input '{name}'", f"expected a hidden value or (TYPE, options), got {declaration!r}")
        # A type other than the hidden values is an ordinary input the editor does not show (ComfyUI
        # passes whatever the prompt gives it). /object_info shows it as declared: classic nodes write a
        # bare string, a few a tuple.
        return InputSpec(name, value, "hidden", dict(options) if isinstance(options, dict) else {},
                         hidden_as_string=isinstance(declaration, str))
    if not isinstance(declaration, (list, tuple)) or not declaration:
        _fail(node_id, f"input '{name}'", f"expected (TYPE, options), got {declaration!r}")
    type_ = declaration[0]
    options = dict(declaration[1]) if len(declaration) > 1 and isinstance(declaration[1], dict) else {}
    if isinstance(type_, (list, tuple)):
        return InputSpec(name, "COMBO", kind, options, tuple(type_))
    if type_ == "COMBO":
        choices = tuple(options.pop("options", ()))
        return InputSpec(name, "COMBO", kind, options, choices)
    if not isinstance(type_, str) or not type_:
        _fail(node_id, f"input '{name}'", f"type must be a string or a list of choices, got {type_!r}")
    if type_ in (DYNAMIC_COMBO, AUTOGROW):
        _fail(node_id, f"input '{name}'", f"{type_} inputs need the node schema, not the classic interface")
    return InputSpec(name, type_, kind, options)


def spec_from_class(node_id: str, cls: type, *, python_module: str = "custom_nodes",
                    display_name: str | None = None) -> NodeSpec:
    """Build a NodeSpec from a classic node class; refuses malformed classes naming node and field."""
    if not inspect.isclass(cls):
        _fail(node_id, "class", f"expected a class, got {type(cls).__name__}")
    try:
        declared = cls.INPUT_TYPES()
    except Exception as exc:
        raise NodeDefinitionError(f"node '{node_id}': INPUT_TYPES raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(declared, dict):
        _fail(node_id, "INPUT_TYPES", f"must return a dict, got {type(declared).__name__}")
    unknown_kinds = set(declared) - {"required", "optional", "hidden"}
    if unknown_kinds:
        _fail(node_id, "INPUT_TYPES", f"unknown section(s) {sorted(unknown_kinds)}; expected required, optional, hidden")
    inputs = []
    seen: set[str] = set()
    for kind in ("required", "optional", "hidden"):
        section = declared.get(kind) or {}
        if not isinstance(section, dict):
            _fail(node_id, f"INPUT_TYPES[{kind!r}]", "must be a dict")
        for name, declaration in section.items():
            if name in seen:
                continue  # declared in an earlier section too: ComfyUI reads the first one
            seen.add(name)
            inputs.append(input_from_declaration(node_id, name, kind, declaration))

    # A `hidden` section that says it holds any name at all (a dict subclass whose `in` is always true)
    # is how a classic node asks for every input of its prompt entry: ComfyUI looks each one up there.
    hidden_section = declared.get("hidden")
    takes_every_input = isinstance(hidden_section, dict) and _claims_every_name(hidden_section)

    # ComfyUI calls INPUT_TYPES again for every /object_info and every validation, so a combo listing
    # files sees files added since start-up: the choices are read from a fresh call each time.
    inputs = [dataclasses.replace(i, choices=_live_choices(cls, i.kind, i.name, i.choices))
              if i.type == "COMBO" and i.kind != "hidden" and not callable(i.choices) else i for i in inputs]

    return_types = tuple(getattr(cls, "RETURN_TYPES", ()))
    names = tuple(getattr(cls, "RETURN_NAMES", None) or return_types)
    tooltips = tuple(getattr(cls, "OUTPUT_TOOLTIPS", None) or ())
    is_list = getattr(cls, "OUTPUT_IS_LIST", None) or ()
    if len(names) != len(return_types):
        _fail(node_id, "RETURN_NAMES", f"{len(names)} names for {len(return_types)} RETURN_TYPES")
    outputs = []
    for i, type_ in enumerate(return_types):
        if isinstance(type_, (list, tuple)):
            type_ = "COMBO"
        outputs.append(OutputSpec(type_, names[i], bool(is_list[i]) if i < len(is_list) else False,
                                  tooltips[i] if i < len(tooltips) else None))

    function_name = getattr(cls, "FUNCTION", None)
    if not isinstance(function_name, str) or not hasattr(cls, function_name):
        _fail(node_id, "FUNCTION", f"names no method of the class: {function_name!r}")

    instance_holder: list[Any] = []

    def instance() -> Any:
        if not instance_holder:
            instance_holder.append(cls())
        return instance_holder[0]

    method = getattr(cls, function_name)
    bound_method: list[Any] = []  # the instance's method, looked up once

    def target():
        if not bound_method:
            bound_method.append(getattr(instance(), function_name))
        return bound_method[0]

    if inspect.iscoroutinefunction(method):
        async def execute(**kwargs):
            return await target()(**kwargs)
    else:
        def execute(**kwargs):
            return (bound_method[0] if bound_method else target())(**kwargs)

    def bound(attribute: str):
        fn = getattr(cls, attribute, None)
        if fn is None:
            return None
        # ComfyUI calls the hooks on the class: a classmethod gets the class, a function assigned to the
        # class (a decorator's `setattr(cls, "VALIDATE_INPUTS", check)`) only the arguments. A plain
        # method whose first parameter is `self` is the one form ComfyUI cannot call; Weft gives it
        # the node's instance.
        on_instance = inspect.isfunction(fn) and next(iter(_parameters(fn)), None) == "self"

        @functools.wraps(fn)
        def call(**kwargs):
            target = getattr(instance(), attribute) if on_instance else fn
            wanted = _accepted_kwargs(target, kwargs)
            return target(**wanted)

        return call

    validate = bound("VALIDATE_INPUTS")
    validate_takes, validate_takes_types = frozenset(), False
    if validate is not None:
        params = inspect.signature(getattr(cls, "VALIDATE_INPUTS")).parameters
        validate_takes = frozenset(p for p in params if p not in ("self", "cls", "input_types"))
        validate_takes_types = "input_types" in params
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            validate_takes = frozenset(i.name for i in inputs)  # **kwargs: it takes every input whole

    return NodeSpec(
        node_id=node_id,
        display_name=display_name or node_id,
        category=getattr(cls, "CATEGORY", "custom") or "custom",
        description=getattr(cls, "DESCRIPTION", "") or "",
        inputs=inputs,
        outputs=outputs,
        execute=execute,
        output_node=bool(getattr(cls, "OUTPUT_NODE", False)),
        input_is_list=bool(getattr(cls, "INPUT_IS_LIST", False)),
        not_idempotent=bool(getattr(cls, "NOT_IDEMPOTENT", False)),
        fingerprint=bound("IS_CHANGED"),
        lenient=True,
        validate_inputs=validate,
        validate_takes=validate_takes,
        validate_takes_types=validate_takes_types,
        check_lazy_status=bound("check_lazy_status"),
        python_module=python_module,
        deprecated=bool(getattr(cls, "DEPRECATED", False)),
        experimental=bool(getattr(cls, "EXPERIMENTAL", False)),
        search_aliases=tuple(getattr(cls, "SEARCH_ALIASES", ()) or ()),
        takes_every_input=takes_every_input,
    )


def _claims_every_name(section: dict) -> bool:
    """Whether a declaration section answers `in` with yes for a name nobody declares."""
    try:
        return "\x00weft: no input is named this" in section
    except Exception:
        return False


def _live_choices(cls: type, kind: str, name: str, declared: Any):
    """A function returning `name`'s combo choices from a fresh INPUT_TYPES() call (the declared ones
    when the call fails or no longer lists the input as a combo)."""
    fallback = tuple(declared or ())

    def choices() -> tuple:
        try:
            declaration = (cls.INPUT_TYPES().get(kind) or {}).get(name)
        except Exception:
            return fallback
        if isinstance(declaration, (list, tuple)) and declaration:
            first = declaration[0]
            if isinstance(first, (list, tuple)):
                return tuple(first)
            if first == "COMBO" and len(declaration) > 1 and isinstance(declaration[1], dict):
                return tuple(declaration[1].get("options", fallback))
        return fallback

    return choices


def _parameters(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _accepted_kwargs(fn, kwargs: dict) -> dict:
    """Pass only the keyword arguments `fn` accepts (classic hooks often declare a subset)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def specs_from_mappings(class_mappings: dict, display_names: dict | None = None, *,
                        python_module: str, refused: list[tuple[str, str]] | None = None) -> list[NodeSpec]:
    """NodeSpecs for a plugin's NODE_CLASS_MAPPINGS (and NODE_DISPLAY_NAME_MAPPINGS); V3 classes included.

    With `refused`, a node whose declaration cannot be registered is left out and its reason appended
    there as (node id, reason) (the rest of the pack still loads); without it, the first such node raises."""
    if not isinstance(class_mappings, dict):
        raise NodeDefinitionError(f"{python_module}: NODE_CLASS_MAPPINGS must be a dict")
    from nodes.v3 import is_v3_node, spec_from_v3_class  # nodes.v3 reads this module's input helper

    display_names = display_names or {}
    specs = []
    for node_id, cls in class_mappings.items():
        node_id, display_name = str(node_id), display_names.get(node_id)
        try:
            if is_v3_node(cls):  # ComfyUI accepts a V3 class in the mappings too; the key is its id
                specs.append(spec_from_v3_class(cls, node_id=node_id, python_module=python_module,
                                                display_name=display_name))
            else:
                specs.append(spec_from_class(node_id, cls, python_module=python_module, display_name=display_name))
        except NodeDefinitionError as exc:
            if refused is None:
                raise
            refused.append((node_id, str(exc)))
    return specs
