"""Live previews: the projection fitted from a VAE, its caches, the method a job uses, and the frames a
sampler run sends (tiny H3 models)."""
from __future__ import annotations

import json
import uuid

import pytest
import torch
from PIL import Image

from execution.context import Services
from models.loading import load_model
from models import latent_preview
from nodes import previews
from nodes.loaders import VAE
from nodes.preview_settings import resolve_method
from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths and h3 are fixtures)
    TINY_NAMES, configured_paths, h3, install, t2va_prompt, tiny_weights,
)


def test_fit_recovers_a_linear_patch_decoder_exactly():
    channels, patch = 5, 4
    # Small weights around a mid-grey bias, so the known decoder's pixels stay inside [0, 1] (no clamping).
    truth = torch.randn(channels + 1, patch * patch * 3, generator=torch.Generator().manual_seed(3)) * 0.01
    truth[-1] = 0.5
    known = latent_preview.LatentProjection(truth, patch)

    def decode(latents):  # (B, C, 1, h, w) -> (B, 1, h*p, w*p, 3) through the known map
        return torch.stack([known.to_pixels(z[:, 0]) for z in latents])[:, None]

    fitted = latent_preview.fit_projection(decode, channels, patch, size=6)
    torch.testing.assert_close(fitted.weights, truth, atol=1e-4, rtol=1e-4)
    assert fitted.rgb_weights().shape == (channels + 1, 3)
    frame = torch.randn(channels, 3, 2)
    torch.testing.assert_close(fitted.to_rgb(frame), known.to_pixels(frame).view(3, patch, 2, patch, 3).mean((1, 3)),
                               atol=1e-4, rtol=1e-4)


def _video_vae(path):
    loaded = load_model(str(path))
    return VAE("video", loaded.model, path.name, path=path, metadata=loaded.metadata)


def test_projection_is_cached_beside_the_model_and_refitted_when_the_file_changes(tmp_path, tmp_path_factory,
                                                                                   monkeypatch):
    install(tiny_weights(tmp_path_factory), tmp_path)
    path = tmp_path / "models" / "vae" / TINY_NAMES["video_vae"][1]
    # Another test of this process may have fitted the same weights; this one starts as a new process would.
    monkeypatch.setattr(latent_preview, "_fits_by_file", {})
    first = latent_preview.projection_for(_video_vae(path))
    cache = path.with_name(path.name + latent_preview.CACHE_SUFFIX)
    assert cache.is_file() and json.loads(cache.read_text())["patch"] == 16
    # A new process (no in-memory fit) reads the file instead of decoding again.
    monkeypatch.setattr(latent_preview, "_fits_by_file", {})
    again = _video_vae(path)
    monkeypatch.setattr(again.model, "decode", lambda *a, **k: pytest.fail("decoded although a cached fit exists"))
    torch.testing.assert_close(latent_preview.projection_for(again).weights, first.weights, atol=1e-5, rtol=1e-4)
    # The model file changes: the cache no longer matches it.
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "source": [1, 2]}))
    monkeypatch.setattr(latent_preview, "_fits_by_file", {})
    stale = _video_vae(path)
    calls = []
    real_decode = stale.model.decode
    monkeypatch.setattr(stale.model, "decode", lambda *a, **k: calls.append(1) or real_decode(*a, **k))
    latent_preview.projection_for(stale)
    assert calls == [1]


def test_projection_from_the_model_metadata(tmp_path_factory):
    path = tiny_weights(tmp_path_factory)["video_vae"]
    vae = _video_vae(path)
    rows = [[0.0, 0.0, 0.0] for _ in range(24)]
    rows[0] = [0.5, 0.0, 0.0]
    vae.metadata = {latent_preview.METADATA_KEY: json.dumps({"weights": rows, "bias": [0.5, 0.5, 0.5]})}
    vae.path = None  # no file identity: neither the process memo nor a disk cache applies
    projection = latent_preview.projection_for(vae)
    frame = torch.zeros(24, 2, 3)
    frame[0] = 1.0
    assert torch.allclose(projection.to_rgb(frame), torch.tensor([1.0, 0.5, 0.5]).expand(2, 3, 3))


@pytest.mark.parametrize("server, job, expected", [
    ("auto", None, "latent2rgb"), ("none", None, "none"), ("none", "taesd", "taesd-like"),
    ("full", "default", "full"), ("latent2rgb", "bogus", "latent2rgb"), ("auto", "none", "none"),
])
def test_a_job_overrides_the_server_method(server, job, expected):
    extra = {} if job is None else {"preview_method": job}
    assert resolve_method(Services(preview_method=server), extra) == expected


def test_audio_strip_follows_the_energy_over_time():
    audio = torch.zeros(1, 32, 2, 64)
    audio[..., 32:] = 1.0
    strip = previews.audio_strip(audio, width=8)
    assert strip == "▁▁▁▁████"


def _run_collecting(h3, prompt, extra_data=None):
    seen = []
    h3.events.subscribe(lambda event, data: seen.append((event, data)))
    result = h3.executor.run(h3.validate(prompt), prompt_id=str(uuid.uuid4()), extra_data=extra_data or {})
    assert result.status == "success", result.error
    return seen


@pytest.mark.parametrize("method", ["latent2rgb", "taesd-like", "full"])
def test_sampler_sends_a_preview_and_an_audio_strip_every_step(h3, method):
    h3.runtime.preview_method, h3.runtime.preview_size = method, 40
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=22, steps=4, save_video=False))
    sampler = [(e, d) for e, d in seen if d.get("node") == "sample" or d.get("display_node") == "sample"]
    shots = [d for e, d in sampler if e == "preview"]
    texts = [d["text"] for e, d in sampler if e == "progress_text"]
    # One per step at most (the render thread skips a step it could not draw before the next one came),
    # and always the last step's; full decodes every 4th step only.
    assert 1 <= len(shots) <= (4 if method != "full" else 1) and 1 <= len(texts) <= 4
    progress = [d["value"] for e, d in sampler if e == "progress"]
    assert progress == [1, 2, 3, 4]
    assert max(i for i, (e, _) in enumerate(seen) if e == "preview") < next(
        i for i, (e, d) in enumerate(seen) if e == "executing" and d.get("node") == "decode")
    fmt, image, size = shots[-1]["image"]
    assert fmt == "JPEG" and size == 40 and isinstance(image, Image.Image)
    assert image.size == (40, 20)  # the 64x32 picture's aspect, long side at --preview-size
    assert all(text.startswith("audio ") and len(text) > 6 for text in texts)
    assert shots[-1]["prompt_id"] and shots[-1]["node"] == "sample"


def test_previews_are_never_larger_than_the_picture_and_a_job_can_turn_them_off(h3):
    h3.runtime.preview_method, h3.runtime.preview_size = "auto", 512
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=5, steps=2, save_video=False))
    shots = [d for e, d in seen if e == "preview"]
    assert 1 <= len(shots) <= 2 and shots[-1]["image"][1].size == (64, 32)
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=5, steps=2, seed=8, save_video=False),
                           extra_data={"preview_method": "none"})
    assert not [e for e, _ in seen if e in ("preview", "progress_text")]
    assert [d["value"] for e, d in seen if e == "progress" and d["node"] == "sample"] == [1, 2]
