"""Server fixtures: one real server per test module (full node set), and helpers for HTTP calls."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid

import pytest

from tests.web.serve import ServerThread


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real server on a free 127.0.0.1 port with the built-in nodes and the testing pack; stopped after."""
    base = tmp_path_factory.mktemp("weft")
    running = ServerThread(base)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def light_server(tmp_path_factory):
    """A real server with only the testing node pack (fast jobs, no torch)."""
    base = tmp_path_factory.mktemp("weft-light")
    running = ServerThread(base, light=True)
    yield running
    running.stop()


def http(method: str, url: str, body=None, *, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 30) -> tuple[int, dict, bytes]:
    """(status, headers, body) for one request; never raises on an HTTP error status."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def get_json(url: str, **kwargs):
    status, _, body = http("GET", url, **kwargs)
    return status, json.loads(body) if body else None


def post_json(url: str, body, **kwargs):
    status, _, data = http("POST", url, body, **kwargs)
    try:
        return status, json.loads(data) if data else None
    except ValueError:
        return status, data


def const_prompt(value: int = 1, label: str = "") -> dict:
    """A small API prompt: TestConst -> TestOutput."""
    return {"1": {"class_type": "TestConst", "inputs": {"value": value}},
            "2": {"class_type": "TestOutput", "inputs": {"value": ["1", 0], "label": label}}}


def wait_terminal(url: str, prompt_id: str, timeout: float = 60) -> dict:
    """Poll /history/{id} until the job has its record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = get_json(f"{url}/history/{prompt_id}")
        if status == 200 and body:
            return body[prompt_id]
        time.sleep(0.05)
    raise TimeoutError(f"job {prompt_id} did not finish")


def new_id() -> str:
    return str(uuid.uuid4())
