"""The editor's logs panel: the server process's recent log lines, and new ones pushed to subscribers.

`/internal/logs` answers the recent lines as one text, `/internal/logs/raw` as `{entries: [{t, m}], size:
{cols, rows}}`, and `PATCH /internal/logs/subscribe` (`{clientId, enabled}`) turns on or off a `logs`
websocket event for that client with each new batch of lines (ComfyUI's shapes).

One log for every process of a job: the server logs each accepted prompt ("got prompt"), each run's end
with its time, and a failed node's error with its traceback (`JobLog`, fed by the engine's events, which
reach the server from whichever worker ran the job); a job worker (a child process or a Ray actor) sends
its own log lines as `log` events (execution/worker.py), which `JobLog` logs here under their own logger
name. All of it goes through the server's logging, so the terminal and the logs panel show the same lines.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import shutil
import threading
from collections import deque
from typing import Any

from aiohttp import web

from web.security import json_error
from web.state import STATE_KEY

LOG_LINES_KEPT = 1000
TERMINAL_FALLBACK = (120, 40)  # columns, rows reported when the server has no terminal


class LogBuffer(logging.Handler):
    """A logging handler keeping the last `capacity` lines and pushing new ones to subscribed clients."""

    def __init__(self, capacity: int = LOG_LINES_KEPT) -> None:
        super().__init__(level=logging.INFO)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.entries: deque[dict[str, str]] = deque(maxlen=capacity)
        self.subscribers: set[str] = set()
        # Not `self.lock`: logging.Handler already holds that one around every emit.
        self.entries_lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.hub: Any = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stamp = datetime.datetime.fromtimestamp(record.created).isoformat(timespec="milliseconds")
            entry = {"t": stamp, "m": self.format(record) + "\n"}
        except Exception:  # a record that cannot be formatted is left out, never raised into the caller
            return
        with self.entries_lock:
            self.entries.append(entry)
            clients = list(self.subscribers)
        if clients and self.loop is not None and self.hub is not None:
            data = {"entries": [entry], "size": terminal_size()}
            try:
                self.loop.call_soon_threadsafe(self._push, clients, data)
            except RuntimeError:  # the loop is closed: the server is stopping
                pass

    def _push(self, clients: list[str], data: dict) -> None:
        for client in clients:
            if client in self.hub.clients:
                self.hub.send_json("logs", data, client)

    def snapshot(self) -> list[dict[str, str]]:
        """The kept lines, oldest first."""
        with self.entries_lock:
            return list(self.entries)


def terminal_size() -> dict[str, int]:
    """The server's terminal size as the panel wants it (a fallback when it has none)."""
    size = shutil.get_terminal_size(TERMINAL_FALLBACK)
    return {"cols": size.columns, "rows": size.lines}


LOGS_KEY = web.AppKey("weft_logs", LogBuffer)


async def get_logs(request: web.Request) -> web.Response:
    """The recent lines as one text."""
    return web.json_response("".join(f"{e['t']} - {e['m']}" for e in request.app[LOGS_KEY].snapshot()))


async def get_raw_logs(request: web.Request) -> web.Response:
    """The recent lines and the terminal size."""
    return web.json_response({"entries": request.app[LOGS_KEY].snapshot(), "size": terminal_size()})


async def patch_subscribe(request: web.Request) -> web.Response:
    """Turn the `logs` websocket event on or off for one client."""
    try:
        body = await request.json()
    except ValueError:
        return json_error(400, "the body must be JSON: {\"clientId\": ..., \"enabled\": true|false}")
    if not isinstance(body, dict) or not isinstance(body.get("clientId"), str) or \
            not isinstance(body.get("enabled"), bool):
        return json_error(400, "expected {\"clientId\": string, \"enabled\": true|false}")
    buffer = request.app[LOGS_KEY]
    with buffer.entries_lock:
        if body["enabled"]:
            buffer.subscribers.add(body["clientId"])
        else:
            buffer.subscribers.discard(body["clientId"])
    return web.Response(status=200)


def add_routes(table: list[tuple[str, str, Any]]) -> None:
    """Append the log routes (registered bare and under /api)."""
    table.extend([("GET", "/internal/logs", get_logs), ("GET", "/internal/logs/raw", get_raw_logs),
                  ("PATCH", "/internal/logs/subscribe", patch_subscribe)])


class JobLog:
    """An event subscriber that logs what a person follows a job by: its run time or its failure with the
    node's traceback, and the log lines its worker sent."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}  # prompt id -> execution_start timestamp (ms)
        self.logger = logging.getLogger("weft.jobs")
        self.logger.setLevel(logging.INFO)  # shown even where the root logger is left at WARNING

    def __call__(self, event: str, data: dict) -> None:
        prompt_id = data.get("prompt_id")
        if event == "log":
            logging.getLogger(str(data.get("name") or "weft.worker")).log(
                int(data.get("level") or logging.INFO), "%s", data.get("message", ""))
        elif event == "execution_start" and prompt_id:
            self.started[prompt_id] = float(data.get("timestamp") or 0.0)
        elif event in ("execution_success", "execution_error", "execution_interrupted") and prompt_id:
            began = self.started.pop(prompt_id, None)
            ended = float(data.get("timestamp") or 0.0)
            took = f" in {(ended - began) / 1000.0:.2f} seconds" if began and ended >= began else ""
            if event == "execution_success":
                self.logger.info("prompt %s executed%s", prompt_id, took)
            elif event == "execution_interrupted":
                self.logger.info("prompt %s interrupted at node %s%s", prompt_id, data.get("node_id"), took)
            else:
                trace = "".join(data.get("traceback") or [])
                self.logger.error("prompt %s failed%s: node %s (%s): %s: %s%s", prompt_id, took, data.get("node_id"),
                                  data.get("node_type"), data.get("exception_type"), data.get("exception_message"),
                                  f"\n{trace.rstrip()}" if trace else "")


def install(app: web.Application) -> None:
    """Keep the process's log lines for this application while it runs, with the jobs' own lines."""
    buffer = app[LOGS_KEY] = LogBuffer()
    unsubscribe: list = []

    async def start(app: web.Application) -> None:
        buffer.loop, buffer.hub = asyncio.get_running_loop(), app[STATE_KEY].hub
        logging.getLogger().addHandler(buffer)
        unsubscribe.append(app[STATE_KEY].runtime.events.subscribe(JobLog()))

    async def stop(app: web.Application) -> None:
        logging.getLogger().removeHandler(buffer)
        while unsubscribe:
            unsubscribe.pop()()
        buffer.loop = None

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
