"""SelectModelDevice, SelectCLIPDevice and SelectVAEDevice: ComfyUI's ids and inputs, placement through the
memory manager, and unknown devices passing through."""
from __future__ import annotations

import pytest
import torch

from models import memory
from models.components import VAE, TextEncoder
from models.h3 import transformer
from models.h3.sampling import sample, sigmas
from models.patcher import PLACED_DEVICE, ModelHandle
from nodes.registry import builtin_registry


@pytest.fixture(scope="module")
def specs():
    registry = builtin_registry()
    return {name: registry.get(name) for name in ("SelectModelDevice", "SelectCLIPDevice", "SelectVAEDevice")}


def _choices(spec):
    [device] = [i for i in spec.inputs if i.name == "device"]
    return device.choices() if callable(device.choices) else device.choices, device


def test_ids_inputs_and_outputs_are_comfyuis(specs):
    for name, (link, out) in {"SelectModelDevice": ("model", "MODEL"), "SelectCLIPDevice": ("clip", "CLIP"),
                              "SelectVAEDevice": ("vae", "VAE")}.items():
        spec = specs[name]
        assert [i.name for i in spec.inputs] == [link, "device"]
        assert spec.inputs[0].type == out and [o.type for o in spec.outputs] == [out]
        choices, device = _choices(spec)
        gpus = [f"gpu:{i}" for i in range(torch.cuda.device_count())]
        assert choices == (["default", "cpu"] if name != "SelectVAEDevice" else ["default"]) + gpus
        assert device.options.get("default") == "default"
        # Any saved value validates: the node takes the input whole, as ComfyUI's does.
        assert "device" in spec.validate_takes and spec.validate_inputs(device="gpu:9") is True


def tiny_handle() -> ModelHandle:
    torch.manual_seed(0)
    model = transformer.H3Transformer(transformer.TINY_CONFIG).eval()
    return ModelHandle(model, name="tiny")


def test_an_unknown_or_missing_device_passes_the_value_through(specs):
    handle = tiny_handle()
    missing = f"gpu:{torch.cuda.device_count() + 3}"
    for value in (missing, "tpu:0", "cuda"):
        assert specs["SelectModelDevice"].execute(model=handle, device=value)[0] is handle
    vae = VAE("video", torch.nn.Linear(2, 2), "v")
    assert specs["SelectVAEDevice"].execute(vae=vae, device=missing)[0] is vae
    assert specs["SelectVAEDevice"].execute(vae=vae, device="cpu")[0] is vae  # the VAE node offers no cpu


def test_placing_a_model_sets_its_device_and_default_restores_the_loaders(specs):
    handle = tiny_handle()
    on_cpu = specs["SelectModelDevice"].execute(model=handle, device="cpu")[0]
    assert on_cpu.options[PLACED_DEVICE] == torch.device("cpu") and on_cpu.model is handle.model
    back = specs["SelectModelDevice"].execute(model=on_cpu, device="default")[0]
    assert back.options[PLACED_DEVICE] is None


def test_a_model_placed_on_the_cpu_samples_like_the_default(specs):
    memory.configure(device="cpu")
    try:
        handle = tiny_handle()
        placed = specs["SelectModelDevice"].execute(model=handle, device="cpu")[0]
        latent = {"samples": torch.zeros(1, 24, 2, 4, 4), "audio_samples": torch.zeros(1, 32, 2, 3)}
        conditioning = [[torch.randn(1, 3, transformer.TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(1)), {}]]
        want = sample(handle, latent, conditioning, sigmas(2), noise_seed=3)
        got = sample(placed, latent, conditioning, sigmas(2), noise_seed=3)
        assert torch.equal(got["samples"], want["samples"]) and torch.equal(got["audio_samples"], want["audio_samples"])
    finally:
        memory.unconfigure()


def test_a_placed_model_gets_a_manager_of_its_device_made_like_the_configured_one():
    configured = memory.configure(device="cpu", vram_budget_gb=1.0)
    try:
        with memory.placed_on("cpu"):
            assert memory.manager() is configured
        with memory.placed_on("meta"):  # stands for a second device on a machine without GPUs
            other = memory.manager()
            assert other is not configured and other.device == torch.device("meta")
            assert other.fixed_budget_bytes == configured.fixed_budget_bytes and other.mode == configured.mode
            assert memory.compute_device() == torch.device("meta")
        assert memory.manager() is configured
    finally:
        memory.unconfigure()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_model_placed_on_gpu0_runs_there(specs):
    memory.configure(device="cpu")
    try:
        placed = specs["SelectModelDevice"].execute(model=tiny_handle(), device="gpu:0")[0]
        with placed.active():
            assert memory.compute_device() == torch.device("cuda", 0)
    finally:
        memory.unconfigure()


def test_clip_placement_keeps_the_encoder_and_sets_its_device(specs):
    class Encoder(torch.nn.Module):
        def encode(self, texts, embeddings=None):
            return torch.zeros(1, 2, 4), torch.ones(1, 2, dtype=torch.bool)

    clip = TextEncoder(ModelHandle(Encoder(), name="enc"), "enc")
    placed = specs["SelectCLIPDevice"].execute(clip=clip, device="cpu")[0]
    assert placed.handle.options[PLACED_DEVICE] == torch.device("cpu") and placed.model is clip.model
    assert specs["SelectCLIPDevice"].execute(clip=clip, device="gpu:99")[0] is clip
