"""The attack battery's findings on the web edge, each reproduced against a real server."""
from __future__ import annotations

import http.client as http_client
import io
import json
import socket
import struct
import time
import uuid

import pytest
from PIL import Image

from tests.web.conftest import get_json, http
from tests.web.serve import ServerThread
from tests.web.test_routes import multipart, png_bytes, upload

LIMIT_MB = 1


@pytest.fixture(scope="module")
def small_limit(tmp_path_factory):
    """A light server whose request bodies are capped at 1 MB."""
    running = ServerThread(tmp_path_factory.mktemp("hardening"), light=True,
                           extra_args=["--max-upload-size", str(LIMIT_MB)])
    yield running
    running.stop()


def _spool(server) -> list:
    folder = server.runtime.paths.temp / ".uploads"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _chunked_post(url: str, path: str, chunks, content_type: str) -> tuple[int, bytes]:
    host, port = url.split("//")[1].split(":")
    connection = http_client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", path, body=chunks, headers={"Content-Type": content_type}, encode_chunked=True)
        response = connection.getresponse()
        return response.status, response.read()
    except (ConnectionError, BrokenPipeError):  # the server answered and closed before the body ended
        return 413, b""
    finally:
        connection.close()


def test_upload_limit_counts_every_byte_of_a_chunked_body_of_many_small_fields(small_limit):
    boundary = uuid.uuid4().hex
    field = b"x" * 60_000  # each under the per-field limit

    def body():
        for index in range(60):  # about 3.6 MB in all, over the 1 MB limit
            yield (f'--{boundary}\r\nContent-Disposition: form-data; name="f{index}"\r\n\r\n').encode() + field + b"\r\n"
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'.encode()
        yield png_bytes() + b"\r\n"
        yield f"--{boundary}--\r\n".encode()

    status, _ = _chunked_post(small_limit.url, "/upload/image", body(), f"multipart/form-data; boundary={boundary}")
    assert status == 413
    assert not (small_limit.runtime.paths.input / "a.png").exists()
    # Parts with no name are counted too.
    status, _ = _chunked_post(small_limit.url, "/upload/image", (
        f'--{boundary}\r\nContent-Disposition: form-data\r\n\r\n'.encode() + b"y" * 2_000_000 + b"\r\n",
        f"--{boundary}--\r\n".encode()), f"multipart/form-data; boundary={boundary}")
    assert status == 413
    assert _spool(small_limit) == []


def test_upload_temporary_files_go_on_every_failure_and_at_start_up(small_limit, tmp_path):
    # An oversize file part: refused, and its temporary file removed.
    status, _ = upload(small_limit.url, "big.png", b"z" * 1_500_000)
    assert status == 413 and _spool(small_limit) == []
    # A client that leaves in the middle of a file part.
    host, port = small_limit.url.split("//")[1].split(":")
    boundary = uuid.uuid4().hex
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall((f"POST /upload/image HTTP/1.1\r\nHost: {host}:{port}\r\n"
                      f"Content-Type: multipart/form-data; boundary={boundary}\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        part = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="gone.png"\r\n\r\n').encode() + b"q" * 300_000
        sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        deadline = time.monotonic() + 10
        while not _spool(small_limit) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _spool(small_limit), "the upload never started"
    deadline = time.monotonic() + 10
    while _spool(small_limit) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _spool(small_limit) == []
    # Left over from a server that was killed: swept when the next one starts.
    base = tmp_path / "restart"
    stale = base / "temp" / ".uploads" / "0123.part"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half an upload")
    restarted = ServerThread(base, light=True)
    try:
        assert not stale.exists()
    finally:
        restarted.stop()


@pytest.mark.parametrize("route", ["/upload/image", "/upload/mask"])
def test_nested_multipart_part_is_a_400(small_limit, route):
    inner = uuid.uuid4().hex
    outer = uuid.uuid4().hex
    body = (f"--{outer}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
            f"Content-Type: multipart/mixed; boundary={inner}\r\n\r\n"
            f"--{inner}\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\nv\r\n--{inner}--\r\n"
            f"\r\n--{outer}--\r\n").encode()
    status, _, reply = http("POST", small_limit.url + route, raw=body,
                            headers={"Content-Type": f"multipart/form-data; boundary={outer}"})
    assert status == 400, reply
    assert b"multipart" in reply
    assert _spool(small_limit) == []


def test_deeply_nested_original_ref_is_a_400(small_limit):
    deep = "[" * 30_000 + "]" * 30_000
    status, reply = upload(small_limit.url, "mask.png", png_bytes(), route="/upload/mask", original_ref=deep)
    assert status == 400 and "nested more than" in json.dumps(reply)
    status, reply = upload(small_limit.url, "mask.png", png_bytes(), route="/upload/mask",
                           original_ref=json.dumps({"filename": "a.png", "x": [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]}) )
    assert status == 404  # an ordinary ref: only the original is missing


def _safetensors(header_json: bytes) -> bytes:
    return struct.pack("<Q", len(header_json)) + header_json


@pytest.mark.parametrize("header", [b"[1, 2, 3]", b"[" * 30_000 + b"]" * 30_000, b"{\"a\":" * 100 + b"1" + b"}" * 100,
                                    b"{\"__metadata__\": [1]}"])
def test_view_metadata_of_a_header_that_is_not_a_json_object_is_a_400(small_limit, header):
    folder = small_limit.runtime.paths.models / "checkpoints"
    name = f"odd-{uuid.uuid4().hex[:8]}.safetensors"
    (folder / name).write_bytes(_safetensors(header))
    status, reply = get_json(f"{small_limit.url}/view_metadata/checkpoints?filename={name}")
    assert status == 400, reply
    (folder / "fine.safetensors").write_bytes(_safetensors(b'{"__metadata__": {"title": "x"}}'))
    assert get_json(f"{small_limit.url}/view_metadata/checkpoints?filename=fine.safetensors") == (200, {"title": "x"})


def test_animated_upload_counts_pixels_of_every_frame(small_limit):
    frames = [Image.new("P", (1000, 1000), v % 2) for v in range(80)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    status, reply = upload(small_limit.url, "bomb.gif", buffer.getvalue())
    assert status == 413 and "80 frames" in json.dumps(reply)
    assert not (small_limit.runtime.paths.input / "bomb.gif").exists()


@pytest.mark.parametrize("name", ["bell\x07.png", "esc\x1b[2J.png", "del\x7f.png", "c1\x9b.png"])
def test_control_characters_are_refused_where_names_enter(small_limit, name):
    # A raw control character in a part header is already refused by the HTTP parser; the encoded form
    # (RFC 5987 filename*=) reaches the server's own check.
    status, reply = upload(small_limit.url, name, png_bytes())
    assert status == 400
    boundary = uuid.uuid4().hex
    quoted = "".join(f"%{b:02X}" for b in name.encode())
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename*=UTF-8''{quoted}\r\n\r\n"
            ).encode() + png_bytes() + f"\r\n--{boundary}--\r\n".encode()
    status, _, reply = http("POST", small_limit.url + "/upload/image", raw=body,
                            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 400 and b"cannot hold" in reply
    status, reply = upload(small_limit.url, "fine.png", png_bytes(), subfolder="sub/" + name.replace(".png", ""))
    assert status == 400 and "cannot hold" in str(reply)
    status, _, reply = http("POST", f"{small_limit.url}/userdata/{quoted}", raw=b"{}")
    assert status == 400 and b"cannot hold" in reply
    status, _, reply = http("GET", f"{small_limit.url}/view?filename={quoted}")
    assert status == 400
    inputs = small_limit.runtime.paths.input
    assert not [p for p in inputs.rglob("*") if any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in p.name)]


def test_editor_pages_may_be_framed_only_by_this_server(small_limit):
    for path in ("/", "/prompt", "/view?filename=missing.png"):
        _, headers, _ = http("GET", small_limit.url + path)
        assert headers.get("X-Frame-Options") == "SAMEORIGIN", path
        assert "frame-ancestors 'self'" in headers.get("Content-Security-Policy", ""), path
