"""taeh3 live previews through the server: a websocket client whose job asks for taesd (the editor's "TAESD"
setting) gets every step's progress and, for the steps drawn, a JPEG at the picture's full size, drawn by the
tiny taeh3 in models/vae_approx, each before its step's progress. The render thread draws every step it keeps
up with (nodes/previews.py: a newer step replaces a picture still waiting; the last step is always drawn):
through a worker process the test asserts what holds however the two threads are timed, and in the
server's own process, where each step is made to wait until its picture has begun, one picture per step."""
from __future__ import annotations

import asyncio
import io
import json
import struct
import threading

import aiohttp
import torch
from PIL import Image
from safetensors.torch import load_file

from models.h3.taeh3 import load_taeh3
from models.h3.tiny_released import TAEH3, taeh3_bytes
from nodes.previews import AUDIO_BAND, SamplerPreviews
from tests.nodes.test_h3_nodes import install, t2va_prompt, tiny_weights
from tests.web.serve import ServerThread

PREVIEW_IMAGE = 1  # the binary frame type of a plain preview picture


def _taesd_job(server, tmp_path_factory, steps: int):
    """Run a tiny t2va job asking for taesd previews; ([JPEG pictures], [("picture", None) | ("progress", step)])
    in the order the websocket client received them, for the sampler node."""
    base = server.runtime.paths.base
    install(tiny_weights(tmp_path_factory), base)
    (base / "models" / "vae_approx").mkdir(parents=True, exist_ok=True)
    (base / "models" / "vae_approx" / TAEH3).write_bytes(taeh3_bytes())
    prompt = {k: v for k, v in t2va_prompt(width=64, height=32, length=22, steps=steps, seed=5,
                                            save_video=False).items()
              if not k.startswith("probe_") and k not in ("decode", "decode_audio")}
    prompt["out"] = {"class_type": "SaveLatent", "inputs": {"samples": ["sample", 0], "filename_prefix": "taesd"}}

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{server.url}/ws?clientId=taesd") as ws:
                body = {"prompt": prompt, "client_id": "taesd", "extra_data": {"preview_method": "taesd"}}
                async with session.post(server.url + "/prompt", json=body) as response:
                    assert response.status == 200, await response.text()
                    prompt_id = (await response.json())["prompt_id"]
                pictures, order = [], []
                while True:
                    message = await ws.receive(timeout=300)
                    if message.type == aiohttp.WSMsgType.BINARY:
                        if struct.unpack(">I", message.data[:4])[0] == PREVIEW_IMAGE:
                            pictures.append(Image.open(io.BytesIO(message.data[8:])))
                            order.append(("picture", None))
                        continue
                    event = json.loads(message.data)
                    data = event.get("data", {})
                    if data.get("prompt_id") != prompt_id:
                        continue
                    assert event["type"] != "execution_error", data
                    if event["type"] == "progress" and data.get("node") == "sample":
                        order.append(("progress", data["value"]))
                    if event["type"] == "execution_success":
                        return pictures, order

    return asyncio.run(scenario())


def test_taesd_previews_reach_a_websocket_client_at_the_picture_size_each_step(server, tmp_path_factory):
    base = server.runtime.paths.base
    pictures, order = _taesd_job(server, tmp_path_factory, steps=3)
    steps = [value for kind, value in order if kind == "progress"]
    assert steps == [1, 2, 3]
    assert 1 <= len(pictures) <= 3 and order[-2:] == [("picture", None), ("progress", 3)]  # the last step drawn
    assert all(order[i + 1][0] == "progress" for i, (kind, _) in enumerate(order) if kind == "picture")
    assert all(picture.format == "JPEG" and picture.size == (64, 32) for picture in pictures)
    # Euler's last step lands on its own clean estimate, so the last preview is taeh3's frame of the saved
    # latent's middle latent frame (3 of 7, decoded from its clip's start), up to JPEG's loss (compared in
    # 4x4 blocks, out of 255); the audio's loudness band covers the bottom rows.
    (saved,) = (base / "output").rglob("taesd*.latent")
    latents = load_file(str(saved))["latent_tensor"].float()
    expected = load_taeh3(base / "models" / "vae_approx" / TAEH3).frame_at(latents, 3) * 255
    clean_rows = 32 - round(32 * AUDIO_BAND)
    clean_rows -= clean_rows % 4
    drawn = torch.tensor(list(pictures[-1].convert("RGB").getdata()), dtype=torch.float32).view(32, 64, 3)

    def blocks(picture: torch.Tensor) -> torch.Tensor:  # 4x4 block means: what JPEG keeps of random detail
        return torch.nn.functional.avg_pool2d(picture[:clean_rows].permute(2, 0, 1)[None], 4)

    assert (blocks(drawn) - blocks(expected)).abs().mean() < 6


def test_every_step_gets_its_taeh3_picture_when_the_render_keeps_up(tmp_path_factory, monkeypatch):
    """In the server's own process (--in-process-jobs), each sampler step waits after handing over until its
    picture has begun, as a step of a real model outlasts a picture: every step's picture then reaches the
    client, at the picture's size, right before that step's progress."""
    begun = threading.Condition()
    pictures_begun = []
    picture, report = SamplerPreviews._picture, SamplerPreviews.report

    def counted_picture(self, frame, sound=None):
        with begun:
            pictures_begun.append(frame.shape)
            begun.notify_all()
        return picture(self, frame, sound)

    def report_then_wait_for_its_picture(self, step, total, denoised):
        report(self, step, total, denoised)
        with begun:
            assert begun.wait_for(lambda: len(pictures_begun) >= step, timeout=120)

    monkeypatch.setattr(SamplerPreviews, "_picture", counted_picture)
    monkeypatch.setattr(SamplerPreviews, "report", report_then_wait_for_its_picture)
    server = ServerThread(tmp_path_factory.mktemp("weft-in-process"), extra_args=["--in-process-jobs"])
    try:
        pictures, order = _taesd_job(server, tmp_path_factory, steps=4)
    finally:
        server.stop()
    assert order == [item for step in (1, 2, 3, 4) for item in (("picture", None), ("progress", step))]
    assert all(picture.format == "JPEG" and picture.size == (64, 32) for picture in pictures)
