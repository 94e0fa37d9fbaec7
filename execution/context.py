"""What a running node may reach: its job, its node id, the folders, progress and interruption.

The executor sets the context around each node call; nodes read it with `current()`. It is a
context variable, so async nodes and worker threads each see their own.
"""
from __future__ import annotations

import contextvars
from typing import Any, Callable, TypeVar

from execution.paths import Paths


class ExecutionInterrupted(Exception):
    """Raised inside a node when its job was interrupted or cancelled."""


T = TypeVar("T")

DEFAULT_MAX_LOOP_ITERATIONS = 10_000
DEFAULT_PREVIEW_METHOD = None  # no method set: only jobs that ask get previews (nodes/preview_settings.py)
DEFAULT_PREVIEW_SIZE = 512


class Services:
    """What every node call of one runtime shares: its settings and the objects it keeps across jobs
    (such as the model cache). One is made where a runtime is wired (the server, the CLI, a test's
    executor) and handed to each node call as `RunContext.runtime`.
    """

    __slots__ = ("max_loop_iterations", "preview_method", "preview_size", "_shared")
    SETTINGS = ("max_loop_iterations", "preview_method", "preview_size")

    def __init__(self, *, max_loop_iterations: int = DEFAULT_MAX_LOOP_ITERATIONS,
                 preview_method: str | None = DEFAULT_PREVIEW_METHOD, preview_size: int = DEFAULT_PREVIEW_SIZE) -> None:
        self.max_loop_iterations = max_loop_iterations  # loops refuse more iterations than this
        self.preview_method = preview_method  # how samplers draw live previews (nodes.preview_settings)
        self.preview_size = preview_size  # the long side of a live preview, in pixels
        self._shared: dict[str, Any] = {}

    def shared(self, name: str, make: Callable[[], T]) -> T:
        """The runtime's one object called `name`, made by `make()` on first use."""
        found = self._shared.get(name, _ABSENT)
        if found is _ABSENT:
            found = self._shared[name] = make()
        return found

    def release_shared(self) -> None:
        """Forget every shared object (the loaded models with the model cache), so their memory can
        be freed; each is made again when next asked for."""
        self._shared.clear()


_ABSENT = object()


def _never() -> bool:
    return False


def _drop(event: str, data: dict) -> None:
    return None


# The key of a `progress` event's data that carries the step's text and preview events (see send_progress);
# the executor takes it out before anyone else sees the event.
SHOWN_KEY = "shown_with_step"


class RunContext:
    """One node call's view of its job (a plain slotted class: one is made per node call)."""

    __slots__ = ("prompt_id", "node_id", "display_node_id", "paths", "emit", "is_interrupted", "runtime",
                 "parent_node_id", "real_node_id", "extra_data", "counts", "profile_notes")

    def __init__(self, prompt_id: str, node_id: str, display_node_id: str, paths: Paths,
                 emit: Callable[[str, dict], None] = _drop, is_interrupted: Callable[[], bool] = _never,
                 runtime: Services | None = None, parent_node_id: str | None = None,
                 real_node_id: str | None = None, extra_data: dict[str, Any] | None = None) -> None:
        self.prompt_id = prompt_id
        self.node_id = node_id
        self.display_node_id = display_node_id
        self.paths = paths
        self.emit = emit
        self.is_interrupted = is_interrupted
        self.runtime = runtime if runtime is not None else Services()  # what the runtime's node calls share
        self.parent_node_id = parent_node_id
        self.real_node_id = real_node_id
        self.extra_data = extra_data if extra_data is not None else {}  # the job's options (preview_method, ...)
        self.counts: dict[str, float] = {}  # what the node counted (`count`), added to its profile row
        self.profile_notes: dict[str, list] | None = None  # what the node added to its profile row (note_profile)

    def count(self, name: str, amount: float = 1) -> None:
        """Add `amount` to the node's count `name`; the job's profile shows the counts on the node's row."""
        self.counts[name] = self.counts.get(name, 0) + amount

    def note_profile(self, name: str, value: Any) -> None:
        """Add `value` (a JSON value) to the list `name` in this node's row of the job's profile, under "notes".

        For facts about what a run did that its time and memory do not show (which adapter entries
        bound, for one). Each call appends, so a node called over list inputs notes once per call.
        """
        if self.profile_notes is None:
            self.profile_notes = {}
        self.profile_notes.setdefault(name, []).append(value)

    def check_interrupted(self) -> None:
        if self.is_interrupted():
            raise ExecutionInterrupted(f"job {self.prompt_id} interrupted at node {self.node_id}")

    def progress(self, value: float, total: float, *, text: str | None = None, preview: Any = None) -> None:
        """Report progress (and optionally a progress text or a preview image); checks interruption."""
        self.send_progress(value, total, text=text, preview=preview)
        self.check_interrupted()

    def send_progress(self, value: float, total: float, *, text: str | None = None, preview: Any = None) -> None:
        """Report progress without checking interruption (for a node's helper threads). A text or preview
        travels inside the `progress` event, so the executor can send them in ComfyUI's order within a step:
        `progress_state`, then the preview, then `progress`."""
        data = {"value": value, "max": total, "prompt_id": self.prompt_id, "node": self.node_id,
                "display_node": self.display_node_id}
        shown = self._shown(text, preview)
        if shown:
            data[SHOWN_KEY] = shown
        self.emit("progress", data)

    def show(self, *, text: str | None = None, preview: Any = None) -> None:
        """Send a progress text and/or a preview image for this node, without a progress update."""
        for event, data in self._shown(text, preview):
            self.emit(event, data)

    def _shown(self, text: str | None, preview: Any) -> list[tuple[str, dict]]:
        shown = []
        if text is not None:
            shown.append(("progress_text", {"node": self.display_node_id, "text": text, "prompt_id": self.prompt_id}))
        if preview is not None:
            shown.append(("preview", {"node": self.node_id, "display_node": self.display_node_id,
                                      "prompt_id": self.prompt_id, "image": preview,
                                      "parent_node": self.parent_node_id, "real_node_id": self.real_node_id}))
        return shown


_current: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar("weft_run_context", default=None)
_configured: list[RunContext] = []  # the configured runtime: folders seen outside a node call


def configure(paths: Paths, runtime: Services | None = None) -> None:
    """Set the folders (and shared services) that code outside a node call sees, such as
    validation and /object_info listing the files a choice input offers."""
    _configured[:] = [RunContext(prompt_id="", node_id="", display_node_id="", paths=paths, runtime=runtime)]


def current() -> RunContext:
    """The context of the node now running; outside a job, the configured one (or the working folder)."""
    ctx = _current.get()
    if ctx is None:
        if _configured:
            return _configured[0]
        from pathlib import Path

        ctx = RunContext(prompt_id="", node_id="", display_node_id="", paths=Paths(Path.cwd()))
    return ctx


def activate(ctx: RunContext) -> contextvars.Token:
    return _current.set(ctx)


def deactivate(token: contextvars.Token) -> None:
    _current.reset(token)
