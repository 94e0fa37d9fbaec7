"""A small Chrome DevTools protocol driver for the browser test (headless Chromium, aiohttp websocket)."""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                  "--window-size=1400,900", "--remote-debugging-port=0")


def find_chromium() -> str | None:
    """The Chromium executable, when installed."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium process and a page session attached to it."""

    def __init__(self, executable: str, profile_dir: Path) -> None:
        self.executable = executable
        self.profile_dir = profile_dir
        self.process: subprocess.Popen | None = None
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.session_id: str | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        self.process = subprocess.Popen(
            [self.executable, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile_dir}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        loop = asyncio.get_running_loop()
        url = await asyncio.wait_for(loop.run_in_executor(None, self._devtools_url), 60)
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(url, max_msg_size=0)
        self._reader = asyncio.ensure_future(self._read())
        target = await self.send("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True},
                                   session=False)
        self.session_id = attached["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            await self.send(f"{domain}.enable")

    def _devtools_url(self) -> str:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            match = re.search(r"DevTools listening on (ws://\S+)", line)
            if match:
                return match.group(1)
        raise RuntimeError("chromium exited before it opened the DevTools port")

    async def _read(self) -> None:
        assert self.ws is not None
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if "id" in data and data["id"] in self._waiting:
                future = self._waiting.pop(data["id"])
                if not future.done():
                    future.set_result(data)
            elif "method" in data:
                self.events.append(data)

    async def send(self, method: str, params: dict | None = None, *, session: bool = True, timeout: float = 60) -> dict:
        assert self.ws is not None
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session_id
        future = asyncio.get_running_loop().create_future()
        self._waiting[message_id] = future
        await self.ws.send_str(json.dumps(message))
        reply = await asyncio.wait_for(future, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def evaluate(self, expression: str, *, timeout: float = 60) -> Any:
        """Evaluate JavaScript in the page (awaiting promises) and return its JSON value."""
        result = await self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                      "returnByValue": True}, timeout=timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(f"page exception: {details.get('exception', {}).get('description') or details}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, *, timeout: float = 60, interval: float = 0.25) -> Any:
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"timed out waiting for: {expression}")
            await asyncio.sleep(interval)

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})

    async def screenshot(self, path: Path, *, scale: float = 1.0) -> Path:
        """A PNG of the page, its sides multiplied by `scale`."""
        params: dict = {"format": "png"}
        if scale != 1.0:
            size = await self.evaluate("[window.innerWidth, window.innerHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": scale}
        shot = await self.send("Page.captureScreenshot", params)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads seen so far."""
        errors = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = params.get("args", [])
                errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                errors.append("exception: " + str(details.get("exception", {}).get("description") or details.get("text")))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")
        return errors

    def failed_requests(self, origin: str) -> list[str]:
        """Requests to `origin` that failed or answered 4xx/5xx."""
        urls = {}
        failed = []
        for event in self.events:
            params = event.get("params", {})
            if event["method"] == "Network.requestWillBeSent":
                urls[params["requestId"]] = params["request"]["url"]
            elif event["method"] == "Network.responseReceived":
                response = params["response"]
                if response["url"].startswith(origin) and response["status"] >= 400:
                    failed.append(f"{response['status']} {response['url']}")
            elif event["method"] == "Network.loadingFailed":
                url = urls.get(params["requestId"], "?")
                if url.startswith(origin) and not params.get("canceled"):
                    failed.append(f"failed {url}: {params.get('errorText')}")
        return failed

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.ws is not None:
            await self.ws.close()
        if self.http is not None:
            await self.http.close()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
