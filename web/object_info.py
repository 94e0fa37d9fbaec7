"""`/object_info`: the node catalogue the editor builds its menus and widgets from.

A wire format: field names, order and shapes follow ComfyUI's, so the official editor and existing
clients read it unchanged. It is rendered here from the `NodeSpec`s a registry holds.
"""
from __future__ import annotations

from typing import Any

from execution.spec import AUTOGROW, DYNAMIC_COMBO, InputSpec, NodeSpec, Registry


def object_info(registry: Registry, node_id: str | None = None) -> dict[str, Any]:
    """`/object_info` for every registered node, or for one (an empty dict when it is unknown)."""
    if node_id is not None:
        spec = registry.get(node_id)
        return {node_id: node_info(spec)} if spec is not None else {}
    return {spec.node_id: node_info(spec) for spec in registry}


def node_info(spec: NodeSpec) -> dict[str, Any]:
    """One node as `/object_info` describes it."""
    sections: dict[str, dict[str, Any]] = {"required": {}, "optional": {}, "hidden": {}}
    order: dict[str, list[str]] = {"required": [], "optional": [], "hidden": []}
    for inp in spec.inputs:
        sections[inp.kind][inp.name] = _input_info(inp)
        order[inp.kind].append(inp.name)
    outputs = spec.outputs
    return {
        "input": {k: v for k, v in sections.items() if v or k == "required"},
        "input_order": {k: v for k, v in order.items() if v or k == "required"},
        "is_input_list": spec.input_is_list,
        "output": [o.type for o in outputs],
        "output_is_list": [o.is_list for o in outputs],
        "output_name": [o.name for o in outputs],
        "output_tooltips": [o.tooltip for o in outputs],
        "output_matchtypes": [o.match_type for o in outputs] if any(o.match_type for o in outputs) else None,
        "name": spec.node_id,
        "display_name": spec.display_name,
        "description": spec.description,
        "python_module": spec.python_module,
        "category": spec.category,
        "output_node": spec.output_node,
        "deprecated": spec.deprecated,
        "experimental": spec.experimental,
        "dev_only": True if spec.dev_only else None,
        "api_node": False,
        "price_badge": None,
        "search_aliases": list(spec.search_aliases) or None,
        "essentials_category": spec.essentials_category,
        "has_intermediate_output": spec.has_intermediate_output or None,
    }


def _input_info(inp: InputSpec) -> list[Any] | str:
    """One input's entry: `TYPE` or `[TYPE]` when hidden (as declared), `[choices, options]` for a
    combo, else `[TYPE, options]`; dynamic combos and auto-grow groups carry their nested inputs in
    their options."""
    if inp.kind == "hidden" and (inp.executor_supplied or not inp.options):
        return inp.type if inp.hidden_as_string else [inp.type]
    opts = dict(inp.options)
    if inp.type == "COMBO":
        return [inp.choice_list(), opts]
    if inp.type == DYNAMIC_COMBO:
        options = []
        for key, subs in inp.dynamic_options.items():
            entry: dict[str, Any] = {"required": {s.name: _input_info(s) for s in subs if s.kind == "required"}}
            optional = {s.name: _input_info(s) for s in subs if s.kind == "optional"}
            if optional:
                entry["optional"] = optional
            options.append({"key": key, "inputs": entry})
        opts["options"] = options
        return [DYNAMIC_COMBO, opts]
    if inp.type == AUTOGROW:
        template = inp.template
        grown: dict[str, Any] = {"input": {"required": {template.name: _input_info(template)}}, "min": inp.grow_min}
        if inp.names:
            grown["names"] = list(inp.names)
        else:
            grown.update(prefix=inp.prefix, max=inp.grow_max)
        opts["template"] = grown
        return [AUTOGROW, opts]
    return [inp.type, opts]
