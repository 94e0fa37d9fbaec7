"""Two API clients from PyPI, written by others for ComfyUI, run unchanged against Weft's server."""
from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import pytest
from PIL import Image

from tests.web.conftest import post_json, wait_terminal


def api_workflow(width: int, height: int, prefix: str) -> dict:
    """EmptyImage -> ImageScale -> SaveImage in API format, with the titles clients look nodes up by."""
    return {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0x336699},
              "_meta": {"title": "Empty Image"}},
        "2": {"class_type": "ImageScale", "inputs": {"upscale_method": "bilinear", "width": width, "height": height,
                                                     "crop": "disabled", "image": ["1", 0]},
              "_meta": {"title": "Upscale Image"}},
        "3": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["2", 0]},
              "_meta": {"title": "Save Image"}},
    }


def _occupy_queue(url: str, seconds: float) -> str:
    """A job ahead in the queue, so the client's job is still queued when the client starts listening."""
    slow = {"1": {"class_type": "TestConst", "inputs": {"value": 1}},
            "2": {"class_type": "TestSlow", "inputs": {"value": ["1", 0], "seconds": seconds}},
            "3": {"class_type": "TestOutput", "inputs": {"value": ["2", 0]}}}
    return post_json(url + "/prompt", {"prompt": slow})[1]["prompt_id"]


def test_comfy_api_simplified_submits_and_gets_its_image(server):
    comfy_api_simplified = pytest.importorskip("comfy_api_simplified")
    api = comfy_api_simplified.ComfyApiWrapper(server.url)
    workflow = comfy_api_simplified.ComfyWorkflowWrapper(api_workflow(96, 80, "clients/simplified"))
    workflow.set_node_param("Upscale Image", "width", 120)
    blocker = _occupy_queue(server.url, 0.5)
    images = api.queue_and_wait_images(workflow, "Save Image")
    assert len(images) == 1
    name, data = next(iter(images.items()))
    assert name.startswith("simplified_") and Image.open(io.BytesIO(data)).size == (120, 80)
    assert wait_terminal(server.url, blocker)["status"]["completed"] is True
    assert api.get_queue() == {"queue_running": [], "queue_pending": []}


def test_comfyui_async_api_tool_submits_and_gets_its_image(server):
    tool = pytest.importorskip("comfyui_async_api_tool")

    async def scenario():
        async with aiohttp.ClientSession() as session:
            client = tool.ComfyClient(session, server.url, max_listen_seconds=60, fetch_image_timeout=60)
            events = []
            await asyncio.get_running_loop().run_in_executor(None, _occupy_queue, server.url, 0.5)
            async for event in client.run(api_workflow(72, 48, "clients/async"), values={"2": {"height": 40}}):
                events.append(event)
            return events

    events = asyncio.run(scenario())
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and "error" not in kinds, events[-1]
    image = next(e for e in events if e["type"] == "image")
    assert Image.open(io.BytesIO(image["data"])).size == (72, 40)
    assert image.get("generation_ms", 0) >= 0


def _h3_api_workflow(seed: int) -> dict:
    """The tiny H3 text-to-video-with-sound graph with a sampler, saved as an MP4, titled as a client sees it."""
    from tests.nodes.test_h3_nodes import t2va_prompt

    prompt = t2va_prompt(width=32, height=32, length=5, steps=2, seed=seed, save_video=True)
    prompt = {k: v for k, v in prompt.items() if not k.startswith("probe_")}
    for node_id, node in prompt.items():
        node["_meta"] = {"title": "Save Video" if node_id == "save" else node_id}
    return prompt


def test_comfy_api_simplified_gets_the_mp4_of_an_h3_sampler_workflow_not_previews(server, tmp_path_factory):
    """The client takes every binary frame it hears as an image: with previews off unless asked for, what it
    returns is the saved MP4, fetched from the history."""
    comfy_api_simplified = pytest.importorskip("comfy_api_simplified")
    from tests.nodes.test_h3_nodes import install, tiny_weights

    install(tiny_weights(tmp_path_factory), server.runtime.paths.base)
    api = comfy_api_simplified.ComfyApiWrapper(server.url)
    workflow = comfy_api_simplified.ComfyWorkflowWrapper(_h3_api_workflow(seed=3))
    blocker = _occupy_queue(server.url, 0.5)
    files = api.queue_and_wait_images(workflow, "Save Video")
    assert len(files) == 1, list(files)
    name, data = next(iter(files.items()))
    assert name.endswith(".mp4") and data[4:8] == b"ftyp", name
    assert wait_terminal(server.url, blocker)["status"]["completed"] is True


def test_a_raw_websocket_client_that_does_not_ask_gets_no_previews_and_one_that_asks_does(server, tmp_path_factory):
    from tests.nodes.test_h3_nodes import install, tiny_weights

    install(tiny_weights(tmp_path_factory), server.runtime.paths.base)

    async def one_job(session, seed: int, extra_data: dict | None) -> list:
        client_id = f"raw-{seed}"
        async with session.ws_connect(f"{server.url}/ws?clientId={client_id}") as ws:
            body = {"prompt": _h3_api_workflow(seed), "client_id": client_id}
            if extra_data is not None:
                body["extra_data"] = extra_data
            async with session.post(server.url + "/prompt", json=body) as response:
                assert response.status == 200, await response.text()
                prompt_id = (await response.json())["prompt_id"]
            frames, sampler_progress = [], 0
            while True:
                message = await ws.receive(timeout=300)
                if message.type == aiohttp.WSMsgType.BINARY:
                    frames.append(message.data)
                    continue
                assert message.type == aiohttp.WSMsgType.TEXT, message
                event = json.loads(message.data)
                data = event.get("data", {})
                if data.get("prompt_id") != prompt_id:
                    continue
                if event["type"] == "progress" and data.get("node") == "sample":
                    sampler_progress += 1
                assert event["type"] != "execution_error", data
                if event["type"] == "execution_success":
                    break
            assert sampler_progress == 2  # the sampler ran its steps while the client listened
            return frames

    async def scenario():
        async with aiohttp.ClientSession() as session:
            plain = await one_job(session, 21, None)
            asked = await one_job(session, 22, {"preview_method": "latent2rgb"})
            return plain, asked

    plain, asked = asyncio.run(scenario())
    assert plain == []  # neither preview pictures nor progress texts
    assert asked and all(frame[:4] in (b"\x00\x00\x00\x01", b"\x00\x00\x00\x03") for frame in asked)
