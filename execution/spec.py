"""The node contract: what execution/ knows of a node, and all it knows.

A `NodeSpec` describes one node: identity, inputs (`InputSpec`), outputs (`OutputSpec`), flags and the
functions the executor calls. Built-in packs build specs with the helpers in `nodes/spec.py`; classic
ComfyUI classes are adapted into one by `nodes/classic.py`. Validation, UI conversion, the scheduler
and the cache read specs only through the fields and methods defined here, and reach them through a
`Registry`.

A node's `execute` is called with keyword arguments, one per input name. Dynamic inputs arrive
grouped: a dynamic combo `mode` as `{"mode": <chosen key>, <sub input>: value, ...}` and an auto-grow
group `terminations` as `{"termination0": value, ...}` in slot order (connected slots only). An
optional input the prompt leaves out is not passed, so `execute` gives it a default.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from execution.types import MATCH_TYPE, types_compatible

if TYPE_CHECKING:
    from execution.graph import Prompt

__all__ = [
    "AUTOGROW", "DYNAMIC_COMBO", "HIDDEN_VALUES", "INPUT_KINDS", "MATCH_TYPE", "UI_OPTION_KEYS", "WIDGET_TYPES",
    "GraphCheck", "InputSpec", "NodeDefinitionError", "NodeSpec", "OutputSpec", "Registry", "widget_inputs",
]

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
        "display_name", "chip", "file_upload",
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
    # The folder a file choice lists (or a function naming it), so a missing-file error can say
    # where it looked. Not an editor option: /object_info does not show it.
    folder: str | Callable[[], str] | None = None
    # For a file choice: a function returning how to get a missing file ("" when there is no advice).
    missing_hint: Callable[[], str] | None = None
    # A hidden input /object_info writes as a bare string ("UNIQUE_ID"), as ComfyUI does for classic
    # nodes, which declare it so; otherwise it is written [TYPE], as ComfyUI's newer node schema does.
    hidden_as_string: bool = False

    def slot_names(self) -> list[str]:
        """An auto-grow group's slot names, in order."""
        if self.names:
            return list(self.names)
        return [f"{self.prefix}{i}" for i in range(self.grow_max)]

    @property
    def lazy(self) -> bool:
        """Whether the node may run without this input evaluated (it asks for it when needed)."""
        return bool(self.options.get("lazy"))

    @property
    def executor_supplied(self) -> bool:
        """Whether the executor supplies this input's value (a hidden value such as UNIQUE_ID); a hidden
        input of any other type is an ordinary input the editor does not show, valued by the prompt."""
        return self.kind == "hidden" and self.type in HIDDEN_VALUES

    @property
    def is_widget(self) -> bool:
        """Whether the editor shows this input as a widget holding a value (a dynamic combo is one)."""
        if self.kind == "hidden":
            return False
        return self.type == DYNAMIC_COMBO or (self.type in WIDGET_TYPES and not self.options.get("forceInput"))

    @property
    def tooltip(self) -> str | None:
        """The input's tooltip, if it declares one."""
        return self.options.get("tooltip")

    def choice_list(self) -> list[Any]:
        """A combo's choices now (a computed list is computed again on every call)."""
        if self.choices is None:
            return []
        return list(self.choices() if callable(self.choices) else self.choices)

    def searched_folder(self) -> str | None:
        """The folder a file choice lists, if it names one."""
        folder = self.folder() if callable(self.folder) else self.folder
        return folder or None

    def missing_file_hint(self) -> str:
        """Advice on getting a file this choice lacks, or ""."""
        return self.missing_hint() if self.missing_hint is not None else ""

    def accepts(self, source_type: str) -> bool:
        """Whether an output of `source_type` may be linked here (`*` and comma unions)."""
        return types_compatible(source_type, self.type)


def widget_inputs(inputs: Iterable[InputSpec]) -> list[InputSpec]:
    """The inputs that keep a value in a saved workflow, in the editor's widget order: required
    ones, then optional ones, each in declaration order. Widgets and dynamic combos hold one value;
    an auto-grow group is listed when its slots hold widgets."""
    inputs = list(inputs)
    holding = [i for i in inputs if i.is_widget or (
        i.type == AUTOGROW and i.template is not None and i.template.is_widget)]
    return [i for i in holding if i.kind == "required"] + [i for i in holding if i.kind == "optional"]


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
    essentials_category: str | None = None  # where the editor's Essentials tab lists the node, if it does
    # Names of inputs the validate_inputs hook takes whole (no per-value check), as ComfyUI does.
    validate_takes: frozenset[str] = frozenset()
    # The validator names `input_types`: it gets {input: linked output's type} and checks link types
    # itself, so validation does not (ComfyUI's rule).
    validate_takes_types: bool = False
    # Declared by a pack written for ComfyUI: registration accepts what ComfyUI accepts (option keys it
    # does not know, defaults outside their bounds or choices, hidden inputs that are ordinary inputs the
    # editor does not show). Weft's own nodes are checked strictly.
    lenient: bool = False
    # The node is given every input of its prompt entry, constants it does not declare included (linked
    # ones always are). A classic pack node asks for this with a `hidden` section that claims every name
    # (ComfyUI then passes them all): a video pack's output node reads the options its format adds so.
    takes_every_input: bool = False

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
        self._check_execute_parameters()

    def _check_input(self, spec: InputSpec, label: str) -> None:
        if spec.kind not in INPUT_KINDS:
            self._fail(f"input '{label}'", f"kind must be one of {INPUT_KINDS}, got {spec.kind!r}")
        if not isinstance(spec.type, str) or not spec.type:
            self._fail(f"input '{label}'", f"type must be a non-empty string, got {spec.type!r}")
        if spec.kind == "hidden":
            if spec.type not in HIDDEN_VALUES and not self.lenient:
                self._fail(f"input '{label}'", f"unknown hidden value {spec.type!r}; known: {sorted(HIDDEN_VALUES)}")
            return
        if self.lenient:
            return self._check_dynamic(spec, label)
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
            default, choices = opts["default"], spec.choice_list()
            # A multiselect combo's default is a list of choices.
            picked = default if opts.get("multiselect") and isinstance(default, list) else [default]
            if spec.choices is not None and any(item not in choices for item in picked):
                self._fail(f"input '{label}'", f"default {default!r} is not among its choices")
        self._check_dynamic(spec, label)

    def _check_dynamic(self, spec: InputSpec, label: str) -> None:
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

    def _check_execute_parameters(self) -> None:
        """Tie `execute`'s parameters to the declared inputs: every input has a parameter (unless
        execute takes **kwargs), every parameter without a default is a declared input, and a
        default written on both sides is the same value, so it is stated once."""
        try:
            parameters = inspect.signature(self.execute).parameters
        except (TypeError, ValueError):  # a builtin or C callable without a signature: nothing to tie
            return
        takes_any = False
        for param in parameters.values():
            if param.kind is param.VAR_KEYWORD:
                takes_any = True
                continue
            if param.kind is param.VAR_POSITIONAL:
                continue
            declared = self._by_name.get(param.name)
            if param.kind is param.POSITIONAL_ONLY and (declared is not None or param.default is param.empty):
                self._fail("execute", f"parameter '{param.name}' is positional-only; inputs are passed by name")
            if declared is None:
                if param.default is param.empty:
                    self._fail("execute", f"parameter '{param.name}' has no default and no input declares it")
                continue
            if param.default is param.empty:
                if declared.kind == "optional" and declared.type not in (AUTOGROW, DYNAMIC_COMBO):
                    self._fail(f"input '{param.name}'", "is optional, so execute's parameter needs a default "
                               "for a prompt that leaves it out")
                continue
            if "default" in declared.options and not _same_value(declared.options["default"], param.default):
                self._fail(f"input '{param.name}'", f"declared default {declared.options['default']!r} differs "
                           f"from execute's default {param.default!r}; state the default once, in the "
                           "declaration")
        if not takes_any:
            for spec in self.inputs:
                if spec.name not in parameters:
                    self._fail(f"input '{spec.name}'", "execute has no parameter of this name (and no **kwargs)")

    # ------------------------------------------------------------------ instance inputs
    def input(self, name: str) -> InputSpec | None:
        """The top-level input named `name`, if declared."""
        return self._by_name.get(name)

    def widget_inputs(self) -> list[InputSpec]:
        """The node's top-level inputs that keep a value in a saved workflow, in the editor's order."""
        return widget_inputs(self.inputs)

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


def _same_value(declared: Any, stated: Any) -> bool:
    """Whether two defaults are one value (1 and 1.0 are; True and 1 are not)."""
    return isinstance(declared, bool) == isinstance(stated, bool) and declared == stated


def _choices_computed(spec: InputSpec) -> bool:
    """Whether `spec` or an input nested in it lists its choices through a function."""
    if callable(spec.choices):
        return True
    nested = [sub for subs in (spec.dynamic_options or {}).values() for sub in subs]
    if spec.template is not None:
        nested.append(spec.template)
    return any(_choices_computed(sub) for sub in nested)


# A check over a whole prompt (such as loop pairing), run by validation after the per-node checks:
# fn(prompt, registry, options) -> {node_id: [node_error, ...]} (or None when all is well).
GraphCheck = Callable[["Prompt", "Registry", Mapping[str, Any]], "Mapping[str, list[dict]] | None"]


class Registry(Protocol):
    """What execution/ needs of a node registry: specs by node id, and the prompt-wide checks."""

    generation: int  # changes with every registration, so memos keyed on it notice
    graph_checks: Sequence[GraphCheck]

    def get(self, node_id: str) -> NodeSpec | None:
        """The spec registered under `node_id`, or None."""

    def __iter__(self) -> Iterator[NodeSpec]:
        """Every registered spec, in registration order."""

    def missing_cause(self, node_id: str) -> dict[str, str] | None:
        """`{source, reason}` naming the failed plugin that declares the unregistered `node_id`, or None."""


def missing_cause_text(registry: Registry, class_type: str) -> str:
    """'; custom node pack ... failed to load: ...' when a failed plugin declares `class_type`, else ''."""
    cause = registry.missing_cause(class_type)
    if cause is None:
        return ""
    return f"; it comes from the custom node pack '{cause['source']}', which failed to load: {cause['reason']}"
