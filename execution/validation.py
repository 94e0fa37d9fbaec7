"""Prompt validation: one path for the server, the headless runner and the editor's pre-check.

First a JSON Schema checks the prompt's structure, then every node that an output needs is checked
against its NodeSpec: class known, required inputs present, links well formed and typed, constants
coerced and within bounds, choices valid, custom validators, and no cycles. Errors come back in
ComfyUI's `{error, node_errors}` shape, each message naming the node id, title, class and input
(except a custom validator's failure, which keeps ComfyUI's fixed message; its details name the input).
"""
from __future__ import annotations

import inspect
import marshal
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import jsonschema

from execution.errors import PromptError, node_error
from execution.graph import CycleError, Link, MalformedLink, Prompt, PromptNode, collector_paused
from execution.rewrite import rewrite_prompt
from execution.spec import InputSpec, NodeSpec, Registry, missing_cause_text
from execution.types import types_compatible

PROMPT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "API-format prompt",
    "type": "object",
    "minProperties": 1,
    "additionalProperties": {
        "type": "object",
        "required": ["class_type"],
        "properties": {
            "class_type": {"type": "string", "minLength": 1},
            "inputs": {"type": "object"},
            "_meta": {"type": "object"},
            "is_changed": {},
        },
    },
}
_SCHEMA_VALIDATOR = jsonschema.Draft202012Validator(PROMPT_SCHEMA)

INT_MAX = 2**63 - 1
# The node's own check (its validate_inputs) refused; the error's type says so to clients, the details say why.
NODE_CHECK_REFUSED = "The node's own input check refused this prompt"


@dataclass
class ValidatedPrompt:
    """A prompt that passed validation: the graph, the outputs to run, and errors of dropped outputs."""

    prompt: Prompt
    outputs: list[str]
    node_errors: dict[str, dict] = field(default_factory=dict)
    order: list[str] | None = None  # the outputs' ancestors, sources first
    # Structural cache signatures by position in `order` (None for a node whose signature is not
    # the prompt's alone: a fingerprint or a salt on it or upstream). Filled by the first run, reused
    # by every later run of this validated prompt, and shared by the copies ValidationMemo hands out.
    signatures: list[str | None] = field(default_factory=list)
    # Every node in it validates from the prompt alone (`NodeSpec.validation_is_pure`), so validating
    # the same prompt again would give the same result: ValidationMemo may keep it.
    reusable: bool = False


class ValidationMemo:
    """Validated prompts by content, so an unchanged prompt submitted again is not checked again.

    A prompt is remembered only when every node in it validates from the prompt alone
    (`NodeSpec.validation_is_pure`: no custom validator, no choice list read at check time such as a
    folder's files), so a hit gives exactly what validating again would. Graph checks
    (`registry.graph_checks`) must be pure functions of prompt, registry and options. The key is
    the prompt's marshal bytes in format 2, which has no back-references: equal prompts with their
    keys in the same order give equal bytes, and equal bytes come only from equal prompts (1, 1.0
    and True differ). Registrations change the registry's generation, so they invalidate the memo.
    A caller must not mutate a prompt's values in place after validating it.
    """

    def __init__(self, max_entries: int = 8) -> None:
        self.max_entries = max_entries
        self._entries: "OrderedDict[tuple, ValidatedPrompt]" = OrderedDict()
        self._lock = threading.Lock()  # the server validates on request threads while jobs run
        self.hits = 0

    @staticmethod
    def key(data: Any, registry: Registry, partial_targets: list[str] | None,
            options: dict | None) -> tuple | None:
        """The memo key of one validation call, or None when `data` is not plain JSON-like data."""
        try:
            blob = marshal.dumps(data, 2)
        except ValueError:
            return None
        try:
            settings = marshal.dumps(sorted((options or {}).items()), 2)
        except (ValueError, TypeError):
            return None
        return (blob, settings, None if partial_targets is None else tuple(str(t) for t in partial_targets), registry,
                registry.generation, tuple(registry.graph_checks))

    def get(self, key: tuple, data: dict) -> ValidatedPrompt | None:
        """A copy of the remembered result for `key`, its prompt's raw JSON being `data`."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return ValidatedPrompt(found.prompt.fork(raw=data), list(found.outputs), found.node_errors,
                               found.order, found.signatures, found.reusable)

    def put(self, key: tuple, validated: ValidatedPrompt) -> None:
        """Remember `validated` if every node in it validates from the prompt alone."""
        if not validated.reusable:
            return
        with self._lock:
            self._entries[key] = validated
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def check_structure(data: Any) -> None:
    """Raise PromptError(invalid_prompt) unless `data` is an API-format prompt object."""
    if not isinstance(data, dict):
        raise PromptError("invalid_prompt", "Invalid prompt: expected a JSON object of nodes",
                          f"got {type(data).__name__}")
    # The fast check mirrors the schema; the schema validator runs to describe a failure precisely.
    for node_id, body in data.items():
        if not (isinstance(body, dict) and isinstance(body.get("class_type"), str) and body["class_type"]
                and isinstance(body.get("inputs", {}), dict)
                and isinstance(body.get("_meta", {}), dict)):
            break
    else:
        if data:
            return
    error = jsonschema.exceptions.best_match(_SCHEMA_VALIDATOR.iter_errors(data))
    where = "/".join(str(p) for p in error.absolute_path) if error is not None else ""
    detail = f"at '{where}': {error.message}" if error is not None else "prompt is empty"
    node_id = str(error.absolute_path[0]) if error is not None and error.absolute_path else None
    message = "Invalid prompt: " + (
        f"node {node_id} is malformed" if node_id else "the prompt is not a JSON object of nodes"
    )
    raise PromptError("invalid_prompt", message, detail, extra_info={"node_id": node_id} if node_id else {})


def _config_json(inp: InputSpec) -> list[Any]:
    """An input's declaration as an error's `input_config` shows it: `[TYPE, options]`."""
    return [inp.type, dict(inp.options)]


class _NodeChecker:
    """Checks one prompt's nodes, each once, collecting their errors."""

    def __init__(self, prompt: Prompt, registry: Registry):
        self.prompt = prompt
        self.registry = registry
        self.errors: dict[str, list[dict]] = {}
        self.unusable: set[str] = set()

    def fail(self, node: PromptNode, error: dict) -> None:
        self.errors.setdefault(node.id, []).append(error)

    def visit(self, node: PromptNode) -> None:
        """Check `node`, its sources checked before it; a node is unusable when it or one of its
        sources is invalid. (Unusable ones are kept as the exceptions: the usual prompt has none,
        so a large one costs no table lookups per node.)"""
        unusable = self.unusable
        if not self.check_node(node) or (unusable and any(link.node in unusable for link in node.links())):
            unusable.add(node.id)

    def check_node(self, node: PromptNode) -> bool:
        spec = self.registry.get(node.class_type)
        if spec is None:
            cause = missing_cause_text(self.registry, node.class_type)
            self.fail(node, node_error(
                "missing_node_type", f"Node {node.label}: node type '{node.class_type}' is not registered{cause}",
                f"Weft has no node type '{node.class_type}': "
                + ("install the node pack that provides it." if not cause else cause.removeprefix("; ") + ".")))
            return False
        normalized = spec.normalize_input_names(node.inputs)
        if normalized is not node.inputs:
            node.inputs = normalized
            node.inputs_changed()
        flat = spec.instance_inputs(node.inputs)
        takes = spec.validate_takes if spec.validate_inputs is not None else ()
        before = len(self.errors.get(node.id, ()))
        for name, inp in flat.items():
            if inp.executor_supplied:
                continue
            value = node.inputs.get(name)
            if name not in node.inputs or value is None:
                if inp.kind == "required":
                    self.fail(node, node_error(
                        "required_input_missing",
                        f"Node {node.label}: required input '{name}' is missing",
                        f"{name}: expected {inp.type}, received nothing",
                        input_name=name, input_config=_config_json(inp)))
                continue
            if type(value) is Link:
                self.check_link(node, name, inp, value, check_type=not spec.validate_takes_types)
            elif type(value) is MalformedLink:
                self.fail(node, node_error("bad_linked_input", f"Node {node.label}: input '{name}' has a malformed link",
                                           f"{name}: received {value.raw!r}; a link is [node_id, output_index]",
                                           input_name=name, input_config=_config_json(inp), received_value=value.raw))
            elif name in takes:
                continue  # the node's own validator takes this input whole (ComfyUI's rule)
            else:
                coerced = self.check_constant(node, name, inp, value)
                if coerced is not _INVALID:
                    node.inputs[name] = coerced
        if len(self.errors.get(node.id, ())) == before and spec.validate_inputs is not None:
            self.custom_validation(node, spec)
        return len(self.errors.get(node.id, ())) == 0

    def check_link(self, node: PromptNode, name: str, inp: InputSpec, link: Link, *, check_type: bool = True) -> None:
        source = self.prompt.nodes.get(link.node)
        if source is None:
            self.fail(node, node_error(
                "bad_linked_input", f"Node {node.label}: input '{name}' links to node {link.node}, which does not exist",
                f"{name}: received link [{link.node}, {link.output}]", input_name=name,
                input_config=_config_json(inp), received_value=link.to_json()))
            return
        source_spec = self.registry.get(source.class_type)
        if source_spec is None:
            return  # the source reports missing_node_type itself
        if link.output < 0 or link.output >= len(source_spec.outputs):
            self.fail(node, node_error(
                "bad_linked_input",
                f"Node {node.label}: input '{name}' links to output {link.output} of node {source.label}, "
                f"which has {len(source_spec.outputs)} output(s)",
                f"{name}: output index {link.output} out of range", input_name=name,
                input_config=_config_json(inp), received_value=link.to_json()))
            return
        source_type = source_spec.outputs[link.output].type
        if check_type and not types_compatible(source_type, inp.type):
            self.fail(node, node_error(
                "return_type_mismatch",
                f"Node {node.label}: input '{name}' expects {inp.type} but node {source.label} output "
                f"{link.output} gives {source_type}",
                f"{name}: expected {inp.type}, received {source_type}", input_name=name,
                input_config=_config_json(inp), received_value=link.to_json()))

    def check_constant(self, node: PromptNode, name: str, inp: InputSpec, value: Any) -> Any:
        kind = inp.type
        opts = inp.options
        coerce = _COERCERS.get(kind)
        if coerce is not None:
            try:
                value = coerce(value)
            except (ValueError, TypeError, OverflowError):
                self.fail(node, node_error(
                    "invalid_input_type",
                    f"Node {node.label}: input '{name}' expects {kind}, received {value!r}",
                    f"{name}: could not convert {value!r} to {kind}", input_name=name,
                    input_config=_config_json(inp), received_value=value))
                return _INVALID
        if kind in ("INT", "FLOAT"):
            low, high = opts.get("min"), opts.get("max")
            if low is not None and value < low:
                self.fail(node, node_error(
                    "value_smaller_than_min",
                    f"Node {node.label}: input '{name}' is {value}, smaller than its minimum {low}",
                    f"{name}: {value} < {low}", input_name=name, input_config=_config_json(inp), received_value=value))
                return _INVALID
            if high is not None and value > high:
                self.fail(node, node_error(
                    "value_bigger_than_max",
                    f"Node {node.label}: input '{name}' is {value}, bigger than its maximum {high}",
                    f"{name}: {value} > {high}", input_name=name, input_config=_config_json(inp), received_value=value))
                return _INVALID
        if kind == "COMBO" or inp.dynamic_options:
            choices = list(inp.dynamic_options) if inp.dynamic_options else inp.choice_list()
            if isinstance(value, list) and not inp.dynamic_options and opts.get("multiselect"):
                bad = [v for v in value if v not in choices]
            else:
                bad = [] if value in choices else [value]
            if bad:
                folder = inp.searched_folder()  # a file list names the folder it actually searched
                where = f" (searched folder: {folder})" if folder else ""
                hint = inp.missing_file_hint()
                if hint:
                    where += f"; {hint}"
                shown = choices if len(choices) <= 20 else choices[:20] + ["..."]
                self.fail(node, node_error(
                    "value_not_in_list",
                    f"Node {node.label}: input '{name}' value {value!r} is not among the choices{where}",
                    f"{name}: {value!r} not in {shown}", input_name=name, input_config=_config_json(inp),
                    received_value=value))
                return _INVALID
        return value

    def custom_validation(self, node: PromptNode, spec: NodeSpec) -> None:
        takes = spec.validate_takes
        kwargs = {}
        linked_types = {}
        for name, value in node.inputs.items():
            if type(value) is Link:
                if name in takes:
                    kwargs[name] = None
                source = self.prompt.nodes.get(value.node)
                source_spec = self.registry.get(source.class_type) if source is not None else None
                if source_spec is not None and 0 <= value.output < len(source_spec.outputs):
                    linked_types[name] = source_spec.outputs[value.output].type
                continue
            kwargs[name] = value
        if spec.validate_takes_types:
            kwargs["input_types"] = linked_types
        try:
            result = spec.validate_inputs(**spec.group_arguments(kwargs))
        except Exception as exc:  # a validator that raises is reported, never crashes validation
            self.fail(node, node_error(
                "exception_during_validation", f"Node {node.label}: validation raised {type(exc).__name__}: {exc}",
                f"{type(exc).__name__}: {exc}"))
            return
        if result is True or result is None:
            return
        # ComfyUI's shape, which clients match on: a fixed message, and one error per input the
        # validator was given, its details "<input> - <the validator's message>".
        names = self.validated_names(spec, kwargs)
        problems = result if isinstance(result, (list, tuple)) else [result]
        for problem in problems:
            if isinstance(problem, dict):  # a problem that names its own input
                name = problem.get("input_name")
                text = str(problem.get("details", problem.get("message")))
                self.custom_failure(node, [name] if name else names, text)
            else:
                self.custom_failure(node, names, "" if problem is False else str(problem))

    @staticmethod
    def validated_names(spec: NodeSpec, given: dict[str, Any]) -> list[str]:
        """The inputs a validator checks: those it names (in its signature or `validate_takes`),
        else every input it was given (it takes them all through **kwargs)."""
        try:
            params = inspect.signature(spec.validate_inputs).parameters.values()
        except (TypeError, ValueError):
            params = ()
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        named |= spec.validate_takes
        return [name for name in given if name in named] or list(given)

    def custom_failure(self, node: PromptNode, names: list[str], text: str) -> None:
        if not names:
            self.fail(node, node_error("custom_validation_failed", NODE_CHECK_REFUSED, text))
        for name in names:
            self.fail(node, node_error("custom_validation_failed", NODE_CHECK_REFUSED,
                                       f"{name} - {text}" if text else name,
                                       input_name=name, received_value=node.inputs.get(name)))


_INVALID = object()


# ---------------------------------------------------------------------- constant coercion
# How a constant of each widget type is read from JSON; a coercer raises ValueError (or TypeError,
# OverflowError) for a value that is not of its type. Types without one (COMBO, link types) pass as is.
def _to_int(value: Any) -> int:
    """An integer, from an int, a whole float or a decimal string (never a bool)."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not a whole number")
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    if not isinstance(value, int):
        raise TypeError(type(value).__name__)
    return value


def _to_float(value: Any) -> float:
    """A finite float, from a number or a numeric string (never a bool)."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError("not finite")
    return value


def _to_string(value: Any) -> str:
    """A string, as given."""
    if not isinstance(value, str):
        raise TypeError(type(value).__name__)
    return value


def _to_boolean(value: Any) -> bool:
    """A bool, or the strings "true"/"false" in any case."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise TypeError(type(value).__name__)
    return value


_COERCERS: dict[str, Callable[[Any], Any]] = {
    "INT": _to_int, "FLOAT": _to_float, "STRING": _to_string, "BOOLEAN": _to_boolean,
}


def validate_prompt(data: Any, registry: Registry, *, partial_targets: list[str] | None = None,
                    options: dict | None = None, memo: ValidationMemo | None = None) -> ValidatedPrompt:
    """Validate an API prompt; raise PromptError (ComfyUI's shape) when nothing can run.

    Rules that span several nodes (such as loop pairing) come from `registry.graph_checks`:
    `fn(prompt, registry, options) -> {node_id: [error, ...]}`, reported through the same path.
    With a `memo`, an unchanged prompt validated before comes back without being checked again.
    """
    key = memo.key(data, registry, partial_targets, options) if memo is not None else None
    if key is not None:
        found = memo.get(key, data)
        if found is not None:
            return found
    with collector_paused(keep_as_old=True):
        validated = _validate(data, registry, partial_targets, options)
    if key is not None:
        memo.put(key, validated)
    return validated


def _validate(data: Any, registry: Registry, partial_targets: list[str] | None, options: dict | None) -> ValidatedPrompt:
    check_structure(data)
    prompt = Prompt.from_api(data)
    outputs = []
    reusable = True
    for node_id, node in prompt.nodes.items():
        spec = registry.get(node.class_type)
        if spec is None:
            cause = registry.missing_cause(node.class_type)
            raise PromptError(
                "missing_node_type",
                f"Node {node.label}: node type '{node.class_type}' is not registered"
                + missing_cause_text(registry, node.class_type),
                f"Node ID '#{node.id}'",
                extra_info={"node_id": node.id, "class_type": node.class_type,
                            "node_title": node.title or node.class_type,
                            **({"pack": cause["source"], "pack_error": cause["reason"]} if cause else {})},
            )
        if spec.output_node:
            outputs.append(node_id)
        reusable = reusable and spec.validation_is_pure
    if partial_targets is not None:  # an empty list selects nothing, so the prompt has no outputs
        unknown = [t for t in partial_targets if str(t) not in prompt.nodes]
        if unknown:
            raise PromptError("invalid_prompt", "Partial execution targets name unknown nodes", f"unknown: {unknown}")
        outputs = [str(t) for t in partial_targets]
    if not outputs:
        raise PromptError("prompt_no_outputs", "Prompt has no outputs",
                          "The prompt needs at least one output node (such as SaveImage or PreviewAny)")
    checker = _NodeChecker(prompt, registry)
    try:
        order = prompt.ordered_ancestors(outputs, visit=checker.visit)
    except CycleError as cycle:
        node_errors = {
            nid: {"errors": [node_error("dependency_cycle", f"Dependency cycle: {' -> '.join(cycle.labels)}",
                                        " -> ".join(cycle.labels))],
                  "dependent_outputs": [], "class_type": prompt.nodes[nid].class_type}
            for nid in cycle.path[:-1]
        }
        raise PromptError("dependency_cycle", f"Dependency cycle: {' -> '.join(cycle.labels)}",
                          " -> ".join(cycle.path), node_errors=node_errors) from None

    good = [o for o in outputs if o not in checker.unusable]
    for graph_check in registry.graph_checks:
        for nid, errs in (graph_check(prompt, registry, options or {}) or {}).items():
            checker.errors.setdefault(nid, []).extend(errs)
            affected = [o for o in good if nid in set(prompt.ancestors([o]))] or list(good)
            good = [o for o in good if o not in affected]
    node_errors: dict[str, dict] = {}
    if checker.errors:
        for nid, errs in checker.errors.items():
            dependent = [o for o in outputs if nid in set(prompt.ancestors([o]))]
            node_errors[nid] = {"errors": errs, "dependent_outputs": dependent,
                                "class_type": prompt.nodes[nid].class_type if nid in prompt.nodes else None}
    if not good:
        first = next(iter(node_errors.values()))["errors"][0] if node_errors else None
        # Clients read this top-level message as ComfyUI words it (some match on it where `type` is absent);
        # the details say what is wrong: the first error's message and its details.
        summary = (f"{first['message']}: {first['details']}" if first.get("details") else first["message"]) \
            if first else ""
        raise PromptError(
            "prompt_outputs_failed_validation",
            "Prompt outputs failed validation",  # provenance: interface
            summary, node_errors=node_errors)
    # The declared graph rewrites (execution.rewrite) give the graph that runs; `prompt` stays as checked.
    runs = rewrite_prompt(prompt, registry, options)
    return ValidatedPrompt(runs, good, node_errors, order, reusable=reusable)
