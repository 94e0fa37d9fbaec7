"""Two API clients from PyPI, written by others for ComfyUI, run unchanged against Weft's server."""
from __future__ import annotations

import asyncio
import io

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
