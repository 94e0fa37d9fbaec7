"""The chained-segments workflow through the server: a second prompt with segment 3's prompt edited is
answered from the worker's cache for segments 1 and 2, as the websocket's `execution_cached` and
`executing` events show."""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest

from execution.convert import ui_to_api
from tests.nodes.test_h3_control import node_of
from tests.nodes.test_h3_nodes import install, tiny_weights
from tests.nodes.test_segments import small_workflow
from tests.web.serve import ServerThread


@pytest.fixture(scope="module")
def caching_server(tmp_path_factory):
    """A real server (jobs in a worker process) that keeps node results between prompts. An LRU cache: the
    default RAM cache empties itself when the machine has little memory free, which a test cannot rule out."""
    base = tmp_path_factory.mktemp("weft-segments")
    install(tiny_weights(tmp_path_factory), base)
    running = ServerThread(base, cache_flags=("--cache-lru", "1000"))
    yield running
    running.stop()


async def _job(session: aiohttp.ClientSession, url: str, prompt: dict, client_id: str) -> dict:
    """Send `prompt` and listen until it ends: {"executing": [display ids in order], "cached": [...]}."""
    seen: dict = {"executing": [], "cached": None}
    async with session.ws_connect(f"{url}/ws?clientId={client_id}") as ws:
        async with session.post(url + "/prompt", json={"prompt": prompt, "client_id": client_id}) as response:
            assert response.status == 200, await response.text()
            prompt_id = (await response.json())["prompt_id"]
        while True:
            message = await ws.receive(timeout=600)
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            event = json.loads(message.data)
            data = event.get("data", {})
            if data.get("prompt_id") != prompt_id:
                continue
            assert event["type"] != "execution_error", data
            if event["type"] == "execution_cached":
                seen["cached"] = data["nodes"]
            elif event["type"] == "executing" and data["node"] is not None:
                seen["executing"].append(data["node"])
            elif event["type"] == "execution_success":
                return seen


def test_a_prompt_with_segment_3_edited_re_runs_segments_3_and_4_only(caching_server):
    registry = caching_server.runtime.registry
    original = ui_to_api(small_workflow(), registry)
    edited = ui_to_api(small_workflow({3: "a heron lands on the puddle"}), registry)
    first_sampler = node_of(original, "SamplerCustomAdvanced", "Segment 1")
    first_video = node_of(original, "CreateVideo", "Segment 1 (video)")
    loop_sampler = node_of(original, "SamplerCustomAdvanced", "This segment")
    loop_encode = node_of(original, "CLIPTextEncode", "This segment's prompt")

    async def scenario():
        async with aiohttp.ClientSession() as session:
            return (await _job(session, caching_server.url, original, "segments-1"),
                    await _job(session, caching_server.url, edited, "segments-2"))

    first, second = asyncio.run(scenario())
    ran_first, ran_second = Counter(first["executing"]), Counter(second["executing"])
    # Loop copies report the drawn node's id: the loop's sampler runs once per segment made.
    assert ran_first[first_sampler] == 1 and ran_first[loop_sampler] == 3
    assert ran_second[first_sampler] == 0 and ran_second[loop_sampler] == 2  # segments 3 and 4
    assert ran_second[loop_encode] == 1  # only segment 3's prompt is encoded again
    assert first_sampler in second["cached"] and first_video in second["cached"]
