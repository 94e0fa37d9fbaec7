"""Runtime values shared by nodes and the executor: results, blockers, link typing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from execution.spec import NodeSpec

MATCH_TYPE = "COMFY_MATCHTYPE_V3"


class ExecutionBlocker:
    """Returned in place of an output value: nodes that consume it do not run.

    With a message, reaching an output node is an error shown to the user; without one the branch
    is silently skipped (ComfyUI's semantics).
    """

    __slots__ = ("message",)

    def __init__(self, message: str | None = None):
        self.message = message

    def __repr__(self) -> str:
        return f"ExecutionBlocker({self.message!r})"


# The key of a node's UI output holding the sound check of each sound it wrote (nodes/audio_health.py), in the
# order of its files. Figures about outputs, not outputs: the jobs interface does not count them as outputs.
AUDIO_HEALTH_KEY = "audio_health"


@dataclass
class NodeOutput:
    """What a node's execute returns: output values, an optional UI dict, optional expansion."""

    values: tuple = ()
    ui: dict | None = None
    expand: dict | None = None

    @classmethod
    def of(cls, *values: Any, ui: dict | None = None, expand: dict | None = None) -> "NodeOutput":
        return cls(tuple(values), ui, expand)


def _compares_itself(type_name: Any) -> bool:
    return isinstance(type_name, str) and type(type_name).__ne__ is not str.__ne__


def types_compatible(source: str, target: str) -> bool:
    """ComfyUI's link typing: `*` matches all, comma lists are unions, match-type accepts all; a type
    string whose class defines its own `!=` (a pack's "any of these" type) is accepted when that `!=`
    says equal, as ComfyUI asks `!=` first; otherwise the union rule decides."""
    if (_compares_itself(source) or _compares_itself(target)) and not (source != target):
        return True
    if source == target or source == "*" or target == "*" or target == MATCH_TYPE or source == MATCH_TYPE:
        return True
    source_set = {s.strip() for s in str(source).split(",")}
    target_set = {t.strip() for t in str(target).split(",")}
    if "*" in source_set or "*" in target_set:
        return True
    return bool(source_set & target_set)


def normalize_result(spec: NodeSpec, result: Any) -> NodeOutput:
    """Bring what execute returned (tuple, NodeOutput, classic dict, None) into a NodeOutput."""
    if isinstance(result, NodeOutput):
        out = result
    elif isinstance(result, dict) and ({"result", "ui", "expand"} & result.keys()):
        values = result.get("result", ())
        out = NodeOutput(tuple(values) if values is not None else (), result.get("ui"), result.get("expand"))
    elif result is None:
        out = NodeOutput(())
    elif isinstance(result, tuple):
        out = NodeOutput(result)
    elif isinstance(result, list) and len(spec.outputs) == len(result):
        out = NodeOutput(tuple(result))
    else:
        raise TypeError(
            f"node '{spec.node_id}' returned {type(result).__name__}; expected a tuple of "
            f"{len(spec.outputs)} value(s), a NodeOutput or a dict with 'result'/'ui'/'expand'"
        )
    if len(out.values) != len(spec.outputs) and not (spec.output_node and not out.values):
        raise TypeError(
            f"node '{spec.node_id}' returned {len(out.values)} value(s) but declares "
            f"{len(spec.outputs)} output(s)"
        )
    return out
