"""What a running node may reach: its job, its node id, the folders, progress and interruption.

The executor sets the context around each node call; nodes read it with `current()`. It is a
context variable, so async nodes and worker threads each see their own.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable

from execution.paths import Paths


class ExecutionInterrupted(Exception):
    """Raised inside a node when its job was interrupted or cancelled."""


@dataclass
class RunContext:
    """One node call's view of its job."""

    prompt_id: str
    node_id: str
    display_node_id: str
    paths: Paths
    emit: Callable[[str, dict], None] = lambda event, data: None
    is_interrupted: Callable[[], bool] = lambda: False
    runtime: dict[str, Any] = field(default_factory=dict)  # shared services (memory manager, model cache)
    parent_node_id: str | None = None
    real_node_id: str | None = None

    def check_interrupted(self) -> None:
        if self.is_interrupted():
            raise ExecutionInterrupted(f"job {self.prompt_id} interrupted at node {self.node_id}")

    def progress(self, value: float, total: float, *, text: str | None = None, preview: Any = None) -> None:
        """Report progress (and optionally a progress text or a preview image); checks interruption."""
        self.emit("progress", {
            "value": value, "max": total, "prompt_id": self.prompt_id, "node": self.node_id,
            "display_node": self.display_node_id,
        })
        if text is not None:
            self.emit("progress_text", {"node": self.display_node_id, "text": text, "prompt_id": self.prompt_id})
        if preview is not None:
            self.emit("preview", {"node": self.node_id, "display_node": self.display_node_id,
                                  "prompt_id": self.prompt_id, "image": preview,
                                  "parent_node": self.parent_node_id, "real_node_id": self.real_node_id})
        self.check_interrupted()


_current: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar("weft_run_context", default=None)


def current() -> RunContext:
    """The context of the node now running; outside a job, a context rooted at the working folder."""
    ctx = _current.get()
    if ctx is None:
        from pathlib import Path

        ctx = RunContext(prompt_id="", node_id="", display_node_id="", paths=Paths(Path.cwd()))
    return ctx


def activate(ctx: RunContext) -> contextvars.Token:
    return _current.set(ctx)


def deactivate(token: contextvars.Token) -> None:
    _current.reset(token)
