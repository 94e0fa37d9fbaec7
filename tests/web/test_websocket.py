"""The websocket: status on connect, feature flags, event routing, binary frames, bounded send queues."""
from __future__ import annotations

import asyncio
import json
import struct

import aiohttp
import pytest

from tests.web.conftest import const_prompt
from web.websocket import Client, Frame, Hub


async def _receive_until_done(ws, prompt_id: str, timeout: float = 30) -> tuple[list[dict], list[bytes]]:
    """JSON messages and binary frames until `executing` with node null for `prompt_id`."""
    messages, binary = [], []
    async with asyncio.timeout(timeout):
        async for message in ws:
            if message.type == aiohttp.WSMsgType.BINARY:
                binary.append(message.data)
                continue
            data = json.loads(message.data)
            messages.append(data)
            if data["type"] == "executing" and data["data"]["node"] is None and data["data"]["prompt_id"] == prompt_id:
                break
    return messages, binary


async def _submit(session, url: str, prompt: dict, client_id: str | None) -> str:
    body = {"prompt": prompt}
    if client_id is not None:
        body["client_id"] = client_id
    async with session.post(url + "/prompt", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["prompt_id"]


def preview_prompt(steps: int = 3, size: int = 16, seed: int = 0) -> dict:
    return {"1": {"class_type": "WebTestPreviews", "inputs": {"steps": steps, "size": size, "seed": seed}}}


def test_status_on_connect_has_sid_and_the_real_queue_length(light_server):
    async def scenario():
        url = light_server.url
        slow = {"1": {"class_type": "TestConst", "inputs": {"value": 1}},
                "2": {"class_type": "TestSlow", "inputs": {"value": ["1", 0], "seconds": 1.0}},
                "3": {"class_type": "TestOutput", "inputs": {"value": ["2", 0]}}}
        async with aiohttp.ClientSession() as session:
            first = await _submit(session, url, slow, None)
            await _submit(session, url, const_prompt(2), None)
            async with session.ws_connect(url + "/ws?clientId=watcher") as ws:
                hello = await ws.receive_json(timeout=10)
                assert hello["type"] == "status" and hello["data"]["sid"] == "watcher"
                assert hello["data"]["status"]["exec_info"]["queue_remaining"] == 2
                await ws.send_json({"type": "feature_flags", "data": {"supports_preview_metadata": True}})
                flags = await ws.receive_json(timeout=10)
                while flags["type"] != "feature_flags":
                    flags = await ws.receive_json(timeout=10)
                assert flags["data"]["supports_preview_metadata"] is True and flags["data"]["max_upload_size"] > 0
                seen = []
                while not seen or seen[-1] != 0:
                    message = await ws.receive_json(timeout=30)
                    if message["type"] == "status":
                        seen.append(message["data"]["status"]["exec_info"]["queue_remaining"])
                assert first
    asyncio.run(scenario())


def test_events_go_to_the_submitting_client_and_to_subscribers_of_all(light_server):
    async def scenario():
        url = light_server.url
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url + "/ws?clientId=owner") as owner, \
                    session.ws_connect(url + "/ws?clientId=stranger") as stranger, \
                    session.ws_connect(url + "/api/ws?clientId=all&subscribe=all") as everything:
                for ws in (owner, stranger, everything):
                    assert (await ws.receive_json(timeout=10))["type"] == "status"
                prompt_id = await _submit(session, url, const_prompt(9), "owner")
                mine, _ = await _receive_until_done(owner, prompt_id)
                types = [m["type"] for m in mine]
                for expected in ("execution_start", "executing", "executed", "execution_success"):
                    assert expected in types, (expected, types)
                assert types.index("execution_success") < len(types) - 1  # then executing(null)
                executed = next(m for m in mine if m["type"] == "executed")
                assert executed["data"]["output"] == {"values": [9], "labels": [""]}
                watched, _ = await _receive_until_done(everything, prompt_id)
                assert "execution_success" in [m["type"] for m in watched]
                # The stranger sees queue status only, never this job's events.
                others = []
                try:
                    async with asyncio.timeout(0.5):
                        async for message in stranger:
                            others.append(json.loads(message.data))
                except TimeoutError:
                    pass
                assert all(m["type"] == "status" for m in others), others
    asyncio.run(scenario())


def test_terminal_event_arrives_after_the_history_record(light_server):
    async def scenario():
        url = light_server.url
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url + "/ws?clientId=poller") as ws:
                await ws.receive_json(timeout=10)
                for value in range(5):
                    prompt_id = await _submit(session, url, const_prompt(value), "poller")
                    await _receive_until_done(ws, prompt_id)
                    async with session.get(f"{url}/history/{prompt_id}") as response:
                        record = (await response.json())[prompt_id]
                    assert record["outputs"]["2"]["values"] == [value]
    asyncio.run(scenario())


def test_binary_previews_and_progress_text(light_server):
    async def scenario():
        url = light_server.url
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url + "/ws?clientId=legacy") as legacy, \
                    session.ws_connect(url + "/ws?clientId=modern") as modern:
                await legacy.receive_json(timeout=10)
                await modern.receive_json(timeout=10)
                await modern.send_json({"type": "feature_flags", "data": {"supports_preview_metadata": True}})
                await legacy.send_json({"type": "subscribe", "data": {"jobs": "all"}})
                await asyncio.sleep(0.2)
                prompt_id = await _submit(session, url, preview_prompt(steps=3, size=16), "modern")
                _, modern_frames = await _receive_until_done(modern, prompt_id)
                _, legacy_frames = await _receive_until_done(legacy, prompt_id)
                texts = [f for f in modern_frames if struct.unpack(">I", f[:4])[0] == 3]
                assert len(texts) == 3
                node_length = struct.unpack(">I", texts[-1][4:8])[0]
                assert texts[-1][8:8 + node_length] == b"1" and texts[-1][8 + node_length:] == b"Iteration 3/3"
                with_meta = [f for f in modern_frames if struct.unpack(">I", f[:4])[0] == 4]
                assert with_meta, "no type-4 previews for a client that asked for metadata"
                meta_length = struct.unpack(">I", with_meta[0][4:8])[0]
                meta = json.loads(with_meta[0][8:8 + meta_length])
                assert meta["prompt_id"] == prompt_id and meta["node_id"] == "1"
                assert with_meta[0][8 + meta_length:8 + meta_length + 2] == b"\xff\xd8"  # JPEG
                plain = [f for f in legacy_frames if struct.unpack(">I", f[:4])[0] == 1]
                assert plain and struct.unpack(">I", plain[0][4:8])[0] == 1 and plain[0][8:10] == b"\xff\xd8"
                assert not [f for f in legacy_frames if struct.unpack(">I", f[:4])[0] == 4]
    asyncio.run(scenario())


class _StuckSocket:
    """A websocket whose peer never reads: every send blocks."""

    def __init__(self):
        self.closed_with = None

    async def send_str(self, data):
        await asyncio.Event().wait()

    send_bytes = send_str

    async def close(self, code=1000, message=b""):
        self.closed_with = code


def test_send_queue_drops_previews_first_then_disconnects_a_non_reader():
    async def scenario():
        hub = Hub(max_frames=10, max_bytes=10_000, preview_backlog=4, stall_s=0.05)
        client = Client("slow", _StuckSocket())
        hub.clients["slow"] = client
        for index in range(3):
            hub.enqueue(client, Frame(f"event {index}"))
        for _ in range(5):
            hub.enqueue(client, Frame(b"preview", droppable=True))
        assert sum(f.droppable for f in client.queue) == 1 and client.dropped_previews == 4
        for index in range(3, 10):
            hub.enqueue(client, Frame(f"event {index}"))
        # Full: the preview went first, every event is still there.
        assert [f.payload for f in client.queue] == [f"event {i}" for i in range(10)] and not client.closed
        hub.enqueue(client, Frame("event 10"))  # over the bound, but queued in one burst: kept for now
        assert not client.closed
        await asyncio.sleep(0.1)  # nothing was read meanwhile
        hub.enqueue(client, Frame("event 11"))
        await asyncio.sleep(0)
        assert client.closed and "slow" not in hub.clients and hub.disconnected_slow == 1
        assert client.ws.closed_with == 1008
    asyncio.run(scenario())


def test_byte_bound_disconnects_a_client_buried_in_large_frames():
    async def scenario():
        hub = Hub(max_frames=1000, max_bytes=1000, preview_backlog=100, stall_s=0.05)
        client = Client("big", _StuckSocket())
        hub.clients["big"] = client
        hub.enqueue(client, Frame("x" * 600))
        hub.enqueue(client, Frame("y" * 600))
        assert not client.closed
        await asyncio.sleep(0.1)
        hub.enqueue(client, Frame("z" * 600))
        assert client.closed
        # Far past the bound, a client is dropped at once, reading or not.
        other = Client("buried", _StuckSocket())
        hub.clients["buried"] = other
        for _ in range(20):
            hub.enqueue(other, Frame("w" * 600))
        assert other.closed
    asyncio.run(scenario())


def test_a_reading_client_gets_a_burst_larger_than_its_bound(light_server):
    """The attack: about 17 MB of events queued in one batch for a client that reads (bound: 16 MB)."""
    async def scenario():
        hub = light_server.state.hub
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(light_server.url + "/ws?clientId=burst-reader", max_msg_size=0) as ws:
                await ws.receive_json(timeout=10)  # status
                frames = [("json", json.dumps({"type": "progress", "data": {"i": i, "pad": "p" * 4000}}))
                          for i in range(hub.max_bytes // 4000 + 200)]
                light_server.loop.call_soon_threadsafe(hub.deliver, frames, "burst-reader")
                received = 0
                while received < len(frames):
                    message = await ws.receive(timeout=30)
                    assert message.type == aiohttp.WSMsgType.TEXT, message
                    received += 1
                assert received == len(frames)
    asyncio.run(scenario())


@pytest.mark.parametrize("query", ["", "?clientId="])
def test_connect_without_client_id_gets_a_generated_sid(light_server, query):
    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(light_server.url + "/ws" + query) as ws:
                hello = await ws.receive_json(timeout=10)
                assert hello["type"] == "status" and len(hello["data"]["sid"]) == 32
                await ws.send_str("not json")
                await ws.send_json(["not", "an", "object"])
                await ws.send_json({"type": "feature_flags", "data": {}})
                flags = await ws.receive_json(timeout=10)
                while flags["type"] != "feature_flags":
                    flags = await ws.receive_json(timeout=10)
    asyncio.run(scenario())
