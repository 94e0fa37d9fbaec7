"""UI-format workflow (what the editor saves) -> API-format prompt (what the executor runs).

The editor turns its graph into a prompt itself before queueing; a file saved from the editor holds the
graph instead, so the server and the headless runner convert it here, following the editor's rules:

- widget values map to inputs in the editor's widget order: required inputs, then optional ones, each
  in declaration order (the order `/object_info`'s `input_order` gives the editor); a dynamic combo's
  value is followed by the widgets of the option it selects (`mode.num_iterations`). An INT input with
  `control_after_generate` (or named `seed` / `noise_seed`) is followed by the editor's extra
  "fixed"/"randomize"/... value, and an upload combo by its upload button's value; both are skipped.
  `widgets_values_named` (or a dict-form `widgets_values`) is used instead of positions when present;
  a node that takes every input (`NodeSpec.takes_every_input`) also gets its other plain values.
- a linked input takes the link instead of the widget value; links come as lists
  `[id, origin_id, origin_slot, target_id, target_slot, type]` or as objects with those keys.
- muted nodes (mode 2) are dropped, and so are the inputs fed by them; bypassed nodes (mode 4) hand
  each consumer the input of a matching type (preferring the same slot index), else nothing.
- Reroute passes its input through; PrimitiveNode's value becomes its targets' widget values; Note and
  MarkdownNote are dropped.
- subgraph instances (node `type` = an id in `definitions.subgraphs`) are flattened: inner node
  `<inner>` of instance `<outer>` becomes `"<outer>:<inner>"` (nested instances chain further). Inside a
  definition, links from pseudo-node -10 are the instance's inputs (its link, else its widget value)
  and links to pseudo-node -20 are the instance's outputs.

This module never imports node code: it sees node types only through the `Registry` handed in and
the `NodeSpec`s it returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from execution.errors import PromptError
from execution.spec import AUTOGROW, DYNAMIC_COMBO, InputSpec, Registry, missing_cause_text, widget_inputs

__all__ = ["ExposedWidget", "exposed_widgets", "is_ui_workflow", "to_api_prompt", "ui_to_api"]

MODE_MUTED = 2  # LiteGraph "never"
MODE_BYPASS = 4
SUBGRAPH_INPUT_ID = "-10"
SUBGRAPH_OUTPUT_ID = "-20"

REROUTE = "Reroute"
PRIMITIVE_NODE = "PrimitiveNode"
NOTE_TYPES = frozenset({"Note", "MarkdownNote"})

# The values the editor's control_after_generate widget can hold.
CONTROL_VALUES = frozenset({"fixed", "increment", "decrement", "randomize"})
# The editor adds a seed control to any INT input with these names, declared or not.
SEED_NAMES = frozenset({"seed", "noise_seed"})
# Options that make the editor add an upload button after the combo, and the values that button saves.
UPLOAD_OPTIONS = ("image_upload", "video_upload", "audio_upload", "animated_image_upload")
UPLOAD_VALUES = frozenset({"image", "video", "audio"})

_MISSING = object()


def is_ui_workflow(data: Any) -> bool:
    """Whether `data` is a UI-format workflow (`{"nodes": [...], "links": [...], ...}`), not an API prompt."""
    return isinstance(data, Mapping) and isinstance(data.get("nodes"), list)


def to_api_prompt(data: Any, registry: Registry) -> Any:
    """`data` as an API prompt: a UI-format workflow converted, anything else as given (for
    validation to judge)."""
    return ui_to_api(data, registry) if is_ui_workflow(data) else data


def ui_to_api(workflow: Mapping[str, Any], registry: Registry) -> dict[str, dict[str, Any]]:
    """Convert a UI-format workflow into an API prompt `{id: {"class_type", "inputs", "_meta": {"title"}}}`.

    Raises PromptError `missing_node_type` naming every unregistered node type (with node id and
    title), and `invalid_prompt` for a malformed workflow.
    """
    if not is_ui_workflow(workflow):
        raise PromptError("invalid_prompt", "Not a UI-format workflow",
                          "expected an object with a 'nodes' list (and 'links')")
    return _Converter(workflow, registry).run()


# ---------------------------------------------------------------------------------------------- graph model
@dataclass(frozen=True)
class _Link:
    origin_id: str
    origin_slot: int
    target_id: str
    target_slot: int
    type: Any


@dataclass
class _Graph:
    """One graph level: the root workflow or one subgraph definition."""

    nodes: dict[str, dict]  # node id (as str) -> UI node
    links: dict[str, _Link]  # link id (as str) -> link
    definition: dict | None = None  # the subgraph definition, None for the root
    widget_inputs: list[str] = field(default_factory=list)  # definition inputs that carry a widget


@dataclass
class _Scope:
    """A graph level as reached through a chain of subgraph instances."""

    graph: _Graph
    path: tuple[str, ...] = ()  # instance ids from the root down to this level
    parent: "_Scope | None" = None
    instance: dict | None = None  # the instance node (in `parent`) this level expands
    instance_widgets: dict[str, Any] = field(default_factory=dict)  # instance widget values by input name
    overrides: dict[tuple[str, str], Any] = field(default_factory=dict)  # (inner id, widget) -> value

    def exec_id(self, node_id: str) -> str:
        return ":".join((*self.path, node_id))


@dataclass(frozen=True)
class _Value:
    """A resolved input that is a plain value (a PrimitiveNode's or a subgraph instance's widget)."""

    value: Any
    widget: tuple[str, str] | None = None  # (instance exec id, subgraph input name) when an instance's widget


@dataclass
class ExposedWidget:
    """A widget a subgraph instance shows the user, and the prompt inputs its value reaches."""

    instance: str  # the instance's exec id ("140"; nested instances chain: "140:12")
    instance_title: str
    name: str  # the subgraph input's name (`value_1`)
    label: str  # what the editor shows (`duration`; the name when the input has no label)
    value: Any
    targets: list[tuple[str, str]] = field(default_factory=list)  # (prompt node id, input name)


def exposed_widgets(workflow: Mapping[str, Any], registry: Registry) -> list[ExposedWidget]:
    """Every widget the subgraph instances of a UI workflow expose, with the prompt inputs each one feeds
    (what `main.py run --set duration=2` addresses). Empty for an API prompt."""
    if not is_ui_workflow(workflow):
        return []
    converter = _Converter(workflow, registry)
    converter.run()
    return list(converter.exposed.values())


@dataclass(frozen=True)
class _Ref:
    """A resolved input that is a link to an executable node's output."""

    node_id: str
    slot: int


def _key(value: Any) -> str:
    return str(value)


def _slot(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PromptError("invalid_prompt", "Malformed workflow", f"{what}: slot {value!r} is not an integer") from None


def _parse_link(raw: Any, where: str) -> tuple[str, _Link]:
    if isinstance(raw, Mapping):
        try:
            return _key(raw["id"]), _Link(_key(raw["origin_id"]), _slot(raw["origin_slot"], where),
                                         _key(raw["target_id"]), _slot(raw["target_slot"], where), raw.get("type"))
        except KeyError as exc:
            raise PromptError("invalid_prompt", "Malformed workflow",
                              f"{where}: link object {raw!r} has no {exc.args[0]!r}") from None
    if isinstance(raw, (list, tuple)) and len(raw) >= 5:
        return _key(raw[0]), _Link(_key(raw[1]), _slot(raw[2], where), _key(raw[3]), _slot(raw[4], where),
                                  raw[5] if len(raw) > 5 else None)
    raise PromptError("invalid_prompt", "Malformed workflow",
                      f"{where}: link {raw!r} is neither [id, origin_id, origin_slot, target_id, target_slot, type] "
                      "nor an object with those keys")


def _build_graph(raw_nodes: Any, raw_links: Any, where: str, definition: dict | None = None) -> _Graph:
    if not isinstance(raw_nodes, list):
        raise PromptError("invalid_prompt", "Malformed workflow", f"{where}: 'nodes' must be a list")
    nodes: dict[str, dict] = {}
    for raw in raw_nodes:
        if not isinstance(raw, Mapping) or "id" not in raw or not isinstance(raw.get("type"), str):
            raise PromptError("invalid_prompt", "Malformed workflow",
                              f"{where}: node {str(raw)[:120]} lacks an 'id' or a string 'type'")
        nodes[_key(raw["id"])] = raw
    links: dict[str, _Link] = {}
    for raw in raw_links or []:
        link_id, link = _parse_link(raw, where)
        links[link_id] = link
    graph = _Graph(nodes, links, definition)
    if definition is not None:
        graph.widget_inputs = _definition_widget_inputs(graph)
    return graph


def _definition_widget_inputs(graph: _Graph) -> list[str]:
    """Names of a subgraph's inputs that carry a widget on its instances, in input order: those
    linked to an inner input that is itself a widget (the editor promotes the inner widget)."""
    carries: set[int] = set()
    for link_id, link in graph.links.items():
        if link.origin_id != SUBGRAPH_INPUT_ID:
            continue
        target = graph.nodes.get(link.target_id)
        if target is None:
            continue
        for inp in target.get("inputs") or []:
            if _key(inp.get("link")) == link_id and inp.get("widget"):
                carries.add(link.origin_slot)
    inputs = graph.definition.get("inputs") or []
    return [inp.get("name") for i, inp in enumerate(inputs) if i in carries]


# ------------------------------------------------------------------------------------------------ widgets
def _has_control(inp: InputSpec) -> bool:
    if inp.options.get("control_after_generate"):
        return True
    return inp.type == "INT" and inp.name in SEED_NAMES


def _has_upload(inp: InputSpec) -> bool:
    return any(inp.options.get(k) for k in UPLOAD_OPTIONS)


def _default(inp: InputSpec) -> Any:
    """The value the editor gives a widget the file has no value for."""
    if "default" in inp.options:
        return inp.options["default"]
    if inp.type == DYNAMIC_COMBO:
        return next(iter(inp.dynamic_options or {}), _MISSING)
    if inp.type == "COMBO":
        choices = inp.choice_list()
        return choices[0] if choices else _MISSING
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}.get(inp.type, _MISSING)


class _Positional:
    """Reads positional widgets_values, skipping the editor's extra control / upload values."""

    def __init__(self, values: list):
        self.values = values
        self.index = 0

    def take(self, inp: InputSpec, name: str) -> Any:
        if self.index < len(self.values):
            value = self.values[self.index]
            self.index += 1
        else:
            value = _default(inp)
        # The extra values are only skipped when they look like what the editor writes, so a file
        # saved without them (an older editor) still maps correctly.
        if _has_control(inp) and self._next_in(CONTROL_VALUES):
            self.index += 1
        if _has_upload(inp) and self._next_in(UPLOAD_VALUES):
            self.index += 1
        return value

    def _next_in(self, allowed: frozenset) -> bool:
        if self.index >= len(self.values):
            return False
        value = self.values[self.index]
        return isinstance(value, str) and value in allowed


class _Named:
    """Reads widget values by name (`widgets_values_named` or a dict-form `widgets_values`)."""

    def __init__(self, values: Mapping[str, Any]):
        self.values = values

    def take(self, inp: InputSpec, name: str) -> Any:
        return self.values[name] if name in self.values else _default(inp)


def _walk_widgets(inputs: Sequence[InputSpec], reader: _Positional | _Named, ui_inputs: list[dict],
                  prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield (api input name, value) for every widget of a node, in the editor's widget order."""
    for inp in widget_inputs(inputs):
        name = prefix + inp.name
        if inp.type == AUTOGROW:
            # Auto-grow slots that hold widgets appear on the node as inputs carrying a widget.
            for ui_inp in ui_inputs:
                slot_name = ui_inp.get("name", "")
                if slot_name.startswith(name + ".") and ui_inp.get("widget"):
                    value = reader.take(inp.template, slot_name)
                    if value is not _MISSING:
                        yield slot_name, value
            continue
        value = reader.take(inp, name)
        if value is not _MISSING:
            yield name, value
        if inp.type == DYNAMIC_COMBO:
            chosen = value if isinstance(value, str) and value in inp.dynamic_options else None
            if chosen is not None:
                yield from _walk_widgets(inp.dynamic_options[chosen], reader, ui_inputs, prefix=name + ".")


def _wrap(value: Any) -> Any:
    """List-valued widget values travel wrapped, so they are not read as links."""
    return {"__value__": value} if isinstance(value, list) else value


# ---------------------------------------------------------------------------------------------- converter
class _Converter:
    """One conversion: walks every graph level, emits executable nodes, resolves their links."""

    def __init__(self, workflow: Mapping[str, Any], registry: Registry):
        self.registry = registry
        self.definitions: dict[str, dict] = {}
        for sub in ((workflow.get("definitions") or {}).get("subgraphs") or []):
            if isinstance(sub, Mapping) and "id" in sub:
                self.definitions[_key(sub["id"])] = sub
        self.group_nodes = set(((workflow.get("extra") or {}).get("groupNodes") or {}).keys())
        self.graphs: dict[str, _Graph] = {}
        self.root = _Scope(_build_graph(workflow.get("nodes"), workflow.get("links"), "workflow"))
        self.scopes: dict[tuple[str, ...], _Scope] = {}
        self.prompt: dict[str, dict[str, Any]] = {}
        self.missing: list[tuple[str, str, str]] = []  # (exec id, class type, title)
        self.exposed: dict[tuple[str, str], ExposedWidget] = {}  # (instance exec id, input name) -> widget

    # -------------------------------------------------------------- flattening
    def run(self) -> dict[str, dict[str, Any]]:
        self._emit(self.root)
        if self.missing:
            self._raise_missing()
        # As the editor does: an input linked to a node that is not in the prompt (muted, or inside a
        # muted subgraph) is removed.
        for entry in self.prompt.values():
            inputs = entry["inputs"]
            for name in [n for n, v in inputs.items() if isinstance(v, list) and len(v) == 2
                         and isinstance(v[0], str) and v[0] not in self.prompt]:
                del inputs[name]
        return self.prompt

    def _graph_for(self, subgraph_id: str) -> _Graph:
        if subgraph_id not in self.graphs:
            definition = self.definitions[subgraph_id]
            name = definition.get("name") or subgraph_id
            if definition.get("widgets"):
                raise PromptError(
                    "invalid_prompt", "Unsupported subgraph",
                    f"subgraph '{name}' ({subgraph_id}) lists promoted widgets in 'widgets', a form Weft "
                    "does not read; re-save the workflow with a current editor")
            self.graphs[subgraph_id] = _build_graph(definition.get("nodes"), definition.get("links"),
                                                    f"subgraph '{name}'", definition)
        return self.graphs[subgraph_id]

    def _emit(self, scope: _Scope) -> None:
        for node_id, node in scope.graph.nodes.items():
            class_type = node["type"]
            if class_type in NOTE_TYPES or class_type in (REROUTE, PRIMITIVE_NODE):
                continue
            if node.get("mode") in (MODE_MUTED, MODE_BYPASS):
                continue
            if class_type in self.definitions:
                self._emit(self._child_scope(scope, node_id, node))
                continue
            self._emit_node(scope, node_id, node)

    def _child_scope(self, scope: _Scope, node_id: str, node: dict) -> _Scope:
        """The level an instance expands to (built once per instance path)."""
        path = (*scope.path, node_id)
        if path in self.scopes:
            return self.scopes[path]
        level: _Scope | None = scope
        while level is not None and level.instance is not None:
            if level.instance["type"] == node["type"]:
                raise PromptError("invalid_prompt", "Malformed workflow",
                                  f"subgraph {node['type']} contains an instance of itself "
                                  f"(node #{':'.join(path)})")
            level = level.parent
        graph = self._graph_for(node["type"])
        child = _Scope(graph, path, scope, node)
        child.instance_widgets = self._instance_widgets(scope, node_id, node, graph)
        child.overrides = self._proxy_overrides(node)
        self.scopes[path] = child
        return child

    def _instance_widgets(self, scope: _Scope, node_id: str, node: dict, graph: _Graph) -> dict[str, Any]:
        """The instance's widget values by subgraph input name."""
        values: dict[str, Any] = {}
        named = node.get("widgets_values_named")
        raw = node.get("widgets_values")
        proxies = (node.get("properties") or {}).get("proxyWidgets")
        if isinstance(named, Mapping):
            values.update(named)
        elif isinstance(raw, Mapping):
            values.update(raw)
        elif isinstance(proxies, list) and proxies and isinstance(raw, list):
            # Older editors save the promoted widgets' values aligned with proxyWidgets; entries on
            # "-1" are the instance's own input widgets.
            for entry, value in zip(proxies, raw):
                if isinstance(entry, (list, tuple)) and len(entry) >= 2 and _key(entry[0]) == "-1":
                    values[entry[1]] = value
        elif isinstance(raw, list):
            types = {i.get("name"): i.get("type") for i in graph.definition.get("inputs") or []}
            index = 0
            for name in graph.widget_inputs:
                if index >= len(raw):
                    break
                values[name] = raw[index]
                index += 1
                # A promoted seed may be saved with its control value; skip it when it is there.
                if types.get(name) == "INT" and index < len(raw) and isinstance(raw[index], str) \
                        and raw[index] in CONTROL_VALUES:
                    index += 1
        # A widget value set from the parent level (its proxyWidgets) wins.
        for (target, widget), value in scope.overrides.items():
            if target == node_id:
                values[widget] = value
        return values

    @staticmethod
    def _proxy_overrides(node: dict) -> dict[tuple[str, str], Any]:
        proxies = (node.get("properties") or {}).get("proxyWidgets")
        raw = node.get("widgets_values")
        if not isinstance(proxies, list) or not isinstance(raw, list):
            return {}
        out: dict[tuple[str, str], Any] = {}
        for entry, value in zip(proxies, raw):
            if isinstance(entry, (list, tuple)) and len(entry) >= 2 and _key(entry[0]) != "-1":
                out[(_key(entry[0]), entry[1])] = value
        return out

    # -------------------------------------------------------------- one executable node
    def _emit_node(self, scope: _Scope, node_id: str, node: dict) -> None:
        class_type = node["type"]
        exec_id = scope.exec_id(node_id)
        spec = self.registry.get(class_type)
        if spec is None:
            self.missing.append((exec_id, class_type, node.get("title") or class_type))
            return
        ui_inputs = [i for i in node.get("inputs") or [] if isinstance(i, Mapping)]
        named = node.get("widgets_values_named")
        raw = node.get("widgets_values")
        if isinstance(named, Mapping):
            reader: _Positional | _Named = _Named(named)
        elif isinstance(raw, Mapping):
            reader = _Named(raw)
        else:
            reader = _Positional(list(raw) if isinstance(raw, list) else [])
        inputs: dict[str, Any] = {name: _wrap(value) for name, value in _walk_widgets(spec.inputs, reader, ui_inputs)}
        if spec.takes_every_input and isinstance(reader, _Named):
            # A node that takes every input gets the widget values it does not declare too (the options
            # a video pack's editor script adds for the chosen format); structured values are the
            # editor's own state (a preview's settings), never prompt inputs.
            for name, value in reader.values.items():
                if name not in inputs and isinstance(value, (bool, int, float, str)):
                    inputs[name] = value
        for (target, widget), value in scope.overrides.items():
            if target == node_id and widget in inputs:
                inputs[widget] = _wrap(value)

        for slot, ui_inp in enumerate(node.get("inputs") or []):
            if not isinstance(ui_inp, Mapping) or ui_inp.get("link") is None or not ui_inp.get("name"):
                continue
            resolved = self._resolve_input(scope, node_id, node, slot, None, set())
            if resolved is None:
                continue  # nothing executable upstream: a widget keeps its own value
            if isinstance(resolved, _Value):
                inputs[ui_inp["name"]] = _wrap(resolved.value)
                if resolved.widget in self.exposed:
                    self.exposed[resolved.widget].targets.append((exec_id, ui_inp["name"]))
            else:
                inputs[ui_inp["name"]] = [resolved.node_id, resolved.slot]

        title = node.get("title") or spec.display_name or class_type
        self.prompt[exec_id] = {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}

    def _raise_missing(self) -> None:
        listed = ", ".join(f"'{ct}' (node #{nid} '{title}')" for nid, ct, title in self.missing)
        first_id, first_type, first_title = self.missing[0]
        causes = {ct: self.registry.missing_cause(ct) for _, ct, _ in self.missing}
        raise PromptError(
            "missing_node_type",
            f"Node '{first_title}' (#{first_id}) has type '{first_type}', which is not registered"
            + missing_cause_text(self.registry, first_type),
            f"Node type(s) not registered: {listed}. The custom node may not be installed"
            + (" (legacy group nodes must be converted to subgraphs in the editor)"
               if any(ct in self.group_nodes for _, ct, _ in self.missing) else ""),
            extra_info={"node_id": first_id, "class_type": first_type, "node_title": first_title,
                        "missing": [{"node_id": nid, "class_type": ct, "node_title": title,
                                     **({"pack": causes[ct]["source"], "pack_error": causes[ct]["reason"]}
                                        if causes[ct] else {})}
                                    for nid, ct, title in self.missing]},
        )

    # -------------------------------------------------------------- link resolution
    def _guard(self, visited: set, scope: _Scope, node_id: str, direction: str, slot: int) -> None:
        key = (scope.path, node_id, direction, slot)
        if key in visited:
            raise PromptError("invalid_prompt", "Malformed workflow",
                              f"links loop back through node #{scope.exec_id(node_id)} "
                              f"({direction.lower()} slot {slot}) without reaching an executable node")
        visited.add(key)

    def _resolve_input(self, scope: _Scope, node_id: str, node: dict, slot: int, want_type: Any,
                       visited: set) -> _Value | _Ref | None:
        """What feeds input `slot` of a node: an executable node's output, a value, or None."""
        self._guard(visited, scope, node_id, "I", slot)
        ui_inputs = node.get("inputs") or []
        if slot >= len(ui_inputs) or not isinstance(ui_inputs[slot], Mapping):
            return None
        ui_inp = ui_inputs[slot]
        link_id = ui_inp.get("link")
        if link_id is None:
            return None
        # A stale link id (the editor repairs these on load) counts as unconnected.
        link = scope.graph.links.get(_key(link_id))
        if link is None:
            return None
        want_type = want_type if want_type is not None else ui_inp.get("type")
        if link.origin_id == SUBGRAPH_INPUT_ID and scope.instance is not None:
            return self._resolve_boundary_input(scope, link.origin_slot, want_type, visited)
        origin = scope.graph.nodes.get(link.origin_id)
        if origin is None:
            return None
        return self._resolve_output(scope, link.origin_id, origin, link.origin_slot, want_type, visited)

    def _resolve_boundary_input(self, scope: _Scope, def_slot: int, want_type: Any,
                                visited: set) -> _Value | _Ref | None:
        """Input `def_slot` of a subgraph definition, as its instance provides it."""
        def_inputs = scope.graph.definition.get("inputs") or []
        if def_slot >= len(def_inputs):
            return None
        name = def_inputs[def_slot].get("name")
        instance = scope.instance
        instance_id = scope.path[-1]
        # Instances may save only some of their inputs, so they are matched by name, not position.
        for slot, inst_inp in enumerate(instance.get("inputs") or []):
            if isinstance(inst_inp, Mapping) and inst_inp.get("name") == name and inst_inp.get("link") is not None:
                return self._resolve_input(scope.parent, instance_id, instance, slot, want_type, visited)
        if name in scope.instance_widgets:
            key = (":".join(scope.path), name)
            if key not in self.exposed:
                label = def_inputs[def_slot].get("label") or name
                title = instance.get("title") or scope.graph.definition.get("name") or instance_id
                self.exposed[key] = ExposedWidget(key[0], str(title), name, str(label), scope.instance_widgets[name])
            return _Value(scope.instance_widgets[name], key)
        return None

    def _resolve_output(self, scope: _Scope, node_id: str, node: dict, slot: int, want_type: Any,
                        visited: set) -> _Value | _Ref | None:
        """What output `slot` of a node stands for once editor-only and bypassed nodes are removed."""
        self._guard(visited, scope, node_id, "O", slot)
        class_type = node["type"]
        if node.get("mode") == MODE_BYPASS:
            index = self._bypass_input(node, slot, want_type)
            if index < 0:
                return None
            return self._resolve_input(scope, node_id, node, index, None, visited)
        if class_type in self.definitions:
            return self._resolve_subgraph_output(scope, node_id, node, slot, want_type, visited)
        if class_type == REROUTE:
            return self._resolve_input(scope, node_id, node, slot, want_type, visited)
        if class_type == PRIMITIVE_NODE:
            values = node.get("widgets_values")
            if isinstance(values, list) and values:
                return _Value(values[0])
            return None
        return _Ref(scope.exec_id(node_id), slot)

    def _resolve_subgraph_output(self, scope: _Scope, node_id: str, node: dict, slot: int, want_type: Any,
                                 visited: set) -> _Value | _Ref | None:
        child = self._child_scope(scope, node_id, node)
        def_outputs = child.graph.definition.get("outputs") or []
        inst_outputs = node.get("outputs") or []
        def_slot = slot
        # Match the instance's output to the definition's by name when both have one.
        if slot < len(inst_outputs) and isinstance(inst_outputs[slot], Mapping):
            names = [o.get("name") for o in def_outputs]
            if inst_outputs[slot].get("name") in names:
                def_slot = names.index(inst_outputs[slot].get("name"))
        for link in child.graph.links.values():
            if link.target_id == SUBGRAPH_OUTPUT_ID and link.target_slot == def_slot:
                if link.origin_id == SUBGRAPH_INPUT_ID:  # an input wired straight to an output
                    return self._resolve_boundary_input(child, link.origin_slot, want_type, visited)
                origin = child.graph.nodes.get(link.origin_id)
                if origin is None:
                    return None
                return self._resolve_output(child, link.origin_id, origin, link.origin_slot, want_type, visited)
        return None

    @staticmethod
    def _bypass_input(node: dict, slot: int, want_type: Any) -> int:
        """The input a bypassed node hands to consumers of output `slot` (-1: none), as the editor picks it."""
        inputs = [i if isinstance(i, Mapping) else {} for i in node.get("inputs") or []]
        outputs = node.get("outputs") or []
        out_type = outputs[slot].get("type") if slot < len(outputs) and isinstance(outputs[slot], Mapping) else "*"
        if want_type in (None, "*", ""):
            return slot if slot < len(inputs) else (0 if inputs else -1)
        if slot < len(inputs) and _connects(inputs[slot].get("type"), out_type) \
                and _connects(inputs[slot].get("type"), want_type):
            return slot
        for i, inp in enumerate(inputs):
            if inp.get("type") == want_type:
                return i
        for i, inp in enumerate(inputs):
            if _connects(inp.get("type"), out_type) and _connects(inp.get("type"), want_type):
                return i
        return -1


def _connects(a: Any, b: Any) -> bool:
    """LiteGraph's link typing: `*`/empty match all, comma lists are unions, case does not matter."""
    if a in (None, "", "*", 0) or b in (None, "", "*", 0):
        return True
    first = {t.strip().lower() for t in str(a).split(",")}
    second = {t.strip().lower() for t in str(b).split(",")}
    return "*" in first or "*" in second or bool(first & second)
