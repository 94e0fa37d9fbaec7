"""The websocket: clients, their bounded send queues, and the engine's events turned into frames.

Events arrive on the job runner's thread (relayed from the worker process, which has already encoded
previews as JPEG/PNG); `EventBridge` makes frames there (JSON text, or binary previews and progress
texts) and hands finished frames to the event loop with `call_soon_threadsafe`.
`Hub.deliver` then routes a frame to the client that submitted the job and to clients that subscribed
to every job (a job without a client id goes to everyone, as in ComfyUI). A node pack's own message
(`server_message`, already a finished frame) goes to the one client it names, or to every client.

Each client has its own queue and sender task, so a slow client never slows the others. The queue is
bounded in frames and bytes: previews are dropped first (a newer one follows anyway); a client whose
queue is still over the bound with frames it must not lose is disconnected once it has stopped reading
(no frame sent for `stall_s` seconds), or at once past `HARD_LIMIT_FACTOR` times the bound. A burst
queued at once for a client that is reading (a large batch of events) is delivered, not punished.
"""
from __future__ import annotations

import asyncio
import json
import logging
import struct
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import WSMsgType, web

from execution.events import PREVIEW_MAX_EDGE, encode_preview

logger = logging.getLogger(__name__)

# Binary frame types (big-endian u32 first), as ComfyUI's editor reads them.
PREVIEW_IMAGE = 1
PROGRESS_TEXT = 3
PREVIEW_IMAGE_WITH_METADATA = 4
IMAGE_FORMATS = {"JPEG": 1, "PNG": 2}

MAX_QUEUE_FRAMES = 8192  # frames waiting for one client before it counts as not reading (~1 MB of events)
MAX_QUEUE_BYTES = 16 * 2**20  # bytes waiting for one client
PREVIEW_BACKLOG = 8  # a new preview is dropped when this many frames already wait
SEND_TIMEOUT_S = 30.0  # a single send blocked this long means the client stopped reading
STALL_S = 5.0  # over the bound and no frame sent for this long: the client stopped reading
HARD_LIMIT_FACTOR = 8  # over this many times the bound, a client is dropped even while it reads
TERMINAL_EVENTS = ("execution_success", "execution_error", "execution_interrupted")


@dataclass
class Frame:
    """One websocket message: text (JSON) or bytes, and whether it may be dropped under pressure."""

    payload: str | bytes
    droppable: bool = False

    @property
    def size(self) -> int:
        """Bytes this frame holds."""
        return len(self.payload)


@dataclass
class Client:
    """One connected websocket and its send queue."""

    sid: str
    ws: web.WebSocketResponse
    subscribed_all: bool = False
    supports_preview_metadata: bool = False
    queue: deque = field(default_factory=deque)
    queued_bytes: int = 0
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    dropped_previews: int = 0
    task: asyncio.Task | None = None
    progress_at: float = 0.0  # monotonic time of the last frame sent, or of the queue filling from empty


class Hub:
    """Connected clients by sid; routes frames and keeps each client's queue bounded. Loop-only."""

    def __init__(self, *, max_frames: int = MAX_QUEUE_FRAMES, max_bytes: int = MAX_QUEUE_BYTES,
                 preview_backlog: int = PREVIEW_BACKLOG, send_timeout_s: float = SEND_TIMEOUT_S,
                 stall_s: float = STALL_S) -> None:
        self.clients: dict[str, Client] = {}
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.stall_s = stall_s
        self.preview_backlog = preview_backlog
        self.send_timeout_s = send_timeout_s
        self.disconnected_slow = 0  # clients dropped for not reading (for tests and the benchmark)

    # ------------------------------------------------------------------ routing
    def targets(self, client_id: str | None) -> list[Client]:
        """The submitting client plus every subscribed-to-all client (everyone when no client id)."""
        if client_id is None:
            return list(self.clients.values())
        out = [c for c in self.clients.values() if c.subscribed_all and c.sid != client_id]
        owner = self.clients.get(client_id)
        if owner is not None:
            out.append(owner)
        return out

    def send_json(self, event: str, data: dict, client_id: str | None = None, *, broadcast: bool = False) -> None:
        """Queue a JSON event for the job's audience (or every client when `broadcast`)."""
        text = json.dumps({"type": event, "data": data}, default=repr)
        targets = list(self.clients.values()) if broadcast else self.targets(client_id)
        for client in targets:
            self.enqueue(client, Frame(text))

    def deliver(self, frames: list[tuple[str, Any]], client_id: str | None, *, only: bool = False) -> None:
        """Frames made by the bridge: ("json", text) | ("binary", bytes) | ("preview", (legacy, with_meta)).

        With `only`, they go to client `client_id` alone (a node pack's message addressed to one client)."""
        if only:
            targets = [self.clients[client_id]] if client_id in self.clients else []
        else:
            targets = self.targets(client_id)
        for kind, payload in frames:
            for client in targets:
                if kind == "preview":
                    legacy, with_meta = payload
                    self.enqueue(client, Frame(with_meta if client.supports_preview_metadata else legacy, True))
                else:
                    self.enqueue(client, Frame(payload))

    # ------------------------------------------------------------------ queues
    def enqueue(self, client: Client, frame: Frame) -> None:
        """Queue a frame for one client, dropping previews first and disconnecting a client that stopped reading."""
        if client.closed:
            return
        if frame.droppable and len(client.queue) >= self.preview_backlog:
            client.dropped_previews += 1
            return
        if not client.queue:
            client.progress_at = time.monotonic()  # nothing was waiting: the client is not behind
        client.queue.append(frame)
        client.queued_bytes += frame.size
        if self._over(client, 1):
            self._drop_previews(client)
        if self._over(client, 1) and (self._over(client, HARD_LIMIT_FACTOR)
                                      or time.monotonic() - client.progress_at > self.stall_s):
            logger.warning("websocket client %s stopped reading (%d frames, %d bytes waiting): disconnecting",
                           client.sid, len(client.queue), client.queued_bytes)
            self.disconnected_slow += 1
            self._close(client)
            return
        client.wakeup.set()

    def _over(self, client: Client, factor: int) -> bool:
        return len(client.queue) > factor * self.max_frames or client.queued_bytes > factor * self.max_bytes

    def _drop_previews(self, client: Client) -> None:
        kept = deque(f for f in client.queue if not f.droppable)
        client.dropped_previews += len(client.queue) - len(kept)
        client.queue = kept
        client.queued_bytes = sum(f.size for f in kept)

    def _close(self, client: Client) -> None:
        client.closed = True
        client.queue.clear()
        client.queued_bytes = 0
        client.wakeup.set()
        if self.clients.get(client.sid) is client:
            del self.clients[client.sid]
        asyncio.ensure_future(client.ws.close(code=1008, message=b"send queue full: the client stopped reading"))

    async def _sender(self, client: Client) -> None:
        ws = client.ws
        try:
            while not client.closed:
                if not client.queue:
                    client.wakeup.clear()
                    await client.wakeup.wait()
                    continue
                frame = client.queue.popleft()
                client.queued_bytes -= frame.size
                send = ws.send_str(frame.payload) if isinstance(frame.payload, str) else ws.send_bytes(frame.payload)
                await asyncio.wait_for(send, self.send_timeout_s)
                client.progress_at = time.monotonic()
        except asyncio.TimeoutError:
            logger.warning("websocket client %s blocked a send for %ss: disconnecting", client.sid,
                           self.send_timeout_s)
            self.disconnected_slow += 1
            self._close(client)
        except (ConnectionError, RuntimeError):  # the peer went away
            client.closed = True
        except asyncio.CancelledError:
            raise

    # ------------------------------------------------------------------ connections
    async def handle(self, request: web.Request, *, status: Callable[[], dict], features: dict) -> web.WebSocketResponse:
        """Serve one websocket connection until it closes."""
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=1 * 2**20)
        await ws.prepare(request)
        sid = request.query.get("clientId") or uuid.uuid4().hex
        old = self.clients.get(sid)
        if old is not None:  # a reconnect with the same id replaces the old socket
            self._close(old)
        client = Client(sid, ws, subscribed_all=request.query.get("subscribe") == "all")
        self.clients[sid] = client
        client.task = asyncio.ensure_future(self._sender(client))
        self.enqueue(client, Frame(json.dumps({"type": "status", "data": {"status": status(), "sid": sid}})))
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    continue
                try:
                    parsed = json.loads(message.data)
                except ValueError:
                    continue
                if not isinstance(parsed, dict):
                    continue
                kind, data = parsed.get("type"), parsed.get("data")
                if kind == "feature_flags":
                    if isinstance(data, dict):
                        client.supports_preview_metadata = bool(data.get("supports_preview_metadata"))
                    self.enqueue(client, Frame(json.dumps({"type": "feature_flags", "data": features})))
                elif kind == "subscribe":
                    # Weft's addition: {"type": "subscribe", "data": {"jobs": "all" | "own"}}.
                    client.subscribed_all = isinstance(data, dict) and data.get("jobs") == "all"
        finally:
            client.closed = True
            client.wakeup.set()
            if self.clients.get(sid) is client:
                del self.clients[sid]
            if client.task is not None:
                client.task.cancel()
        return ws

    async def close_all(self) -> None:
        """Close every websocket (server shutdown)."""
        for client in list(self.clients.values()):
            client.closed = True
            client.wakeup.set()
            await client.ws.close(code=1001, message=b"server shutdown")
        self.clients.clear()


# ---------------------------------------------------------------------- encoding (worker thread)
def encode_preview_image(image: Any, *, max_edge: int = PREVIEW_MAX_EDGE) -> tuple[str, bytes] | None:
    """A preview (PIL image, IMAGE tensor/array, ComfyUI's (format, image, size) tuple, or one a worker
    already encoded) as (format, bytes)."""
    encoded = encode_preview(image, max_edge=max_edge)
    return None if encoded is None else (encoded.format, encoded.data)


def preview_frames(data: dict) -> tuple[bytes, bytes] | None:
    """(type 1 frame, type 4 frame) for a `preview` event."""
    encoded = encode_preview_image(data.get("image"))
    if encoded is None:
        return None
    fmt, image_bytes = encoded
    legacy = struct.pack(">II", PREVIEW_IMAGE, IMAGE_FORMATS[fmt]) + image_bytes
    metadata = json.dumps({
        "image_type": "image/jpeg" if fmt == "JPEG" else "image/png",
        "node_id": data.get("node"), "display_node_id": data.get("display_node") or data.get("node"),
        "parent_node_id": data.get("parent_node"), "real_node_id": data.get("real_node_id") or data.get("node"),
        "prompt_id": data.get("prompt_id"),
    }).encode()
    with_meta = struct.pack(">II", PREVIEW_IMAGE_WITH_METADATA, len(metadata)) + metadata + image_bytes
    return legacy, with_meta


def progress_text_frame(data: dict) -> bytes:
    """A type 3 frame: u32 length + node id, then the UTF-8 text."""
    node = str(data.get("node") or "").encode()
    return struct.pack(">II", PROGRESS_TEXT, len(node)) + node + str(data.get("text", "")).encode()


class EventBridge:
    """Subscriber of the engine's EventBus: encodes events on the worker thread, delivers on the loop.

    Terminal events of a job (execution_success/error/interrupted and the final `executing` with node
    null) are held back until the job's record is written, so a client that asks `/history/{id}` the
    moment it hears the job is over finds the record there.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, hub: Hub, client_of: Callable[[str], str | None]) -> None:
        self.loop = loop
        self.hub = hub
        self.client_of = client_of
        self._held: dict[str, list[tuple[str, Any]]] = {}
        # Frames cross to the loop in batches: one wake-up per burst, not one per event.
        self._outbox: list[tuple[list[tuple[str, Any]], str | None]] = []
        self._outbox_lock = threading.Lock()

    def __call__(self, event: str, data: dict) -> None:
        if event in ("log", "pack_requeue"):
            return  # a worker's log line (web/logs.py shows it) or a pack's re-queue (web/state.py): no frame
        prompt_id = data.get("prompt_id")
        if not self.hub.clients and event not in TERMINAL_EVENTS and not (event == "executing" and data.get("node") is None):
            return  # nobody listens: skip the encoding work
        if event == "preview":
            if not self.hub.clients:
                return
            try:
                frames = preview_frames(data)
            except Exception:  # a preview that cannot be encoded is skipped, never fails the job
                logger.debug("preview could not be encoded", exc_info=True)
                return
            if frames is not None:
                self._post([("preview", frames)], prompt_id)
            return
        if event == "progress_text":
            self._post([("binary", progress_text_frame(data))], prompt_id)
            return
        if event == "server_message":  # a node pack's message: to the client it names, or to everyone
            frame, sid = data.get("frame"), data.get("sid")
            if isinstance(frame, (str, bytes)):
                self._queue([("json" if isinstance(frame, str) else "binary", frame)], sid, only=sid is not None)
            return
        frame = ("json", json.dumps({"type": event, "data": data}, default=repr))
        if prompt_id is not None and (event in TERMINAL_EVENTS or (event == "executing" and data.get("node") is None)):
            self._held.setdefault(prompt_id, []).append(frame)
            return
        self._post([frame], prompt_id)

    def job_finished(self, prompt_id: str, *, drop: bool = False) -> None:
        """The job's record is on disk: release its held terminal events (or drop them)."""
        held = self._held.pop(prompt_id, [])
        if held and not drop:
            self._post(held, prompt_id)

    def _post(self, frames: list[tuple[str, Any]], prompt_id: str | None) -> None:
        self._queue(frames, self.client_of(prompt_id) if prompt_id else None)

    def _queue(self, frames: list[tuple[str, Any]], client_id: str | None, *, only: bool = False) -> None:
        with self._outbox_lock:
            first = not self._outbox
            self._outbox.append((frames, client_id, only))
        if first:
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed: the server is stopping
                pass

    def _flush(self) -> None:
        with self._outbox_lock:
            batch, self._outbox = self._outbox, []
        for frames, client_id, only in batch:
            self.hub.deliver(frames, client_id, only=only)
