"""Errors raised as exceptions carry the same page headers as any response; error JSON says what it is;
a preview's download name cannot break out of its quotes."""
from __future__ import annotations

import json
import urllib.parse

import pytest

from tests.web.conftest import http
from tests.web.serve import ServerThread
from tests.web.test_hardening import _chunked_post
from tests.web.test_routes import png_bytes


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    running = ServerThread(tmp_path_factory.mktemp("error-headers"), light=True, extra_args=["--max-upload-size", "1"])
    yield running
    running.stop()


def _has_page_headers(headers: dict) -> None:
    assert "frame-ancestors 'self'" in headers.get("Content-Security-Policy", ""), headers
    assert headers.get("X-Frame-Options") == "SAMEORIGIN", headers
    assert headers.get("X-Content-Type-Options") == "nosniff", headers


def test_a_405_carries_the_frame_and_csp_headers(small_server):
    status, headers, _ = http("PUT", small_server.url + "/prompt", raw=b"{}")
    assert status == 405
    _has_page_headers(headers)


def test_a_multipart_400_carries_the_frame_and_csp_headers(small_server):
    status, headers, _ = http("POST", small_server.url + "/upload/image", raw=b"{}",
                              headers={"Content-Type": "application/json"})
    assert status == 400
    _has_page_headers(headers)


def test_aiohttps_own_413_is_our_json_with_the_headers(small_server):
    def chunks():
        for _ in range(17):
            yield b"x" * 65536  # just over the 1 MB cap, with no Content-Length: aiohttp's read() refuses it

    status, body = _chunked_post(small_server.url, "/prompt", chunks(), "application/json")
    assert status == 413
    assert json.loads(body)["error"]["type"] == "too_large"


def test_a_413_says_too_large_not_not_found(small_server):
    (small_server.runtime.paths.input / "wide.png").write_bytes(png_bytes(20_000, 1, "L", 0))
    status, headers, body = http("GET", small_server.url + "/view?filename=wide.png&type=input&preview=webp")
    assert status == 413
    assert json.loads(body)["error"]["type"] == "too_large"
    _has_page_headers(headers)


def test_a_preview_download_name_escapes_quotes(small_server):
    name = 'say "hi"; filename=evil.html.png'
    (small_server.runtime.paths.input / name).write_bytes(png_bytes())
    status, headers, _ = http("GET", f"{small_server.url}/view?filename={urllib.parse.quote(name)}&type=input"
                                     f"&preview=webp")
    assert status == 200
    disposition = headers["Content-Disposition"]
    assert disposition.count('"') == 2 and disposition.endswith('.webp"'), disposition
