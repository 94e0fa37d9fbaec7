"""The event stream: every event names its job; the websocket and the CLI are two subscribers."""
from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

EVENT_TYPES = (
    "execution_start", "execution_cached", "executing", "progress", "progress_state", "executed",
    "execution_success", "execution_error", "execution_interrupted", "status",
    # Not JSON frames on the websocket: binary previews and progress texts.
    "preview", "progress_text",
    # A node pack's own websocket message, already in its wire form: {"sid": client id or None (every
    # client), "frame": JSON text or binary frame bytes} (nodes/pack_server.py).
    "server_message",
    # A log line of a job worker (process or Ray actor), relayed so the server logs it: {"prompt_id", "level",
    # "name", "message"}. Never a websocket frame: the server's log (terminal and logs panel) shows it.
    "log",
    # A node pack put a prompt back on the queue (`PromptServer.instance.prompt_queue.put`, in whichever
    # process its node runs): {"prompt_id", "number", "prompt", "extra_data"}. The server validates and
    # queues it as it does a POST /prompt; never a websocket frame.
    "pack_requeue",
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


PREVIEW_MAX_EDGE = 512  # previews are shrunk to this many pixels on their longer edge
PREVIEW_FORMATS = ("JPEG", "PNG")


@dataclass(frozen=True)
class EncodedPreview:
    """A preview image already encoded (a worker encodes previews before they cross to the server)."""

    format: str  # JPEG | PNG
    data: bytes


def encode_preview(image: Any, *, max_edge: int = PREVIEW_MAX_EDGE) -> EncodedPreview | None:
    """A preview (PIL image, an IMAGE tensor/array in 0..1, or ComfyUI's (format, image, size) tuple) encoded
    as JPEG (or PNG when asked); None when it is not an image."""
    if isinstance(image, EncodedPreview):
        return image
    from PIL import Image

    fmt = "JPEG"
    if isinstance(image, tuple) and len(image) >= 2:
        fmt = str(image[0]).upper() if str(image[0]).upper() in PREVIEW_FORMATS else "JPEG"
        if len(image) >= 3 and isinstance(image[2], int) and image[2] > 0:
            max_edge = image[2]
        image = image[1]
    if not isinstance(image, Image.Image):
        array = image
        if hasattr(array, "detach"):
            array = array.detach().float().cpu().numpy()
        import numpy as np

        array = np.asarray(array, dtype=np.float32)
        while array.ndim > 3:  # (B, H, W, C): the first item of the batch
            array = array[0]
        if array.ndim == 2:
            array = array[:, :, None]
        if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
            return None
        array = (np.clip(array, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
        image = Image.fromarray(array[:, :, 0] if array.shape[-1] == 1 else array)
    if max(image.size) > max_edge:
        image = image.copy()
        image.thumbnail((max_edge, max_edge))
    if fmt == "JPEG" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, quality=85)
    return EncodedPreview(fmt, buffer.getvalue())


def timestamp_ms() -> int:
    return int(time.time() * 1000)
