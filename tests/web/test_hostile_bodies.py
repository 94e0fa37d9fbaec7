"""Hostile request bodies: gzip bombs that must not stall the server, prompts nested too deep to hand on."""
from __future__ import annotations

import asyncio
import gzip
import time
import zlib

import aiohttp
import pytest

from tests.web.conftest import const_prompt, http, wait_terminal
from tests.web.serve import ServerThread

BOMB_INFLATED_BYTES = 2**30


def gzip_bomb(inflated_bytes: int = BOMB_INFLATED_BYTES) -> bytes:
    """A valid gzip stream of `inflated_bytes` zeros, about a thousandth of that size, built in well
    under a second: one fully flushed deflate segment of 1 MiB of zeros, repeated (a full flush resets
    the window, so each copy decodes on its own)."""
    segment_bytes = 2**20
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = compressor.compress(bytes(segment_bytes)) + compressor.flush(zlib.Z_FULL_FLUSH)
    copies = inflated_bytes // segment_bytes
    crc = 0
    zeros = bytes(segment_bytes)
    for _ in range(copies):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    final_block = b"\x03\x00"  # an empty final fixed-Huffman block
    trailer = crc.to_bytes(4, "little") + (inflated_bytes % 2**32).to_bytes(4, "little")
    return header + segment * copies + final_block + trailer


def test_the_bomb_helper_is_a_real_gzip_stream():
    small = gzip_bomb(8 * 2**20)
    assert gzip.decompress(small) == bytes(8 * 2**20)


@pytest.fixture(scope="module")
def bomb():
    return gzip_bomb()


async def _queue_latencies(url: str, bodies: list[tuple[bytes, dict]], probes: int = 30) -> tuple[list, list]:
    """Send every body at once and, while they are in flight, time GET /queue `probes` times."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     auto_decompress=False) as session:
        async def send(body: bytes, headers: dict):
            async with session.post(url + "/prompt", data=body, headers=headers) as response:
                return response.status, await response.read()

        senders = [asyncio.create_task(send(body, headers)) for body, headers in bodies]
        await asyncio.sleep(0.2)  # the bombs are being received
        latencies = []
        for _ in range(probes):
            started = time.perf_counter()
            async with session.get(url + "/queue") as response:
                assert response.status in (200, 401)
                await response.read()
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.02)
        results = await asyncio.wait_for(asyncio.gather(*senders), 120)
        return latencies, results


def test_gzip_bombs_do_not_stall_the_event_loop(light_server, bomb):
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    latencies, results = asyncio.run(_queue_latencies(light_server.url, [(bomb, headers)] * 4))
    # The bar: /queue answers within 100 ms while four bombs are in flight.
    assert max(latencies) < 0.1, latencies
    for status, body in results:
        assert status == 413, (status, body[:200])
        assert b"--max-upload-size" in body
    # An honest compressed prompt still works.
    import json
    prompt = gzip.compress(json.dumps({"prompt": const_prompt(5)}).encode())
    status, _, reply = http("POST", light_server.url + "/prompt", raw=prompt, headers=headers)
    assert status == 200, reply
    assert wait_terminal(light_server.url, json.loads(reply)["prompt_id"])["outputs"]["2"]["values"] == [5]


def test_a_gzip_bomb_without_the_token_is_refused_before_it_is_inflated(tmp_path, bomb):
    def with_token(config):
        config.security.token = "a-token-nobody-sent"

    running = ServerThread(tmp_path, light=True, config_changes=with_token)
    try:
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        latencies, results = asyncio.run(_queue_latencies(running.url, [(bomb, headers)] * 4))
        assert max(latencies) < 0.1, latencies
        assert [status for status, _ in results] == [401] * 4
    finally:
        running.stop()


def test_unknown_or_stacked_encodings_are_refused(light_server):
    body = gzip.compress(b'{"prompt": {}}')
    for encoding in ("compress", "gzip, gzip", "x-unknown"):
        status, _, reply = http("POST", light_server.url + "/prompt", raw=body,
                                headers={"Content-Type": "application/json", "Content-Encoding": encoding})
        assert status == 415, (encoding, status, reply)
    status, _, reply = http("POST", light_server.url + "/prompt", raw=b"not gzip at all",
                            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 400 and b"gzip" in reply


def _nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def test_a_prompt_nested_900_deep_is_refused_at_the_door(light_server):
    url = light_server.url
    # The value rides in a widget input: it used to be accepted, then never reached a worker (pickle
    # overflowed), and the job showed "running" forever.
    deep = {"1": {"class_type": "TestConst", "inputs": {"value": 1, "extra": {"__value__": _nested(900)}}},
            "2": {"class_type": "TestOutput", "inputs": {"value": ["1", 0]}}}
    import json
    for body in ({"prompt": deep}, {"prompt": const_prompt(1), "extra_data": {"x": _nested(900)}},
                 {"prompt": const_prompt(1), "extra_data": {"x": _nested(70)}}):
        status, _, reply = http("POST", url + "/prompt", raw=json.dumps(body).encode(),
                                headers={"Content-Type": "application/json"})
        assert status == 400, reply[:300]
        assert b"nested more than 64 levels deep" in reply
    status, queue = 0, None
    status, _, raw_queue = http("GET", url + "/queue")
    queue = json.loads(raw_queue)
    assert status == 200 and queue["queue_running"] == [] and queue["queue_pending"] == []
    # A prompt of ordinary depth still runs.
    status, _, reply = http("POST", url + "/prompt", raw=json.dumps({"prompt": const_prompt(9)}).encode())
    assert status == 200
    assert wait_terminal(url, json.loads(reply)["prompt_id"])["outputs"]["2"]["values"] == [9]
