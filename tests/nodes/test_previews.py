"""Live previews: the projection fitted from a VAE, its caches, the method a job uses, and the frames a
sampler run sends (tiny H3 models)."""
from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch
from PIL import Image

from execution.context import Services
from models import latent_preview
from models.loading import load_model
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


def _listing(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


def test_projection_is_cached_in_weft_cache_folder_never_in_models_and_refitted_when_the_file_changes(
        tmp_path, tmp_path_factory, monkeypatch):
    install(tiny_weights(tmp_path_factory), tmp_path)
    models = tmp_path / "models"
    path = models / "vae" / TINY_NAMES["video_vae"][1]
    before = _listing(models)
    cache_dir = latent_preview.cache_folder(tmp_path / "user")
    # Another test of this process may have fitted the same weights; this one starts as a new process would.
    monkeypatch.setattr(latent_preview, "_fits_by_file", {})
    announced = []
    first = latent_preview.projection_for(_video_vae(path), cache_dir, announce=lambda: announced.append(1))
    assert announced == [1]  # a fit says so before it decodes
    assert _listing(models) == before  # nothing written into the models folder
    cached = list(cache_dir.glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["patch"] == 16
    # A new process (no in-memory fit) reads the file instead of decoding again.
    monkeypatch.setattr(latent_preview, "_fits_by_file", {})
    again = _video_vae(path)
    monkeypatch.setattr(again.model, "decode", lambda *a, **k: pytest.fail("decoded although a cached fit exists"))
    torch.testing.assert_close(latent_preview.projection_for(again, cache_dir).weights, first.weights, atol=1e-5, rtol=1e-4)
    # A changed model file is fitted again.
    cache = cached[0]
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


EDITOR = {"comfy_usage_source": "comfyui-frontend"}


@pytest.mark.parametrize("server, extra, expected", [
    ("auto", {}, "latent2rgb"), ("none", {}, "none"), ("none", {"preview_method": "taesd"}, "taesd"),
    ("full", {"preview_method": "default"}, "full"), ("latent2rgb", {"preview_method": "bogus"}, "latent2rgb"),
    ("auto", {"preview_method": "none"}, "none"),
    # A server started without a method: only a job that asks gets previews (the editor's own jobs ask).
    (None, {}, "none"), (None, {"preview_method": "default"}, "none"), (None, {"preview_method": "taesd"}, "taesd"),
    (None, EDITOR, "latent2rgb"), (None, {**EDITOR, "preview_method": "none"}, "none"), ("none", EDITOR, "none"),
])
def test_a_job_overrides_the_server_method_and_none_is_the_default(server, extra, expected):
    assert resolve_method(Services(preview_method=server), extra) == expected


def test_audio_loudness_follows_the_energy_over_time_and_is_drawn_into_the_picture():
    audio = torch.zeros(1, 32, 2, 64)
    audio[..., 32:] = 1.0
    assert previews.audio_loudness(audio, 8).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    grey = np.full((20, 40, 3), 128, dtype=np.uint8)
    drawn = previews.draw_audio_band(grey, audio)
    assert drawn is grey and drawn.shape == (20, 40, 3)  # drawn in place
    assert tuple(drawn[19, 35]) == (120, 220, 160) == tuple(drawn[19, 5])  # each half has a bar (the quiet one low)
    assert tuple(drawn[15, 35]) == (120, 220, 160) and tuple(drawn[15, 5]) != (120, 220, 160)  # the loud is taller
    assert tuple(drawn[15, 5]) == (50, 50, 50)  # the band's background: darkened towards its shade
    assert (drawn[:20 - previews.AUDIO_BAND_MIN_PX] == 128).all()  # the picture above the band (6 rows) is untouched


def _run_collecting(h3, prompt, extra_data=None):
    seen = []
    h3.events.subscribe(lambda event, data: seen.append((event, data)))
    result = h3.executor.run(h3.validate(prompt), prompt_id=str(uuid.uuid4()), extra_data=extra_data or {})
    assert result.status == "success", result.error
    return seen


@pytest.mark.parametrize("method", ["latent2rgb", "taesd-like", "full"])
def test_sampler_sends_a_preview_with_its_audio_band_and_progress_in_order_every_step(h3, method):
    h3.runtime.preview_method, h3.runtime.preview_size = method, 40
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=22, steps=4, save_video=False))
    sampler = [(e, d) for e, d in seen if d.get("node") == "sample" or d.get("display_node") == "sample"
               or (e == "progress_state" and d["nodes"].get("sample", {}).get("state") == "running")]
    shots = [d for e, d in sampler if e == "preview"]
    # One per step at most (the render thread skips a step it could not draw before the next one came, or
    # one that came within the pictures' share of time), and always the last step's; full decodes every
    # 4th step only. The audio is drawn into the picture.
    assert 1 <= len(shots) <= (4 if method != "full" else 1)
    # The only text: the first preview's fit announcing itself (when this process had not fitted the VAE yet).
    assert all(d["text"].startswith("preparing live previews") for e, d in sampler if e == "progress_text")
    progress = [d["value"] for e, d in sampler if e == "progress"]
    assert progress == [1, 2, 3, 4]
    # ComfyUI's order within a step: progress_state, the preview, then progress.
    for i, (event, data) in enumerate(sampler):
        if event == "preview":
            assert sampler[i - 1][0] == "progress_state" and sampler[i + 1][0] == "progress"
    assert max(i for i, (e, _) in enumerate(seen) if e == "preview") < next(
        i for i, (e, d) in enumerate(seen) if e == "executing" and d.get("node") == "decode")
    fmt, image, size = shots[-1]["image"]
    assert fmt == "JPEG" and size == 40 and isinstance(image, Image.Image)
    assert image.size == (40, 20)  # the 64x32 picture's aspect, long side at --preview-size
    assert shots[-1]["prompt_id"] and shots[-1]["node"] == "sample"


def test_no_previews_and_no_fit_unless_asked_and_nothing_written_into_models(h3, tmp_path):
    models = h3.paths.models
    before = _listing(models)
    h3.runtime.preview_method = None  # a server started without --preview-method
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=5, steps=2, seed=11, save_video=False))
    assert not [e for e, _ in seen if e in ("preview", "progress_text")]
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=5, steps=2, seed=12, save_video=False),
                           extra_data={"preview_method": "latent2rgb"})
    assert [e for e, _ in seen if e == "preview"]
    assert _listing(models) == before


def test_previews_are_never_larger_than_the_picture_and_a_job_can_turn_them_off(h3):
    h3.runtime.preview_method, h3.runtime.preview_size = "auto", 512
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=5, steps=2, save_video=False))
    shots = [d for e, d in seen if e == "preview"]
    assert 1 <= len(shots) <= 2 and shots[-1]["image"][1].size == (64, 32)
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=5, steps=2, seed=8, save_video=False),
                           extra_data={"preview_method": "none"})
    assert not [e for e, _ in seen if e in ("preview", "progress_text")]
    assert [d["value"] for e, d in seen if e == "progress" and d["node"] == "sample"] == [1, 2]


def test_vae_decodes_report_progress_per_tile_and_per_chunk(h3):
    """VAE Decode's bar moves tile by tile (every tile of every temporal window), VAE Decode Audio's chunk
    by chunk; both end full."""
    h3.runtime.preview_method = "none"
    # 80x48 pixels: 5x3 latent cells, tiled by 2x2-cell tiles (32 px) -> 4x2 = 8 tiles per window.
    prompt = t2va_prompt(width=80, height=48, length=22, steps=1, seed=31, save_video=False)
    prompt["decode"] = {"class_type": "VAEDecodeTiled", "inputs": {
        "samples": ["sample", 0], "vae": ["vv", 0], "tile_size": 64, "overlap": 16, "temporal_size": 64,
        "temporal_overlap": 8}}
    seen = _run_collecting(h3, prompt)
    tiles = [(d["value"], d["max"]) for e, d in seen if e == "progress" and d["node"] == "decode"]
    assert len(tiles) >= 2 and tiles[-1][0] == tiles[-1][1] and [v for v, _ in tiles] == sorted(v for v, _ in tiles)
    audio = [(d["value"], d["max"]) for e, d in seen if e == "progress" and d["node"] == "decode_audio"]
    assert audio and audio[-1][0] == audio[-1][1]


def _install_taeh3(h3) -> None:
    from models.h3.tiny_released import TAEH3, taeh3_bytes

    folder = h3.paths.models / "vae_approx"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TAEH3).write_bytes(taeh3_bytes())


def test_taesd_previews_are_taeh3_frames_of_the_picture_size_every_step(h3, monkeypatch):
    from models.h3.taeh3 import TAEH3Decoder

    _install_taeh3(h3)
    decoded = []
    frame_at = TAEH3Decoder.frame_at

    def recording(self, latents, index):
        decoded.append((self, latents.clone(), index))
        return frame_at(self, latents, index)

    monkeypatch.setattr(TAEH3Decoder, "frame_at", recording)
    h3.runtime.preview_method, h3.runtime.preview_size = None, 512
    prompt = t2va_prompt(width=64, height=32, length=22, steps=3, save_video=False)
    prompt["probe_denoised"] = {"class_type": "TestOutput", "inputs": {"value": ["sample", 1]}}
    seen = []
    h3.events.subscribe(lambda event, data: seen.append((event, data)))
    result = h3.executor.run(h3.validate(prompt), prompt_id=str(uuid.uuid4()),
                             extra_data={"preview_method": "taesd"})  # as the editor's "TAESD" setting sends it
    assert result.status == "success", result.error
    denoised = result.outputs["probe_denoised"]["values"][0]["samples"]
    shots = [d for e, d in seen if e == "preview" and d["node"] == "sample"]
    assert 1 <= len(shots) <= 3 and len(decoded) == len(shots)
    counts = result.profile["sample"]["counts"]  # the pictures and the render thread's CPU for them
    assert counts["preview_pictures"] == len(shots) and counts["preview_cpu_ms"] > 0
    assert all(d["image"][1].size == (64, 32) for d in shots)  # taeh3 draws at full resolution: 16x the latent
    decoder, latents, index = decoded[-1]
    assert tuple(latents.shape) == (1, 24, 4, 2, 4) and index == 3  # middle latent 3 of 7, from its clip's start
    assert torch.equal(latents, denoised[:1, :, :4].float())  # the last step's estimate is what was drawn
    expected = (frame_at(decoder, latents, index) * 255).numpy()
    picture = torch.tensor(list(shots[-1]["image"][1].convert("RGB").getdata()), dtype=torch.float32)
    band = round(32 * previews.AUDIO_BAND)  # the audio's loudness is drawn over the bottom rows
    drawn = picture.view(32, 64, 3)[:32 - band]
    assert (drawn - torch.tensor(expected[:32 - band])).abs().mean() < 1  # rounding to 8 bits only


def test_taesd_without_the_file_falls_back_to_latent2rgb_and_says_so_once(h3, caplog):
    h3.runtime.preview_method = "taesd"
    with caplog.at_level("INFO", logger="nodes.previews"):
        for seed in (1, 2):
            seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=5, steps=2, seed=seed,
                                                    save_video=False))
            assert [e for e, _ in seen if e == "preview"]
    said = [r for r in caplog.records if "taeh3.safetensors" in r.getMessage()]
    assert len(said) == 1 and "latent2rgb" in said[0].getMessage()


def _mkl_threads_here() -> int | None:
    """MKL's thread count for the calling thread, as torch reports it (None without MKL)."""
    for line in torch.__config__.parallel_info().splitlines():
        if "mkl_get_max_threads()" in line:
            return int(line.split(":")[-1])
    return None


@pytest.mark.parametrize("set_explicitly", [False, True])
def test_the_render_thread_draws_with_one_cpu_thread_and_leaves_the_others_theirs(set_explicitly):
    """Both per-thread counts, OpenMP's and MKL's, drop to 1 on the render thread, also in a process whose
    count was set explicitly (as a Ray worker sets it; MKL's used to stay at the process's count there)."""
    import threading

    before = torch.get_num_threads()
    if set_explicitly:
        torch.set_num_threads(before)
    seen = {}

    def helper():
        seen["limited"] = latent_preview.one_cpu_thread_here()
        seen["threads"] = torch.get_num_threads()
        seen["mkl"] = _mkl_threads_here()

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    later = threading.Thread(target=lambda: seen.setdefault("later", torch.get_num_threads()))
    later.start()
    later.join()
    if seen["limited"]:  # torch with OpenMP (the Linux and Windows wheels)
        assert seen["threads"] == 1 and seen["mkl"] in (1, None)
    assert torch.get_num_threads() == before and seen["later"] == before


def test_a_render_slower_than_the_sampler_drops_waiting_pictures_never_steps_and_draws_the_last(h3, monkeypatch):
    """The first picture is held until the sampler has reported step 3 of 4: a sampler that waited for its
    pictures would never get there. The pictures of the steps that came meanwhile are replaced by the
    newest; every step still reports its progress, in order, and the last step is drawn."""
    import threading

    _install_taeh3(h3)
    drawing_first, reported_three = threading.Event(), threading.Event()
    picture, report = previews.SamplerPreviews._picture, previews.SamplerPreviews.report

    def slow_first_picture(self, frame, sound=None):
        if not reported_three.is_set():
            drawing_first.set()
            assert reported_three.wait(timeout=120), "the sampler waited for a picture"
        return picture(self, frame, sound)

    def reporting(self, step, total, denoised):
        report(self, step, total, denoised)
        if step == 1:  # the render thread has step 1 in hand before step 2 comes (its start takes a moment)
            assert drawing_first.wait(timeout=120)
        if step == 3:
            reported_three.set()

    monkeypatch.setattr(previews.SamplerPreviews, "_picture", slow_first_picture)
    monkeypatch.setattr(previews.SamplerPreviews, "report", reporting)
    h3.runtime.preview_method, h3.runtime.preview_size = None, 512
    seen = _run_collecting(h3, t2va_prompt(width=64, height=32, length=5, steps=4, seed=21, save_video=False),
                           extra_data={"preview_method": "taesd"})
    sampler = [(e, d) for e, d in seen if e in ("preview", "progress") and d.get("node") == "sample"]
    assert [d["value"] for e, d in sampler if e == "progress"] == [1, 2, 3, 4]
    drawn = [sampler[i + 1][1]["value"] for i, (e, _) in enumerate(sampler) if e == "preview"]
    assert drawn[0] == 1 and drawn[-1] == 4 and 2 not in drawn and len(drawn) <= 3


@pytest.mark.parametrize("ending", ["finished", "failed"])
def test_a_render_needing_a_core_gets_one_from_the_sampler_team_which_gets_it_back_when_the_block_ends(
        h3, monkeypatch, ending):
    """Once a picture takes RENDER_CORE_SHARE of a step (0 here: from the second step, whatever this
    machine's speed), the sampler's thread runs a team one smaller; leaving the block, finished or failed,
    puts its count back and leaves the count new threads start with alone. A later run of the same shape
    gives the core from its first step."""
    import threading

    if not latent_preview._counts_are_per_thread():
        pytest.skip("this torch keeps one CPU thread count for the whole process")
    _install_taeh3(h3)
    process = torch.get_num_threads()
    torch.set_num_threads(3)  # a team of 3 whatever this machine's cores: new threads start with it
    seen = {"during": [], "after": []}
    report, close = previews.SamplerPreviews.report, previews.SamplerPreviews.close

    def reporting(self, step, total, denoised):
        report(self, step, total, denoised)
        seen["during"].append((step, torch.get_num_threads()))
        if ending == "failed" and step == 3:
            raise RuntimeError("the sampler failed at step 3")

    def closing(self, *, wait=True):
        close(self, wait=wait)
        seen["after"].append(torch.get_num_threads())
        fresh = threading.Thread(target=lambda: seen.setdefault("new thread", torch.get_num_threads()))
        fresh.start()
        fresh.join()

    monkeypatch.setattr(previews, "RENDER_CORE_SHARE", 0.0)
    monkeypatch.setattr(previews, "SLOWER", 1e9)  # the trial keeps the smaller team, whatever the timing
    monkeypatch.setattr(previews.SamplerPreviews, "report", reporting)
    monkeypatch.setattr(previews.SamplerPreviews, "close", closing)
    h3.runtime.preview_method, h3.runtime.preview_size = None, 512
    runs = []
    try:
        for seed in (22, 24):  # two seeds: the second run is not served from the cache
            seen["during"].clear()
            prompt = t2va_prompt(width=64, height=32, length=5, steps=4, seed=seed, save_video=False)
            runs.append(h3.executor.run(h3.validate(prompt), prompt_id=str(uuid.uuid4()),
                                        extra_data={"preview_method": "taesd"}))
    finally:
        torch.set_num_threads(process)
    assert seen["after"] == [3, 3] and seen["new thread"] == 3
    first, second = runs
    if ending == "failed":
        assert first.status == second.status == "error" and "step 3" in str(first.error)
        return
    assert first.status == "success", first.error
    assert first.profile["sample"]["notes"]["preview_core"] == [{"from_step": 2, "sampler_threads": 2}]
    assert second.profile["sample"]["notes"]["preview_core"] == [{"from_step": 1, "sampler_threads": 2}]
    assert seen["during"] == [(1, 2), (2, 2), (3, 2), (4, 2)]


def test_light_pictures_leave_the_sampler_team_whole(h3, monkeypatch):
    """Pictures that take little of a step (a share no picture reaches, here) never take a core."""
    _install_taeh3(h3)
    counts = []
    report = previews.SamplerPreviews.report
    monkeypatch.setattr(previews, "RENDER_CORE_SHARE", 1e9)
    monkeypatch.setattr(previews.SamplerPreviews, "report",
                        lambda self, *args: (report(self, *args), counts.append(torch.get_num_threads())))
    h3.runtime.preview_method, h3.runtime.preview_size = None, 512
    prompt = t2va_prompt(width=64, height=32, length=5, steps=3, seed=23, save_video=False)
    result = h3.executor.run(h3.validate(prompt), prompt_id=str(uuid.uuid4()), extra_data={"preview_method": "taesd"})
    assert result.status == "success", result.error
    assert "preview_core" not in result.profile["sample"].get("notes", {})
    assert counts == [torch.get_num_threads()] * 3


def _render_core(notes, runtime):
    from types import SimpleNamespace

    ctx = SimpleNamespace(runtime=runtime, node_id="7", note_profile=lambda name, value: notes.append((name, value)))
    return previews.RenderCore(ctx, ("taesd", (1, 24, 4, 2, 4)))


@pytest.mark.parametrize("slower", [False, True])
def test_the_smaller_team_is_on_trial_and_the_outcome_is_remembered(monkeypatch, slower):
    """Steps 1-2 are 10 ms apart and pictures take 3 ms (0.3 of a step): the core is given at step 2. The
    two steps after are 8 ms (kept) or 15 ms (more than 1.2x the 10 ms: the team takes its core back at
    step 4). A later run of the same kind starts with the outcome."""
    if not latent_preview._counts_are_per_thread():
        pytest.skip("this torch keeps one CPU thread count for the whole process")
    process = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        notes, runtime, counts = [], Services(), []
        core = _render_core(notes, runtime)
        after = 0.015 if slower else 0.008
        for step, now in ((1, 0.0), (2, 0.010), (3, 0.010 + after), (4, 0.010 + 2 * after), (5, 0.010 + 3 * after)):
            core.step(step, 0.003, now)
            counts.append(torch.get_num_threads())
        if slower:
            assert counts == [3, 2, 2, 3, 3]
            assert notes == [("preview_core", {"from_step": 2, "sampler_threads": 2}),
                             ("preview_core", {"back_at_step": 4, "sampler_threads": 3})]
        else:
            assert counts == [3, 2, 2, 2, 2] and notes == [("preview_core", {"from_step": 2, "sampler_threads": 2})]
        core.release()
        assert torch.get_num_threads() == 3
        notes.clear()
        later = _render_core(notes, runtime)
        later.step(1, 0.0, 1.0)  # no picture yet: only the remembered outcome decides
        assert torch.get_num_threads() == (3 if slower else 2)
        assert notes == ([] if slower else [("preview_core", {"from_step": 1, "sampler_threads": 2})])
        later.release()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(process)


def test_a_picture_under_the_share_keeps_the_team_whole():
    assert previews.RENDER_CORE_SHARE > 0.02
    process = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        notes = []
        core = _render_core(notes, Services())
        for step in range(1, 6):
            core.step(step, 0.0002, step * 0.010)  # 0.02 of a step
            assert torch.get_num_threads() == 2
        assert notes == []
    finally:
        torch.set_num_threads(process)
