"""NodeSpec: the one internal description of a node.

Built-in nodes declare a `NodeSpec` as data; classic ComfyUI classes are adapted into one by
`nodes.classic.spec_from_class`. The executor, validation and `/object_info` see nothing else.

A node's `execute` is called with keyword arguments, one per input name. Dynamic inputs arrive
grouped: a dynamic combo `mode` as `{"mode": <chosen key>, <sub input>: value, ...}` and an auto-grow
group `terminations` as `{"termination0": value, ...}` in slot order (connected slots only).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from execution.types import (  # noqa: F401 (re-exported for node authors)
    MATCH_TYPE, ExecutionBlocker, NodeOutput, normalize_result, types_compatible,
)

# Types whose values a widget can hold; every other type arrives through a link.
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
AUTOGROW = "COMFY_AUTOGROW_V3"
HIDDEN_VALUES = frozenset(
    {"PROMPT", "UNIQUE_ID", "EXTRA_PNGINFO", "DYNPROMPT", "AUTH_TOKEN_COMFY_ORG", "API_KEY_COMFY_ORG"}
)
INPUT_KINDS = ("required", "optional", "hidden")

# Widget options the editor understands; passed through to /object_info unchanged.
UI_OPTION_KEYS = frozenset(
    {
        "default", "min", "max", "step", "round", "tooltip", "multiline", "dynamicPrompts", "lazy",
        "forceInput", "defaultInput", "display", "placeholder", "image_upload", "image_folder",
        "video_upload", "audio_upload", "control_after_generate", "label_on", "label_off", "advanced",
        "rawLink", "remote", "multiselect", "options", "socketless", "widgetType", "hidden",
        "allow_batch", "upload", "directory", "extra_dict", "template", "precision", "animated_image_upload",
    }
)


class NodeDefinitionError(ValueError):
    """A node declaration that cannot be registered; the message names the node and field."""


@dataclass(frozen=True)
class InputSpec:
    """One input of a node. `options` holds the widget options exactly as /object_info shows them."""

    name: str
    type: str
    kind: str = "required"  # required | optional | hidden
    options: Mapping[str, Any] = field(default_factory=dict)
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None  # COMBO only
    # Dynamic combo: {key: (InputSpec, ...)}; auto-grow: the template InputSpec.
    dynamic_options: Mapping[str, tuple["InputSpec", ...]] | None = None
    template: "InputSpec | None" = None
    prefix: str = ""
    grow_min: int = 0
    grow_max: int = 0
    names: tuple[str, ...] = ()  # auto-grow by names (a, b, c, ...) instead of prefix + index

    def slot_names(self) -> list[str]:
        """An auto-grow group's slot names, in order."""
        if self.names:
            return list(self.names)
        return [f"{self.prefix}{i}" for i in range(self.grow_max)]

    @property
    def lazy(self) -> bool:
        return bool(self.options.get("lazy"))

    @property
    def is_widget(self) -> bool:
        return self.type in WIDGET_TYPES and not self.options.get("forceInput")

    @property
    def tooltip(self) -> str | None:
        return self.options.get("tooltip")

    def choice_list(self) -> list[Any]:
        if self.choices is None:
            return []
        return list(self.choices() if callable(self.choices) else self.choices)

    def accepts(self, source_type: str) -> bool:
        """Whether an output of `source_type` may be linked here (`*` and comma unions)."""
        return types_compatible(source_type, self.type)


@dataclass(frozen=True)
class OutputSpec:
    """One output of a node."""

    type: str
    name: str = ""
    is_list: bool = False
    tooltip: str | None = None
    match_type: str | None = None  # template id of a match-type input whose type this output takes

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.type)


@dataclass
class NodeSpec:
    """The one description of a node: identity, inputs, outputs, flags and behaviour."""

    node_id: str
    execute: Callable[..., Any]
    inputs: Sequence[InputSpec] = ()
    outputs: Sequence[OutputSpec] = ()
    display_name: str = ""
    category: str = "utils"
    description: str = ""
    output_node: bool = False
    input_is_list: bool = False
    not_idempotent: bool = False
    may_expand: bool = False
    fingerprint: Callable[..., Any] | None = None
    validate_inputs: Callable[..., Any] | None = None
    check_lazy_status: Callable[..., Any] | None = None
    python_module: str = "nodes"
    deprecated: bool = False
    experimental: bool = False
    search_aliases: Sequence[str] = ()
    has_intermediate_output: bool = False
    dev_only: bool = False  # an engine-internal node: the editor lists it only in developer mode
    # Names of inputs the validate_inputs hook takes whole (no per-value check), as ComfyUI does.
    validate_takes: frozenset[str] = frozenset()

    def __post_init__(self):
        self.inputs = tuple(self.inputs)
        self.outputs = tuple(self.outputs)
        if not self.display_name:
            self.display_name = self.node_id
        self.is_async = inspect.iscoroutinefunction(self.execute)
        self._by_name = {i.name: i for i in self.inputs}
        dynamic = any(i.type in (DYNAMIC_COMBO, AUTOGROW) for i in self.inputs)
        # Most nodes have no dynamic inputs: their flat inputs are the same for every instance.
        self._static_flat = None if dynamic else dict(self._by_name)
        self._slot_cache: dict[str, dict[str, InputSpec]] = {}
        # Whether validating an instance reads nothing but the prompt: no custom validator and no
        # choice list computed at check time (such as a folder's files). Only such prompts are
        # remembered by validation's memo.
        self.validation_is_pure = self.validate_inputs is None and not any(
            _choices_computed(i) for i in self.inputs)
        self._check()

    # ------------------------------------------------------------------ registration checks
    def _fail(self, field_name: str, message: str) -> None:
        raise NodeDefinitionError(f"node '{self.node_id}': {field_name}: {message}")

    def _check(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise NodeDefinitionError(f"node id must be a non-empty string, got {self.node_id!r}")
        if not callable(self.execute):
            self._fail("execute", "is not callable")
        seen: set[str] = set()
        for spec in self.inputs:
            if spec.name in seen:
                self._fail(f"input '{spec.name}'", "declared twice")
            seen.add(spec.name)
            self._check_input(spec, spec.name)
        for i, out in enumerate(self.outputs):
            if not isinstance(out.type, str) or not out.type:
                self._fail(f"output {i}", f"type must be a non-empty string, got {out.type!r}")

    def _check_input(self, spec: InputSpec, label: str) -> None:
        if spec.kind not in INPUT_KINDS:
            self._fail(f"input '{label}'", f"kind must be one of {INPUT_KINDS}, got {spec.kind!r}")
        if not isinstance(spec.type, str) or not spec.type:
            self._fail(f"input '{label}'", f"type must be a non-empty string, got {spec.type!r}")
        if spec.kind == "hidden":
            if spec.type not in HIDDEN_VALUES:
                self._fail(f"input '{label}'", f"unknown hidden value {spec.type!r}; known: {sorted(HIDDEN_VALUES)}")
            return
        unknown = set(spec.options) - UI_OPTION_KEYS
        if unknown:
            self._fail(f"input '{label}'", f"unknown option(s) {sorted(unknown)}")
        opts = spec.options
        if "default" in opts and spec.type in ("INT", "FLOAT"):
            default = opts["default"]
            if not isinstance(default, (int, float)) or isinstance(default, bool):
                self._fail(f"input '{label}'", f"default {default!r} is not a number")
            if "min" in opts and default < opts["min"]:
                self._fail(f"input '{label}'", f"default {default} is below its min {opts['min']}")
            if "max" in opts and default > opts["max"]:
                self._fail(f"input '{label}'", f"default {default} is above its max {opts['max']}")
            if "min" in opts and "max" in opts and opts["min"] > opts["max"]:
                self._fail(f"input '{label}'", f"min {opts['min']} is above max {opts['max']}")
        if spec.type == "COMBO" and "default" in opts and not callable(spec.choices):
            if spec.choices is not None and opts["default"] not in spec.choice_list():
                self._fail(f"input '{label}'", f"default {opts['default']!r} is not among its choices")
        if spec.type == DYNAMIC_COMBO:
            if not spec.dynamic_options:
                self._fail(f"input '{label}'", "dynamic combo has no options")
            for key, subs in spec.dynamic_options.items():
                for sub in subs:
                    self._check_input(sub, f"{label}.{sub.name}")
        if spec.type == AUTOGROW:
            if spec.template is None:
                self._fail(f"input '{label}'", "auto-grow input has no template")
            if not spec.names and spec.grow_max < max(spec.grow_min, 1):
                self._fail(f"input '{label}'", f"auto-grow max {spec.grow_max} below min {spec.grow_min}")
            self._check_input(spec.template, f"{label}.{spec.prefix}N")

    # ------------------------------------------------------------------ instance inputs
    def input(self, name: str) -> InputSpec | None:
        return self._by_name.get(name)

    def instance_inputs(self, values: Mapping[str, Any]) -> dict[str, InputSpec]:
        """The flat inputs of one node instance: top-level inputs plus the dotted dynamic ones
        its values select (a dynamic combo's chosen option, every auto-grow slot). Read-only."""
        if self._static_flat is not None:
            return self._static_flat
        flat: dict[str, InputSpec] = {}
        for spec in self.inputs:
            if spec.type == DYNAMIC_COMBO:
                flat[spec.name] = spec
                chosen = values.get(spec.name)
                if not isinstance(chosen, str) or chosen not in spec.dynamic_options:
                    chosen = next(iter(spec.dynamic_options))
                for sub in spec.dynamic_options[chosen]:
                    flat[f"{spec.name}.{sub.name}"] = sub
            elif spec.type == AUTOGROW:
                flat.update(self._grow_slots(spec))
            else:
                flat[spec.name] = spec
        return flat

    def _grow_slots(self, spec: InputSpec) -> dict[str, InputSpec]:
        """An auto-grow group's slot inputs by flat key, built once per group."""
        cached = self._slot_cache.get(spec.name)
        if cached is None:
            cached = {
                f"{spec.name}.{slot_name}": dataclasses.replace(
                    spec.template, name=slot_name, kind="required" if i < spec.grow_min else "optional")
                for i, slot_name in enumerate(spec.slot_names())
            }
            self._slot_cache[spec.name] = cached
        return cached

    def normalize_input_names(self, values: dict[str, Any]) -> dict[str, Any]:
        """Accept bare auto-grow slot names (`termination0`) for `terminations.termination0`."""
        if self._static_flat is not None:
            return values
        grow = [s for s in self.inputs if s.type == AUTOGROW]
        if not grow:
            return values
        out = {}
        for key, value in values.items():
            if key not in self._by_name and "." not in key:
                for spec in grow:
                    if key in spec.names or (
                        not spec.names and key.startswith(spec.prefix) and key[len(spec.prefix):].isdigit()
                    ):
                        key = f"{spec.name}.{key}"
                        break
            out[key] = value
        return out

    def group_arguments(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """Turn flat resolved values into execute's keyword arguments (dynamic inputs grouped)."""
        if self._static_flat is not None:
            return flat
        kwargs: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {}
        for key, value in flat.items():
            head, dot, tail = key.partition(".")
            if dot and head in self._by_name:
                groups.setdefault(head, {})[tail] = value
            elif key in self._by_name and self._by_name[key].type == DYNAMIC_COMBO:
                groups.setdefault(key, {})[key] = value
            else:
                kwargs[key] = value
        for spec in self.inputs:
            if spec.type == AUTOGROW:
                slots = groups.get(spec.name, {})
                groups[spec.name] = {k: slots[k] for k in spec.slot_names() if k in slots}
        kwargs.update(groups)
        return kwargs

    # ------------------------------------------------------------------ /object_info
    def object_info(self) -> dict[str, Any]:
        """This node as `/object_info` describes it (ComfyUI's field names and shapes)."""
        sections: dict[str, dict[str, Any]] = {"required": {}, "optional": {}, "hidden": {}}
        order: dict[str, list[str]] = {"required": [], "optional": [], "hidden": []}
        for spec in self.inputs:
            sections[spec.kind][spec.name] = _input_info(spec)
            order[spec.kind].append(spec.name)
        info_input = {k: v for k, v in sections.items() if v or k == "required"}
        return {
            "input": info_input,
            "input_order": {k: v for k, v in order.items() if v or k == "required"},
            "is_input_list": self.input_is_list,
            "output": [o.type for o in self.outputs],
            "output_is_list": [o.is_list for o in self.outputs],
            "output_name": [o.name for o in self.outputs],
            "output_tooltips": [o.tooltip for o in self.outputs],
            "output_matchtypes": (
                [o.match_type for o in self.outputs] if any(o.match_type for o in self.outputs) else None
            ),
            "name": self.node_id,
            "display_name": self.display_name,
            "description": self.description,
            "python_module": self.python_module,
            "category": self.category,
            "output_node": self.output_node,
            "deprecated": self.deprecated,
            "experimental": self.experimental,
            "dev_only": True if self.dev_only else None,
            "api_node": False,
            "price_badge": None,
            "search_aliases": list(self.search_aliases) or None,
            "essentials_category": None,
            "has_intermediate_output": self.has_intermediate_output or None,
        }


def _input_info(spec: InputSpec) -> list[Any]:
    if spec.kind == "hidden":
        return [spec.type]
    opts = dict(spec.options)
    if spec.type == "COMBO":
        return [spec.choice_list(), opts]
    if spec.type == DYNAMIC_COMBO:
        options = []
        for key, subs in spec.dynamic_options.items():
            req = {s.name: _input_info(s) for s in subs if s.kind == "required"}
            opt = {s.name: _input_info(s) for s in subs if s.kind == "optional"}
            entry: dict[str, Any] = {"required": req}
            if opt:
                entry["optional"] = opt
            options.append({"key": key, "inputs": entry})
        opts["options"] = options
        return [DYNAMIC_COMBO, opts]
    if spec.type == AUTOGROW:
        template = spec.template
        opts["template"] = {"input": {"required": {template.name: _input_info(template)}}, "min": spec.grow_min}
        if spec.names:
            opts["template"]["names"] = list(spec.names)
        else:
            opts["template"].update(prefix=spec.prefix, max=spec.grow_max)
        return [AUTOGROW, opts]
    return [spec.type, opts]


# ---------------------------------------------------------------------- declaration helpers
def _opts(tooltip: str | None, **kw: Any) -> dict[str, Any]:
    out = {k: v for k, v in kw.items() if v is not None}
    if tooltip:
        out["tooltip"] = tooltip
    return out


class Input:
    """Constructors for InputSpec, so node declarations read as data."""

    @staticmethod
    def int(name: str, default: int = 0, *, min: int = -(2**63), max: int = 2**63 - 1, step: int = 1,
            tooltip: str | None = None, optional: bool = False, lazy: bool | None = None,
            force_input: bool | None = None, control_after_generate: bool | None = None,
            display: str | None = None) -> InputSpec:
        return InputSpec(name, "INT", "optional" if optional else "required", _opts(
            tooltip, default=default, min=min, max=max, step=step, lazy=lazy, forceInput=force_input,
            control_after_generate=control_after_generate, display=display))

    @staticmethod
    def float(name: str, default: float = 0.0, *, min: float = -1e18, max: float = 1e18, step: float = 0.01,
              round: float | bool | None = None, tooltip: str | None = None, optional: bool = False,
              lazy: bool | None = None, force_input: bool | None = None) -> InputSpec:
        return InputSpec(name, "FLOAT", "optional" if optional else "required", _opts(
            tooltip, default=default, min=min, max=max, step=step, round=round, lazy=lazy, forceInput=force_input))

    @staticmethod
    def string(name: str, default: str = "", *, multiline: bool = False, tooltip: str | None = None,
               optional: bool = False, lazy: bool | None = None, force_input: bool | None = None,
               dynamic_prompts: bool | None = None, placeholder: str | None = None) -> InputSpec:
        return InputSpec(name, "STRING", "optional" if optional else "required", _opts(
            tooltip, default=default, multiline=multiline or None, lazy=lazy, forceInput=force_input,
            dynamicPrompts=dynamic_prompts, placeholder=placeholder))

    @staticmethod
    def boolean(name: str, default: bool = False, *, tooltip: str | None = None, optional: bool = False,
                lazy: bool | None = None, force_input: bool | None = None, label_on: str | None = None,
                label_off: str | None = None) -> InputSpec:
        return InputSpec(name, "BOOLEAN", "optional" if optional else "required", _opts(
            tooltip, default=default, lazy=lazy, forceInput=force_input, label_on=label_on, label_off=label_off))

    @staticmethod
    def combo(name: str, choices: Sequence[Any] | Callable[[], Sequence[Any]], default: Any = None, *,
              tooltip: str | None = None, optional: bool = False, lazy: bool | None = None,
              image_upload: bool | None = None, control_after_generate: bool | None = None,
              folder: str | Callable[[], str] | None = None,
              missing_hint: Callable[[], str] | None = None) -> InputSpec:
        opts = _opts(tooltip, default=default, lazy=lazy, image_upload=image_upload,
                     control_after_generate=control_after_generate)
        if folder:
            # Not editor options: remembered so a missing-file error can name the folder searched and
            # say how to fill it (`missing_hint` returns that advice, or "" when there is none).
            return _ComboInput(name, "COMBO", "optional" if optional else "required", opts, choices, folder=folder,
                               missing_hint=missing_hint)
        return InputSpec(name, "COMBO", "optional" if optional else "required", opts, choices)

    @staticmethod
    def link(name: str, type: str, *, tooltip: str | None = None, optional: bool = False,
             lazy: bool | None = None, raw_link: bool | None = None) -> InputSpec:
        return InputSpec(name, type, "optional" if optional else "required",
                         _opts(tooltip, lazy=lazy, rawLink=raw_link))

    @staticmethod
    def hidden(name: str, value: str) -> InputSpec:
        return InputSpec(name, value, "hidden")

    @staticmethod
    def dynamic_combo(name: str, options: Mapping[str, Sequence[InputSpec]], *, tooltip: str | None = None) -> InputSpec:
        return InputSpec(name, DYNAMIC_COMBO, "required", _opts(tooltip),
                         dynamic_options={k: tuple(v) for k, v in options.items()})

    @staticmethod
    def autogrow(name: str, template: InputSpec, *, prefix: str = "", names: Sequence[str] = (), min: int = 0,
                 max: int = 50, tooltip: str | None = None) -> InputSpec:
        if names:
            max = len(names)
        return InputSpec(name, AUTOGROW, "optional" if min == 0 else "required", _opts(tooltip),
                         template=template, prefix=prefix, grow_min=min, grow_max=max, names=tuple(names))

    @staticmethod
    def match_type(name: str, template_id: str = "T", *, allowed: str = "*", tooltip: str | None = None,
                   optional: bool = False, lazy: bool | None = None) -> InputSpec:
        opts = _opts(tooltip, lazy=lazy)
        opts["template"] = {"template_id": template_id, "allowed_types": allowed}
        return InputSpec(name, MATCH_TYPE, "optional" if optional else "required", opts)


def _choices_computed(spec: InputSpec) -> bool:
    """Whether `spec` or an input nested in it lists its choices through a function."""
    if callable(spec.choices):
        return True
    nested = [sub for subs in (spec.dynamic_options or {}).values() for sub in subs]
    if spec.template is not None:
        nested.append(spec.template)
    return any(_choices_computed(sub) for sub in nested)


@dataclass(frozen=True)
class _ComboInput(InputSpec):
    folder: Any = ""  # a folder name, or a function returning the folder searched
    missing_hint: Any = None  # a function returning how to get the missing file, or "" when unknown


def combo_folder(spec: InputSpec) -> str | None:
    """The folder a file-choice combo lists, for error messages."""
    folder = getattr(spec, "folder", None)
    return (folder() if callable(folder) else folder) or None


def Output(type: str, name: str = "", *, is_list: bool = False, tooltip: str | None = None,
           match_type: str | None = None) -> OutputSpec:
    """Declare an output."""
    return OutputSpec(type, name, is_list, tooltip, match_type)


def is_nan_fingerprint(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def iter_widget_inputs(spec: NodeSpec) -> Iterable[InputSpec]:
    """Inputs that hold a widget value in the editor, in widget order (used by UI conversion)."""
    for kind in ("required", "optional"):  # the editor orders widgets required first, then optional
        for inp in spec.inputs:
            if inp.kind == kind and (inp.is_widget or inp.type == DYNAMIC_COMBO):
                yield inp
