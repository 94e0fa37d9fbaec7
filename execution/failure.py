"""Why a job stopped early: the one builder of `execution_error` and `execution_interrupted` payloads
(the wire shapes the editor reads), and the exception a run raises to end a job early.

Every early end goes through `failure_payload`, whoever sees it: a node or the scheduler
(`RunFailure`), a worker that could not run the job (`execution.worker.failure_outcome`), the runner
stopping a job from outside (`interrupted_outcome`), the store after a crash or a cancel
(`execution.job_store`). So every record and event of a failure has the same fields."""
from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any, Iterable

from execution.events import timestamp_ms

if TYPE_CHECKING:
    from execution.graph import PromptNode

ERROR = "execution_error"
INTERRUPTED = "execution_interrupted"


def failure_payload(event: str, prompt_id: str, *, node_id: str | None = None, node_type: str | None = None,
                    executed: Iterable[str] = (), exception_type: str | None = None, message: str | None = None,
                    trace: list[str] | None = None, inputs: dict | None = None, **more: Any) -> dict:
    """The payload of `event` (ERROR or INTERRUPTED) for job `prompt_id`.

    An error always carries the exception, its trace and the inputs the node was given (empty when no
    node ran); an interruption names an exception only when something other than the user stopped the
    job (its worker killed, a crash). `more` adds fields some ends have (`real_node_id`, `details`)."""
    payload: dict[str, Any] = {"prompt_id": prompt_id, "node_id": node_id, "node_type": node_type,
                               "executed": list(executed)}
    if event == ERROR:
        payload.update({"exception_message": message or "", "exception_type": exception_type or "",
                        "traceback": list(trace or []), "current_inputs": dict(inputs or {}),
                        "current_outputs": {}})
    elif event == INTERRUPTED:
        if exception_type is not None:
            payload.update({"exception_type": exception_type, "exception_message": message or ""})
    else:
        raise ValueError(f"a failure payload is for {ERROR} or {INTERRUPTED}, not {event!r}")
    payload["timestamp"] = timestamp_ms()
    payload.update(more)
    return payload


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
            return failure_payload(INTERRUPTED, prompt_id, node_id=node.id if node else None,
                                   node_type=node.class_type if node else None, executed=executed)
        more = {"real_node_id": node.id} if node is not None and self.node_id is None else {}
        return failure_payload(ERROR, prompt_id, node_id=self.node_id or (node.display_id if node else None),
                               node_type=node.class_type if node else None, executed=executed,
                               exception_type=self.exception_type, message=self.message, trace=self.trace,
                               inputs=self.inputs, **more)


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
