"""Real node packs from PyPI, copied unchanged into a scratch custom_nodes/ and run through a real server
(jobs in a worker process): comfyui-tooling-nodes 0.1.0 (the `server` module: a route, binary images
to the submitting client; comfy.utils.safetensors_header, comfy.model_detection, comfy.supported_models)
and comfyui-orbitquant 0.9.0 (imports itself by its package name). A small pack written here covers
the rest of PromptServer.instance: a prompt handler, a JSON message from a route and from a node."""
from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import shutil
import struct
import sys
import textwrap
import urllib.parse
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from PIL import Image

from tests.web.conftest import get_json, http, new_id, post_json, wait_terminal
from tests.web.serve import ServerThread

HOOK_PACK = '''
from server import PromptServer

server = PromptServer.instance


def add_hook_value(body):
    """Sets TestConst's value from extra_data.hook_value: the prompt is changed before validation."""
    value = (body.get("extra_data") or {}).get("hook_value")
    if value is not None:
        body["prompt"]["1"]["inputs"]["value"] = value
    return body


def broken_hook(body):
    raise RuntimeError("a prompt handler that fails is skipped")


server.add_on_prompt_handler(broken_hook)
server.add_on_prompt_handler(add_hook_value)


@server.routes.post("/hook_pack/announce")
async def announce(request):
    from aiohttp import web

    server.send_sync("hook_pack.announce", await request.json())  # no sid: every client
    return web.json_response({"sent": True})


@server.routes.get("/system_stats")
async def hijack(request):
    from aiohttp import web

    return web.json_response({"hijacked": True})


class HookPackNotify:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0})}}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value):
        running = PromptServer.instance
        running.send_sync("hook_pack.node", {"value": value, "node": running.last_node_id,
                                             "prompt_id": running.last_prompt_id}, running.client_id)
        return {}


class HookPackEven:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0})}, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    @classmethod
    def VALIDATE_INPUTS(cls, value):
        return True if value % 2 == 0 else f"{value} is odd"

    def run(self, value, unique_id=None):
        return {}


NODE_CLASS_MAPPINGS = {"HookPackNotify": HookPackNotify, "HookPackEven": HookPackEven}
'''


def installed_pack(distribution_package: str) -> Path:
    """The folder pip installed a pack's package into (its layout as ComfyUI would hold it)."""
    spec = importlib.util.find_spec(distribution_package)
    assert spec is not None and spec.submodule_search_locations, f"{distribution_package} is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def tiny_h3_checkpoint(path: Path) -> None:
    """An all-in-one style checkpoint whose diffusion model has the H3 transformer's marker keys."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.diffusion_model.video_patch_proj.weight": torch.zeros(8, 96),
               "model.diffusion_model.audio_patch_proj.weight": torch.zeros(8, 32),
               "vae.decoder.conv_in.weight": torch.zeros(2, 2)}, str(path))


@pytest.fixture(scope="module")
def packs_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("real-packs")
    custom = base / "custom_nodes"
    for package in ("comfyui_tooling_nodes", "comfyui_orbitquant"):
        shutil.copytree(installed_pack(package), custom / package, ignore=shutil.ignore_patterns("__pycache__"))
    (custom / "hook_pack.py").write_text(textwrap.dedent(HOOK_PACK))
    (base / "models" / "checkpoints").mkdir(parents=True)
    tiny_h3_checkpoint(base / "models" / "checkpoints" / "tiny_h3.safetensors")
    running = ServerThread(base)
    yield running
    running.stop()


def png_base64(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_every_pack_loads_and_answers_to_its_own_name(packs_server):
    reports = {r.name: r for r in packs_server.runtime.plugin_reports}
    assert {name: r.status for name, r in reports.items()} == {
        "comfyui_orbitquant": "loaded", "comfyui_tooling_nodes": "loaded", "hook_pack": "loaded"}, \
        {name: r.reason for name, r in reports.items()}
    assert reports["comfyui_orbitquant"].alias == "comfyui_orbitquant"
    # `from comfyui_orbitquant.nodes import ...` inside the pack reached the scratch copy, not site-packages.
    assert Path(sys.modules["comfyui_orbitquant.nodes"].__file__).is_relative_to(reports["comfyui_orbitquant"].path)


def test_tooling_pack_loads_crops_and_saves_exact_pixels(packs_server):
    pixels = np.random.default_rng(0).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    prompt = {"1": {"class_type": "ETN_LoadImageBase64", "inputs": {"image": png_base64(pixels)}},
              "2": {"class_type": "ETN_CropImage", "inputs": {"image": ["1", 0], "x": 3, "y": 2, "width": 5,
                                                              "height": 4}},
              "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "etn/crop"}}}
    status, reply = post_json(packs_server.url + "/prompt", {"prompt": prompt})
    assert status == 200, reply
    record = wait_terminal(packs_server.url, reply["prompt_id"], timeout=120)
    assert record["status"]["status_str"] == "success", record["status"]
    [saved] = record["outputs"]["3"]["images"]
    query = urllib.parse.urlencode({"filename": saved["filename"], "subfolder": saved["subfolder"], "type": "output"})
    status, _, body = http("GET", f"{packs_server.url}/view?{query}")
    assert status == 200
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(body)).convert("RGB")), pixels[2:6, 3:8])


def test_tooling_pack_route_reads_h3_checkpoints_bare_and_under_api(packs_server):
    expected = {"tiny_h3.safetensors": {"base_model": "unknown", "is_inpaint": False, "is_refiner": False}}
    for path in ("/etn/model_info", "/api/etn/model_info"):
        status, body = get_json(packs_server.url + path)
        assert (status, body) == (200, expected), path
    # Behind the same wall as Weft's own routes: a cross-site origin is refused before the pack's handler runs.
    status, _, _ = http("GET", packs_server.url + "/etn/model_info", headers={"Origin": "http://evil.example"})
    assert status == 403
    # A pack route on one of Weft's own paths never replaces it.
    for path in ("/system_stats", "/api/system_stats"):
        status, body = get_json(packs_server.url + path)
        assert status == 200 and "hijacked" not in body and "system" in body


async def _frames_until_done(ws, prompt_id: str) -> tuple[list[dict], list[bytes]]:
    messages, binary = [], []
    async with asyncio.timeout(120):
        async for message in ws:
            if message.type == aiohttp.WSMsgType.BINARY:
                binary.append(message.data)
                continue
            data = json.loads(message.data)
            messages.append(data)
            if data["type"] == "executing" and data["data"]["node"] is None and data["data"].get("prompt_id") == prompt_id:
                return messages, binary
    raise AssertionError("the websocket closed before the job ended")


async def _pending(ws, seconds: float = 0.5) -> list:
    """What else reaches `ws` within `seconds` (the status frames aside)."""
    got = []
    try:
        async with asyncio.timeout(seconds):
            async for message in ws:
                if message.type == aiohttp.WSMsgType.BINARY or json.loads(message.data)["type"] != "status":
                    got.append(message.data)
    except TimeoutError:
        pass
    return got


def test_send_image_websocket_delivers_the_image_to_the_submitting_client_only(packs_server):
    pixels = np.random.default_rng(1).integers(0, 256, (6, 9, 3), dtype=np.uint8)
    prompt = {"1": {"class_type": "ETN_LoadImageBase64", "inputs": {"image": png_base64(pixels)}},
              "2": {"class_type": "ETN_SendImageWebSocket", "inputs": {"images": ["1", 0]}}}

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{packs_server.url}/ws?clientId=krita") as ws, \
                    session.ws_connect(f"{packs_server.url}/ws?clientId=bystander") as other:
                async with session.post(packs_server.url + "/prompt", json={"prompt": prompt, "client_id": "krita"}) as r:
                    assert r.status == 200, await r.text()
                    prompt_id = (await r.json())["prompt_id"]
                messages, binary = await _frames_until_done(ws, prompt_id)
                return messages, binary, await _pending(other)

    messages, binary, bystander = asyncio.run(scenario())
    assert [m["data"]["output"] for m in messages if m["type"] == "executed"] == [
        {"images": [{"source": "websocket", "content-type": "image/png", "type": "output"}]}]
    [frame] = binary
    assert struct.unpack(">II", frame[:8]) == (1, 2)  # PREVIEW_IMAGE, PNG
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(frame[8:]))), pixels)
    assert bystander == []


def test_orbitquant_node_runs_in_a_prompt(packs_server, tmp_path):
    release = tmp_path / "release"
    for component in ("transformer", "transformer_ref", "text_encoder", "vae", "audio_vae", "scripts"):
        (release / component).mkdir(parents=True)
    for script in ("run_quantized_example.py", "decode_h3_latents.py"):
        (release / "scripts" / script).write_text("# not run by this test\n")
    (release / "comfyui_orbitquant.json").write_text(json.dumps({"schema_version": 1, "adapter": "minimax_h3",
                                                                  "media_type": "video"}))
    (release / "quantization_manifest.json").write_text(json.dumps({
        "artifact_format": "orbitquant-multicomponent-v1", "weight_bits": 4, "activation_bits": 4,
        "repo_id": "weft/tiny-release", "w4a4_components": ["transformer", "transformer_ref", "text_encoder"],
        "source_precision_components": ["vae", "audio_vae"]}))
    prompt = {"1": {"class_type": "OrbitQuantReleaseLoader", "inputs": {"model_path": str(release)}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}}}
    status, reply = post_json(packs_server.url + "/prompt", {"prompt": prompt})
    assert status == 200, reply
    record = wait_terminal(packs_server.url, reply["prompt_id"], timeout=120)
    assert record["status"]["status_str"] == "success", record["status"]
    summary = json.loads(record["outputs"]["2"]["text"][0])
    assert (summary["repo_id"], summary["bits"], summary["adapter"]) == ("weft/tiny-release", "W4A4", "minimax_h3")


def test_a_pack_node_out_of_range_gets_comfyuis_error_shape(packs_server):
    prompt = {"1": {"class_type": "ETN_LoadImageBase64", "inputs": {"image": "AAAA"}},
              "2": {"class_type": "ETN_CropImage", "inputs": {"image": ["1", 0], "x": 0, "y": 0, "width": 0,
                                                              "height": 4}},
              "3": {"class_type": "ETN_SendImageWebSocket", "inputs": {"images": ["2", 0]}}}
    status, reply = post_json(packs_server.url + "/prompt", {"prompt": prompt})
    assert status == 400
    assert reply["error"]["type"] == "prompt_outputs_failed_validation"
    entry = reply["node_errors"]["2"]
    assert entry["class_type"] == "ETN_CropImage" and entry["dependent_outputs"] == ["3"]
    [error] = entry["errors"]
    assert error["type"] == "value_smaller_than_min"
    assert set(error) == {"type", "message", "details", "extra_info"}
    assert error["extra_info"]["input_name"] == "width" and error["extra_info"]["received_value"] == 0
    assert error["extra_info"]["input_config"][0] == "INT" and error["extra_info"]["input_config"][1]["min"] == 1


def test_a_pack_validator_failure_and_hidden_input_in_comfyuis_shapes(packs_server):
    status, reply = post_json(packs_server.url + "/prompt",
                              {"prompt": {"4": {"class_type": "HookPackEven", "inputs": {"value": 3}}}})
    assert status == 400
    [error] = reply["node_errors"]["4"]["errors"]
    assert (error["type"], error["message"], error["details"]) == (
        "custom_validation_failed", "The node's own input check refused this prompt", "value - 3 is odd")
    assert error["extra_info"]["input_name"] == "value"
    status, info = get_json(packs_server.url + "/object_info/HookPackEven")
    assert status == 200 and info["HookPackEven"]["input"]["hidden"] == {"unique_id": "UNIQUE_ID"}


def test_prompt_handlers_change_the_prompt_before_validation(packs_server):
    prompt = {"1": {"class_type": "TestConst", "inputs": {"value": "not a number"}},
              "2": {"class_type": "TestOutput", "inputs": {"value": ["1", 0], "label": "hooked"}}}
    status, reply = post_json(packs_server.url + "/prompt", {"prompt": prompt, "extra_data": {"hook_value": 41}})
    assert status == 200, reply  # invalid as sent; the pack's handler replaced the value (the failing one was skipped)
    record = wait_terminal(packs_server.url, reply["prompt_id"], timeout=120)
    assert record["prompt"][2]["1"]["inputs"]["value"] == 41


def test_pack_messages_from_a_route_reach_everyone_and_from_a_node_its_client(packs_server):
    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{packs_server.url}/ws?clientId=first") as first, \
                    session.ws_connect(f"{packs_server.url}/ws?clientId=second") as second:
                async with session.post(packs_server.url + "/api/hook_pack/announce", json={"hello": 1}) as r:
                    assert r.status == 200
                announced = [await _pending(first), await _pending(second)]
                prompt_id = new_id()
                body = {"prompt_id": prompt_id, "client_id": "second",
                        "prompt": {"7": {"class_type": "HookPackNotify", "inputs": {"value": 5}}}}
                async with session.post(packs_server.url + "/prompt", json=body) as r:
                    assert r.status == 200, await r.text()
                messages, _ = await _frames_until_done(second, prompt_id)
                return announced, messages, prompt_id, await _pending(first)

    announced, messages, prompt_id, first_later = asyncio.run(scenario())
    expected = json.dumps({"type": "hook_pack.announce", "data": {"hello": 1}})
    assert announced == [[expected], [expected]]
    notes = [m["data"] for m in messages if m["type"] == "hook_pack.node"]
    assert notes == [{"value": 5, "node": "7", "prompt_id": prompt_id}]  # sent from the worker process
    assert not any("hook_pack.node" in str(frame) for frame in first_later)
