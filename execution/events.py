"""The event stream: every event names its job; the websocket and the CLI are two subscribers."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

EVENT_TYPES = (
    "execution_start", "execution_cached", "executing", "progress", "progress_state", "executed",
    "execution_success", "execution_error", "execution_interrupted", "status",
    # Not JSON frames on the websocket: binary previews and progress texts.
    "preview", "progress_text",
)

Subscriber = Callable[[str, dict[str, Any]], None]


class EventBus:
    """Fan-out of (event type, data) to subscribers. Subscribers must not block."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        with self._lock:
            self._subscribers = [*self._subscribers, subscriber]

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = [s for s in self._subscribers if s is not subscriber]

        return unsubscribe

    @property
    def active(self) -> bool:
        return bool(self._subscribers)

    def emit(self, event: str, data: dict[str, Any]) -> None:
        if event not in EVENT_TYPES:
            raise ValueError(f"unknown event type {event!r}")
        for subscriber in self._subscribers:
            subscriber(event, data)


def timestamp_ms() -> int:
    return int(time.time() * 1000)
