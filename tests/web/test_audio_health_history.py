"""Through a real server: a saved sound's check lands in the output's /history entry and the job's record,
and its warning reaches the editor as the node's progress text."""
from __future__ import annotations

import asyncio
import json
import math
import struct

import aiohttp
import pytest
import torch

from media.audio import write_flac
from tests.web.conftest import get_json, wait_terminal


async def _run_and_listen(url: str, prompt: dict) -> tuple[str, list[bytes]]:
    """Submit `prompt` as a websocket client; its id and the binary frames it got until the job ended."""
    frames = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url + "/ws?clientId=listener") as ws:
            await ws.receive_json(timeout=10)
            # Asking for previews, as the editor does: only such jobs get the warning line as a progress text.
            body = {"prompt": prompt, "client_id": "listener", "extra_data": {"preview_method": "latent2rgb"}}
            async with session.post(url + "/prompt", json=body) as response:
                assert response.status == 200, await response.text()
                prompt_id = (await response.json())["prompt_id"]
            async with asyncio.timeout(120):
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        frames.append(message.data)
                        continue
                    data = json.loads(message.data)
                    if data["type"] == "executing" and data["data"]["node"] is None \
                            and data["data"]["prompt_id"] == prompt_id:
                        break
    return prompt_id, frames


def _progress_texts(frames: list[bytes]) -> list[tuple[str, str]]:
    texts = []
    for frame in frames:
        if struct.unpack(">I", frame[:4])[0] == 3:
            node_length = struct.unpack(">I", frame[4:8])[0]
            texts.append((frame[8:8 + node_length].decode(), frame[8 + node_length:].decode()))
    return texts


def test_sound_check_reaches_history_the_job_record_and_the_editor(server):
    t = torch.arange(16000) / 32000
    left = 0.4 * torch.sin(2 * math.pi * 330 * t)
    write_flac(server.runtime.paths.input / "inverted.flac", torch.stack([left, -left]), 32000)
    prompt = {"1": {"class_type": "LoadAudio", "inputs": {"audio": "inverted.flac"}},
              "2": {"class_type": "SaveAudio", "inputs": {"audio": ["1", 0], "filename_prefix": "health/take"}}}
    prompt_id, frames = asyncio.run(_run_and_listen(server.url, prompt))
    record = wait_terminal(server.url, prompt_id, timeout=120)
    assert record["status"]["status_str"] == "success"
    output = record["outputs"]["2"]
    (entry,) = output["audio_health"]
    assert entry["file"] == f"health/{output['audio'][0]['filename']}"
    assert entry["channel_correlation"] == pytest.approx(-1.0, abs=1e-3) and not entry["healthy"]
    assert any("inverted" in line for line in entry["warnings"])
    status, job = get_json(f"{server.url}/api/jobs/{prompt_id}")
    assert status == 200 and job["outputs"]["2"]["audio_health"] == output["audio_health"]
    assert job["outputs_count"] == 1  # the check describes the file; it is not an output of its own
    (shown,) = [text for node, text in _progress_texts(frames) if node == "2"]
    assert shown.startswith("sound check:") and "inverted" in shown
