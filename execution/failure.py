"""Why a job stopped early: one exception type that renders its `execution_error` or
`execution_interrupted` event payload (the wire shapes the editor reads)."""
from __future__ import annotations

import traceback
from typing import Any

from execution.events import timestamp_ms
from execution.graph import PromptNode

ERROR = "execution_error"
INTERRUPTED = "execution_interrupted"


class RunFailure(Exception):
    """A job ended before its outputs: a node raised, the scheduler failed, or the job was interrupted.

    Made where the failure is seen (`node_raised`, `interrupted`, `fault`, `stuck`); the payload is
    rendered once, when the job reports it, with the job's id and the nodes executed by then."""

    def __init__(self, event: str, node: PromptNode | None, message: str = "", exception_type: str = "",
                 trace: list[str] | None = None, inputs: dict[str, Any] | None = None, *,
                 node_id: str | None = None) -> None:
        super().__init__(message)
        self.event = event
        self.node = node
        self.message = message
        self.exception_type = exception_type
        self.trace = trace or []
        self.inputs = inputs or {}
        self.node_id = node_id  # for a failure that names a node it could not run

    @classmethod
    def node_raised(cls, node: PromptNode, exc: BaseException, gathered: Any = None) -> "RunFailure":
        """`node` raised `exc` while called with `gathered` (per-input item lists)."""
        inputs = {}
        if isinstance(gathered, dict):
            inputs = {k: _summarise(v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v)
                      for k, v in gathered.items()}
        return cls(ERROR, node, str(exc), type(exc).__name__, _trace(exc), inputs)

    @classmethod
    def interrupted(cls, node: PromptNode | None) -> "RunFailure":
        """The job was interrupted or cancelled (at `node`, or between nodes)."""
        return cls(INTERRUPTED, node)

    @classmethod
    def fault(cls, exc: BaseException) -> "RunFailure":
        """The scheduler itself failed: the job ends, never the process."""
        return cls(ERROR, None, str(exc), type(exc).__name__, _trace(exc))

    @classmethod
    def stuck(cls, node: PromptNode, node_ids: list[str]) -> "RunFailure":
        """The run ended with `node_ids` still waiting for inputs nobody produced."""
        return cls(ERROR, node, f"nodes {node_ids} could never run: their inputs were not produced", "RuntimeError",
                   node_id=node.id)

    def payload(self, prompt_id: str, executed: list[str]) -> dict:
        """The event's payload (`self.event` names the event)."""
        node = self.node
        if self.event == INTERRUPTED:
            return {"prompt_id": prompt_id, "node_id": node.id if node else None,
                    "node_type": node.class_type if node else None, "executed": list(executed),
                    "timestamp": timestamp_ms()}
        payload = {
            "prompt_id": prompt_id,
            "node_id": self.node_id or (node.display_id if node else None),
            "node_type": node.class_type if node else None,
            "executed": list(executed), "exception_message": self.message, "exception_type": self.exception_type,
            "traceback": self.trace, "current_inputs": self.inputs, "current_outputs": {},
            "timestamp": timestamp_ms(),
        }
        if node is not None and self.node_id is None:
            payload["real_node_id"] = node.id
        return payload


def _trace(exc: BaseException) -> list[str]:
    return traceback.format_exception(type(exc), exc, exc.__traceback__)[-8:]


def _summarise(value: Any) -> Any:
    """A short, JSON-friendly picture of an input value for an error report."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__}{tuple(shape)} {getattr(value, 'dtype', '')}".strip()
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(value, str):
        return value if len(value) < 200 else value[:200] + "..."
    if isinstance(value, (list, tuple)):
        return [_summarise(v) for v in value[:8]]
    if isinstance(value, dict):
        return {str(k): _summarise(v) for k, v in list(value.items())[:16]}
    return type(value).__name__
