"""What node packs see as ComfyUI's `PromptServer.instance`: routes, websocket messages, the running job.

Packs reach it as `server.PromptServer.instance` (the `server` compatibility module in
`nodes/compat/`). Each runtime makes one `PackServer` over its event stream and installs it before its
plugins import, so the instance exists while they import and while their nodes run:

- `routes` collects the HTTP routes packs declare at import time; the web server mounts them bare and
  under `/api`, behind its own security middleware (web/server.py). A plugin that fails to load
  leaves none behind.
- `send_sync` / `send` put a message on the runtime's event stream as a `server_message` event whose
  frame is already in its wire form (JSON text, or a binary frame with ComfyUI's big-endian type
  number; an unencoded preview image is encoded here, in the process that made it). In a job worker
  process the event crosses to the server like every other event; the websocket delivers it to the
  client `sid` names, or to every client when `sid` is None.
- `client_id`, `last_node_id` and `last_prompt_id` describe the node call running on the calling
  thread (None outside one); `app` and `loop` are the server's once it runs. Outside a server (a job
  worker, a headless run) `loop` is a loop of our own on a background thread, so coroutines a pack
  schedules there (such as `send`) still run; `app` does not exist there.
- `add_on_prompt_handler` registers a function that sees, and may replace, every body sent to
  `POST /prompt` before it is validated.
- `prompt_queue` is the server's job queue as packs read it (`PackQueue`): running and pending items in
  ComfyUI's form `(number, prompt_id, prompt, extra_data, outputs_to_execute)`, read from the job
  store's file, so a node in a job worker process sees what the server holds; `put` queues a prompt again
  through the server's own path (validated like a POST /prompt). `number` is the counter packs that
  re-queue read and bump.

Any other attribute ComfyUI's server has is absent: reading it raises AttributeError naming it, so a
pack that needs it fails at import with that name.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import struct
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from execution.context import current
from execution.events import EventBus
from execution.job_store import read_active

logger = logging.getLogger(__name__)

SERVER_MESSAGE = "server_message"  # the event type carrying a pack's websocket message


class BinaryEventTypes:
    """ComfyUI's binary websocket frame types (the first big-endian u32 of a binary frame)."""

    PREVIEW_IMAGE = 1
    UNENCODED_PREVIEW_IMAGE = 2  # only as an argument: the image is encoded and sent as PREVIEW_IMAGE
    TEXT = 3
    PREVIEW_IMAGE_WITH_METADATA = 4


IMAGE_FORMAT_NUMBERS = {"JPEG": 1, "PNG": 2}  # the u32 after a PREVIEW_IMAGE frame's type
SUPPORTS = ("custom_nodes_from_web",)  # plugins' WEB_DIRECTORY folders are served to the editor

# Attributes of ComfyUI's server that exist here only in some processes, with why they are missing.
_CONDITIONAL = {
    "app": "the server's aiohttp application exists only in the server process once it has started (not "
           "while packs import, and not in a job worker); declare routes with PromptServer.instance.routes",
}


class PackRoutes(web.RouteTableDef):
    """The aiohttp route table packs add to; a failed plugin's additions are cut off again."""

    def truncate(self, length: int) -> None:
        """Forget every route added after the first `length`."""
        del self._items[length:]


class PackQueue:
    """The server's job queue as packs read and feed it (`PromptServer.instance.prompt_queue`).

    Reads go to the job store's file, read-only, so they answer the same in the server and in a job
    worker process on the same machine. `put` does not write the store: it asks the server to queue the
    prompt (an event that crosses from a worker like every other), which validates it as a POST /prompt.
    """

    def __init__(self, store_file: Path | None, events: EventBus) -> None:
        self._file = store_file
        self._events = events

    def _active(self) -> tuple[list, list]:
        if self._file is None:
            return [], []
        running, pending = read_active(self._file)
        return [tuple(job.queue_item()) for job in running], [tuple(job.queue_item()) for job in pending]

    def get_current_queue(self) -> tuple[list[tuple], list[tuple]]:
        """Two lists, the jobs running and the jobs waiting, as ComfyUI's queue items (see `put`)."""
        return self._active()

    def get_current_queue_volatile(self) -> tuple[list[tuple], list[tuple]]:
        """The same as get_current_queue (each call reads the store afresh)."""
        return self._active()

    @property
    def currently_running(self) -> dict[int, tuple]:
        """The running items by a small index, as ComfyUI's queue keeps them."""
        return dict(enumerate(self._active()[0]))

    def get_tasks_remaining(self) -> int:
        """How many jobs are running or waiting."""
        running, pending = self._active()
        return len(running) + len(pending)

    def put(self, item: Any) -> None:
        """Queue a prompt again. `item` has the shape of a queue item: a tuple of the queue number, a prompt id
        (a fresh one replaces anything not a UUID), the API prompt, its extra data and, ignored here, the
        output ids. The server validates it; one it refuses is logged there, naming the prompt id."""
        if self._file is None or not self._file.is_file():
            raise RuntimeError("PromptServer.instance.prompt_queue.put: there is no server queue in this run "
                               "(a headless `main.py run`); start Weft's server to queue prompts from a node")
        if not isinstance(item, (tuple, list)) or len(item) < 3 or not isinstance(item[2], dict):
            raise TypeError("prompt_queue.put needs a queue item: a tuple whose third entry is the API prompt "
                            f"as a dict; got {type(item).__name__}")
        number = item[0] if isinstance(item[0], (int, float)) and not isinstance(item[0], bool) else None
        try:
            prompt_id = str(uuid.UUID(str(item[1])))
        except ValueError:
            prompt_id = str(uuid.uuid4())
        extra_data = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
        data = {"prompt_id": prompt_id, "number": number, "prompt": item[2], "extra_data": extra_data}
        ctx = current()
        (ctx.emit if ctx.prompt_id else self._events.emit)("pack_requeue", data)


class PackServer:
    """One runtime's answer to ComfyUI's PromptServer, as far as Weft can make it real (see the module)."""

    instance: "PackServer"  # the installed one (ComfyUI packs read PromptServer.instance)

    def __init__(self, events: EventBus | None = None, *, queue_file: Path | None = None) -> None:
        self.number = 0  # ComfyUI's prompt counter: packs that re-queue read and bump it
        self.routes = PackRoutes()
        self.supports = list(SUPPORTS)
        self._events = events if events is not None else EventBus()
        self._prompt_handlers: list[Callable[[dict], dict]] = []
        self._app: web.Application | None = None
        self._server_loop: asyncio.AbstractEventLoop | None = None
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._own_loop_lock = threading.Lock()
        self.prompt_queue = PackQueue(queue_file, self._events)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        reason = _CONDITIONAL.get(name, "Weft's compatibility layer does not provide it")
        raise AttributeError(f"PromptServer.instance has no attribute {name!r}: {reason} (provided: routes, send_sync, "
                             "send, send_json, send_bytes, send_progress_text, client_id, last_node_id, "
                             "last_prompt_id, loop, app, add_on_prompt_handler, supports, prompt_queue, number)")

    # ------------------------------------------------------------------ the running job
    @property
    def client_id(self) -> str | None:
        """The websocket client that submitted the job whose node runs on this thread (None outside one)."""
        ctx = current()
        return ctx.extra_data.get("client_id") if ctx.prompt_id else None

    @property
    def last_node_id(self) -> str | None:
        """The id of the node running on this thread, as the editor shows it (None outside a node call)."""
        ctx = current()
        return ctx.display_node_id if ctx.prompt_id else None

    @property
    def last_prompt_id(self) -> str | None:
        """The id of the job whose node runs on this thread (None outside a node call)."""
        return current().prompt_id or None

    # ------------------------------------------------------------------ the server
    @property
    def app(self) -> web.Application:
        """The server's aiohttp application, once the server runs in this process."""
        if self._app is None:
            raise AttributeError(f"PromptServer.instance.app is not available: {_CONDITIONAL['app']}")
        return self._app

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop; outside a running server, a loop on a background thread of our own."""
        if self._server_loop is not None:
            return self._server_loop
        with self._own_loop_lock:
            if self._own_loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="weft-pack-loop", daemon=True).start()
                self._own_loop = loop
            return self._own_loop

    def attach(self, app: web.Application, loop: asyncio.AbstractEventLoop) -> None:
        """The server started: `app` and `loop` are now the server's."""
        self._app, self._server_loop = app, loop

    def detach(self, app: web.Application) -> None:
        """The server `app` stopped (another one attached since is left alone)."""
        if self._app is app:
            self._app, self._server_loop = None, None

    # ------------------------------------------------------------------ prompts
    def add_on_prompt_handler(self, handler: Callable[[dict], dict]) -> None:
        """Call `handler(body)` on every body sent to POST /prompt, before validation; it returns the body to use."""
        if not callable(handler):
            raise TypeError(f"add_on_prompt_handler needs a function taking and returning the request body, "
                            f"got {type(handler).__name__}")
        self._prompt_handlers.append(handler)

    def trigger_on_prompt(self, body: dict) -> dict:
        """`body` after every prompt handler; a handler that raises or returns no dict is logged and skipped."""
        for handler in list(self._prompt_handlers):
            name = getattr(handler, "__qualname__", repr(handler))
            try:
                changed = handler(body)
            except Exception:
                logger.warning("prompt handler %s (%s) raised; the body goes on unchanged", name,
                               getattr(handler, "__module__", "?"), exc_info=True)
                continue
            if not isinstance(changed, dict):
                logger.warning("prompt handler %s returned %s instead of the request body; ignored", name,
                               type(changed).__name__)
                continue
            body = changed
        return body

    @property
    def has_prompt_handlers(self) -> bool:
        """Whether any pack registered a prompt handler."""
        return bool(self._prompt_handlers)

    # ------------------------------------------------------------------ what a failed plugin added
    def mark(self) -> tuple[int, int]:
        """How many routes and prompt handlers exist now (for `rollback`)."""
        return len(self.routes), len(self._prompt_handlers)

    def rollback(self, mark: tuple[int, int]) -> None:
        """Forget the routes and prompt handlers added since `mark` (a plugin that failed to load)."""
        self.routes.truncate(mark[0])
        del self._prompt_handlers[mark[1]:]

    # ------------------------------------------------------------------ websocket messages
    def send_sync(self, event: str | int, data: Any, sid: str | None = None) -> None:
        """Send a websocket message to client `sid` (every client when None): JSON `{type, data}` for a
        string event; a binary frame for an int event with bytes; an image for UNENCODED_PREVIEW_IMAGE
        with `(format, PIL image, max size or None)`. Callable from any thread."""
        if sid is not None and not isinstance(sid, str):
            raise TypeError(f"send_sync: sid must be a client id string or None, got {type(sid).__name__}")
        message = {"sid": sid, "frame": websocket_frame(event, data)}
        ctx = current()
        if ctx.prompt_id:  # inside a node call: the job's own event stream
            ctx.emit(SERVER_MESSAGE, message)
        else:
            self._events.emit(SERVER_MESSAGE, message)

    async def send(self, event: str | int, data: Any, sid: str | None = None) -> None:
        """The coroutine form of `send_sync`."""
        self.send_sync(event, data, sid)

    async def send_json(self, event: str, data: Any, sid: str | None = None) -> None:
        """Send `{type: event, data}` as a JSON text frame."""
        if not isinstance(event, str):
            raise TypeError(f"send_json: event must be a string, got {type(event).__name__}")
        self.send_sync(event, data, sid)

    async def send_bytes(self, event: int, data: bytes, sid: str | None = None) -> None:
        """Send a binary frame: the big-endian u32 `event`, then `data`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"send_bytes: data must be bytes, got {type(data).__name__}")
        self.send_sync(event, data, sid)

    def send_progress_text(self, text: str, node_id: str, sid: str | None = None) -> None:
        """Send a progress text frame (type TEXT: u32 length of the node id, the id, then the text)."""
        node = str(node_id).encode("utf-8")
        self.send_sync(BinaryEventTypes.TEXT, struct.pack(">I", len(node)) + node + str(text).encode("utf-8"), sid)


# ---------------------------------------------------------------------- wire forms
def websocket_frame(event: str | int, data: Any) -> str | bytes:
    """The websocket payload `send_sync(event, data)` stands for: JSON text or a binary frame."""
    if event == BinaryEventTypes.UNENCODED_PREVIEW_IMAGE and not isinstance(event, bool):
        return struct.pack(">I", BinaryEventTypes.PREVIEW_IMAGE) + encoded_image(data)
    if isinstance(data, (bytes, bytearray, memoryview)):
        if not isinstance(event, int) or isinstance(event, bool) or not 0 <= event < 2**32:
            raise TypeError(f"send_sync: binary data needs an integer event type (BinaryEventTypes), got {event!r}")
        return struct.pack(">I", event) + bytes(data)
    if not isinstance(event, str):
        raise TypeError(f"send_sync: event {event!r} with {type(data).__name__} data: a JSON message needs a "
                        "string event name, and an integer event type needs bytes")
    return json.dumps({"type": event, "data": data}, default=repr)


def encoded_image(data: Any) -> bytes:
    """u32 format number + image bytes for an UNENCODED_PREVIEW_IMAGE `(format, PIL image, max size)`."""
    from PIL import Image, ImageOps

    if not isinstance(data, (tuple, list)) or len(data) != 3:
        raise TypeError("send_sync: UNENCODED_PREVIEW_IMAGE data must be (format, PIL image, max size or None), "
                        f"got {type(data).__name__}")
    image_format, image, max_size = data
    image_format = str(image_format).upper()
    if image_format not in IMAGE_FORMAT_NUMBERS:
        raise ValueError(f"send_sync: image format {image_format!r} is not one of {', '.join(IMAGE_FORMAT_NUMBERS)}")
    if not isinstance(image, Image.Image):
        raise TypeError(f"send_sync: UNENCODED_PREVIEW_IMAGE needs a PIL image, got {type(image).__name__}")
    if max_size is not None:
        image = ImageOps.contain(image, (int(max_size), int(max_size)), Image.Resampling.BILINEAR)
    if image_format == "JPEG" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, quality=95, compress_level=1)
    return struct.pack(">I", IMAGE_FORMAT_NUMBERS[image_format]) + buffer.getvalue()


# ---------------------------------------------------------------------- the installed instance
PackServer.instance = PackServer()  # until a runtime installs its own: packs can always import


def install(server: PackServer) -> PackServer:
    """Make `server` the PromptServer.instance packs see (a runtime does this before its plugins import)."""
    PackServer.instance = server
    return server


def installed() -> PackServer:
    """The PromptServer.instance packs see now."""
    return PackServer.instance
