"""The H3 node packs (loaders, latent, conditioning, h3, sampling, vae) through the executor, on tiny weights.

The tiny weights are written once per test session and linked into each test's base folder under the
file names a test needs (the official templates use their own names). Sizes are tiny: 32x32 or 64x64
frames, one or two sampling steps.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import av
import pytest
import torch
from safetensors.torch import save_file

from execution import context as run_context
from execution.cache import make_cache
from execution.context import Services
from execution.errors import PromptError
from execution.events import EventBus
from execution.paths import Paths
from execution.scheduler import Executor
from execution.validation import validate_prompt
from models.components import TextEncoder
from web.object_info import object_info

TINY_NAMES = {
    "transformer": ("diffusion_models", "h3_tiny_transformer.safetensors"),
    "video_vae": ("vae", "h3_tiny_video_vae.safetensors"),
    "audio_vae": ("vae", "h3_tiny_audio_vae.safetensors"),
    "text_encoder": ("text_encoders", "h3_tiny_text_encoder.safetensors"),
}


# ---------------------------------------------------------------------- helpers (also used by tests/test_templates.py)
def tiny_weights(tmp_path_factory) -> dict[str, Path]:
    """{kind: path} of the tiny weights, written once per session (shared by every module that asks)."""
    from models.h3.make_tiny import write_tiny

    root = tmp_path_factory.getbasetemp() / "h3_tiny_weights"
    paths = {kind: root / folder / name for kind, (folder, name) in TINY_NAMES.items()}
    if not all(p.is_file() for p in paths.values()):
        write_tiny(root)
    return paths


def install(weights: dict[str, Path], base: Path, names: dict[str, str] | None = None) -> None:
    """Link the tiny weights into `base`/models under their own names, or the names given per kind."""
    for kind, source in weights.items():
        folder = TINY_NAMES[kind][0]
        target = base / "models" / folder / (names or {}).get(kind, source.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)


def write_tiny_lora(path: Path, transformer_file: Path, *, text_encoder_file: Path | None = None, rank: int = 2,
                    seed: int = 5, scale: float = 0.5) -> None:
    """A small LoRA (ComfyUI key style) on the tiny transformer's attention and MLP weights (and, when a
    text encoder file is given, on its first attention projection too)."""
    from models.loading import read_header

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    targets = [(transformer_file, "diffusion_model.", ("blocks.0.attn.qkv_proj", "blocks.1.mlp.fc2", "blocks.1.attn.out_proj"))]
    if text_encoder_file is not None:
        targets.append((text_encoder_file, "text_encoder.", ("layers.0.attn.qkv_proj",)))
    for file, prefix, modules in targets:
        shapes = {k: info.shape for k, info in read_header(str(file)).tensors.items()}
        for module in modules:
            out_features, in_features = shapes[f"{module}.weight"]
            tensors[f"{prefix}{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * scale
            tensors[f"{prefix}{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * scale
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


class H3Env:
    """A base folder with the tiny models, the configured folders, and an executor over it."""

    def __init__(self, registry, base: Path, *, cache: str = "classic", runtime: Services | None = None) -> None:
        self.registry = registry
        self.paths = Paths(base).ensure()
        self.events = EventBus()
        self.runtime = runtime if runtime is not None else Services()
        self.executor = Executor(registry, cache=make_cache(cache), events=self.events, paths=self.paths,
                                 runtime=self.runtime)

    def validate(self, prompt: dict):
        return validate_prompt(prompt, self.registry)

    def run(self, prompt: dict):
        result = self.executor.run(self.validate(prompt), prompt_id=str(uuid.uuid4()))
        assert result.status == "success", result.error
        return result

    def run_error(self, prompt: dict) -> tuple[str, str]:
        """(failing node type, exception message) of a prompt that is expected to fail while running."""
        result = self.executor.run(self.validate(prompt), prompt_id=str(uuid.uuid4()))
        assert result.status == "error", result.status
        return result.error["node_type"], result.error["exception_message"]

    def output_file(self, result, node_id: str, key: str = "images") -> Path:
        item = result.outputs[node_id][key][0]
        return self.paths.folder(item["type"]) / item["subfolder"] / item["filename"]


@pytest.fixture
def configured_paths():
    """Point validation's file listings at a test's folders (and restore the previous setting after)."""
    saved = list(run_context._configured)

    def configure(paths: Paths) -> None:
        run_context.configure(paths)

    yield configure
    run_context._configured[:] = saved


@pytest.fixture
def h3(registry, tmp_path, tmp_path_factory, configured_paths) -> H3Env:
    install(tiny_weights(tmp_path_factory), tmp_path)
    env = H3Env(registry, tmp_path)
    configured_paths(env.paths)
    return env


def t2va_prompt(*, width: int = 32, height: int = 32, length: int = 5, steps: int = 1, seed: int = 7,
                sampler: str = "euler", text: str = "a red fox in the snow", save_video: bool = True) -> dict:
    """Text -> H3 latent -> video + audio, with TestOutput probes on the latent, frames and sound."""
    prompt = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_NAMES["transformer"][1], "weight_dtype": "default"}},
        "clip": {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_NAMES["text_encoder"][1], "type": "minimax"}},
        "vv": {"class_type": "VAELoader", "inputs": {"vae_name": TINY_NAMES["video_vae"][1]}},
        "av": {"class_type": "VAELoader", "inputs": {"vae_name": TINY_NAMES["audio_vae"][1]}},
        "text": {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["clip", 0]}},
        "empty": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": width, "height": height, "length": length}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "select": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}},
        "sched": {"class_type": "BasicScheduler", "inputs": {"model": ["unet", 0], "scheduler": "simple", "steps": steps,
                                                             "denoise": 1.0}},
        "guider": {"class_type": "BasicGuider", "inputs": {"model": ["unet", 0], "conditioning": ["text", 0]}},
        "sample": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["select", 0], "sigmas": ["sched", 0],
            "latent_image": ["empty", 0]}},
        "decode": {"class_type": "VAEDecode", "inputs": {"samples": ["sample", 0], "vae": ["vv", 0]}},
        "decode_audio": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["sample", 0], "vae": ["av", 0]}},
        "probe_latent": {"class_type": "TestOutput", "inputs": {"value": ["sample", 0]}},
        "probe_frames": {"class_type": "TestOutput", "inputs": {"value": ["decode", 0]}},
        "probe_audio": {"class_type": "TestOutput", "inputs": {"value": ["decode_audio", 0]}},
    }
    if save_video:
        prompt["video"] = {"class_type": "CreateVideo", "inputs": {"images": ["decode", 0], "audio": ["decode_audio", 0],
                                                                  "fps": 24.0}}
        prompt["save"] = {"class_type": "SaveVideo", "inputs": {"video": ["video", 0], "filename_prefix": "video/h3",
                                                               "format": "auto", "codec": "auto"}}
    return prompt


def probe(result, node_id: str):
    return result.outputs[node_id]["values"][0]


def mp4_streams(path: Path) -> dict:
    """What PyAV reads back from an MP4: stream kinds and codecs, frame count, audio format and duration."""
    with av.open(str(path)) as container:
        video = [s for s in container.streams if s.type == "video"]
        audio = [s for s in container.streams if s.type == "audio"]
        info = {"video_streams": len(video), "audio_streams": len(audio)}
        if video:
            info["video_codec"] = video[0].codec_context.name
            info["frames"] = sum(1 for _ in container.decode(video=0))
        if audio:
            stream = audio[0]
            info.update(audio_codec=stream.codec_context.name, channels=stream.codec_context.channels,
                        sample_rate=stream.codec_context.sample_rate,
                        audio_seconds=float(stream.duration * stream.time_base))
    return info


# ---------------------------------------------------------------------- registration and interfaces
H3_NODE_IDS = (
    "UNETLoader", "CLIPLoader", "VAELoader", "LoraLoader", "LoraLoaderModelOnly", "EmptyMiniMaxH3LatentAV",
    "SaveLatent", "LoadLatent", "CLIPTextEncode", "MiniMaxH3ImageToVideo", "MiniMaxH3ReferenceToVideo",
    "MiniMaxH3SigmaShift", "ResolutionSelector", "RandomNoise", "KSamplerSelect", "BasicScheduler", "BasicGuider",
    "SamplerCustomAdvanced", "KSampler", "VAEEncode", "VAEDecode", "VAEEncodeAudio", "VAEDecodeAudio",
)


def test_nodes_are_registered_with_comfyui_inputs_and_outputs(registry):
    for node_id in H3_NODE_IDS:
        assert node_id in registry, node_id
    info = object_info(registry)
    assert info["CLIPTextEncode"]["input_order"]["required"] == ["text", "clip"]
    assert info["KSampler"]["input_order"]["required"] == [
        "model", "seed", "steps", "cfg", "sampler_name", "scheduler", "positive", "negative", "latent_image", "denoise"]
    assert info["SamplerCustomAdvanced"]["output_name"] == ["output", "denoised_output"]
    assert info["BasicScheduler"]["input_order"]["required"] == ["model", "scheduler", "steps", "denoise"]
    assert info["CLIPLoader"]["input_order"] == {"required": ["clip_name", "type"], "optional": ["device"]}
    assert "minimax" in info["CLIPLoader"]["input"]["required"]["type"][0]
    assert set(info["KSamplerSelect"]["input"]["required"]["sampler_name"][0]) >= {"euler", "res_multistep"}
    i2v = info["MiniMaxH3ImageToVideo"]
    assert i2v["input_order"]["required"] == ["clip", "vae", "prompt", "width", "height", "length"]
    assert i2v["input_order"]["optional"] == ["first_frame", "last_frame"]
    assert i2v["output_name"] == ["positive", "LATENT"]
    r2v = info["MiniMaxH3ReferenceToVideo"]
    assert r2v["input_order"]["required"] == [
        "clip", "vae", "audio_vae", "prompt", "width", "height", "length", "ref_image_size"]
    grow = {name: r2v["input"]["optional"][name][1]["template"] for name in
            ("ref_images", "ref_videos", "ref_video_audios", "ref_audios")}
    assert {n: (g["prefix"], g["max"]) for n, g in grow.items()} == {
        "ref_images": ("ref_image_", 9), "ref_videos": ("ref_video_", 3),
        "ref_video_audios": ("ref_video_audio_", 3), "ref_audios": ("ref_audio_", 3)}
    assert info["EmptyMiniMaxH3LatentAV"]["input"]["required"]["length"][1]["default"] == 124


def test_resolution_selector_matches_the_templates_table(h3):
    # The official templates' note lists these sizes for multiple=32 at 16:9.
    prompt = {}
    table = {0.2: (608, 352), 0.4: (864, 480), 0.7: (1152, 640), 0.98: (1344, 768)}
    for i, megapixels in enumerate(table):
        prompt[f"r{i}"] = {"class_type": "ResolutionSelector", "inputs": {
            "aspect_ratio": "16:9 (Widescreen)", "megapixels": megapixels, "multiple": 32}}
        prompt[f"w{i}"] = {"class_type": "TestOutput", "inputs": {"value": [f"r{i}", 0]}}
        prompt[f"h{i}"] = {"class_type": "TestOutput", "inputs": {"value": [f"r{i}", 1]}}
    result = h3.run(prompt)
    for i, size in enumerate(table.values()):
        assert (probe(result, f"w{i}"), probe(result, f"h{i}")) == size


# ---------------------------------------------------------------------- text to video with audio
@pytest.mark.parametrize("frames, latent_t, audio_t", [(5, 2, 8), (22, 7, 37), (124, 37, 207)])
def test_text_to_video_with_audio_shapes_and_mp4(h3, frames, latent_t, audio_t):
    result = h3.run(t2va_prompt(length=frames))
    latent = probe(result, "probe_latent")
    assert tuple(latent["samples"].shape) == (1, 24, latent_t, 2, 2)
    assert tuple(latent["audio_samples"].shape) == (1, 32, 2, audio_t)
    assert latent["length"] == frames
    images = probe(result, "probe_frames")
    assert tuple(images.shape) == (frames, 32, 32, 3)
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
    audio = probe(result, "probe_audio")
    assert audio["sample_rate"] == 32000
    # The sound lasts as long as the picture, or as long as its whole 25 ms latent frames when shorter.
    assert tuple(audio["waveform"].shape) == (1, 2, min(round(frames / 24 * 32000), audio_t * 800))

    streams = mp4_streams(h3.output_file(result, "save"))
    assert streams["video_streams"] == 1 and streams["video_codec"] == "h264" and streams["frames"] == frames
    assert streams["audio_streams"] == 1 and streams["audio_codec"] == "aac"
    assert streams["channels"] == 2 and streams["sample_rate"] == 32000
    assert abs(streams["audio_seconds"] - frames / 24) < 1024 / 32000  # within one AAC frame


def test_length_snaps_up_to_the_17n_plus_5_grid_and_sizes_to_whole_latent_cells(h3):
    result = h3.run(t2va_prompt(length=6, width=40, save_video=False))
    assert probe(result, "probe_latent")["length"] == 22
    assert tuple(probe(result, "probe_frames").shape) == (22, 32, 32, 3)  # 40 px is 2.5 latent cells: floored


def test_same_seed_gives_the_same_latent_bytes(registry, tmp_path, tmp_path_factory, configured_paths):
    weights = tiny_weights(tmp_path_factory)
    saved = []
    for run, seed in enumerate((11, 11, 12)):
        base = tmp_path / f"run{run}"
        install(weights, base)
        env = H3Env(registry, base)  # a fresh executor and model cache each time: nothing is shared
        configured_paths(env.paths)
        prompt = t2va_prompt(length=22, steps=2, seed=seed, sampler="res_multistep", save_video=False)
        prompt["save_latent"] = {"class_type": "SaveLatent", "inputs": {"samples": ["sample", 0],
                                                                        "filename_prefix": "latents/h3"}}
        result = env.run(prompt)
        saved.append(env.output_file(result, "save_latent", "latents"))
    first, again, other = (p.read_bytes() for p in saved)
    assert first == again
    assert first != other


def test_save_latent_then_load_latent_round_trips_both_streams(h3):
    prompt = t2va_prompt(save_video=False)
    prompt["save_latent"] = {"class_type": "SaveLatent", "inputs": {"samples": ["sample", 0], "filename_prefix": "h3"}}
    result = h3.run(prompt)
    original = probe(result, "probe_latent")
    saved = h3.output_file(result, "save_latent", "latents")
    shutil.copyfile(saved, h3.paths.input / "again.latent")
    loaded = probe(h3.run({
        "load": {"class_type": "LoadLatent", "inputs": {"latent": "again.latent"}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["load", 0]}},
    }), "out")
    assert torch.equal(loaded["samples"], original["samples"])
    assert torch.equal(loaded["audio_samples"], original["audio_samples"])
    assert loaded["length"] == original["length"] and loaded["frame_rate"] == original["frame_rate"]


def test_load_latent_refuses_a_file_that_is_not_safetensors(h3):
    (h3.paths.input / "bad.latent").write_bytes(b"\x80\x04not a safetensors file")
    node, message = h3.run_error({"load": {"class_type": "LoadLatent", "inputs": {"latent": "bad.latent"}},
                                  "out": {"class_type": "TestOutput", "inputs": {"value": ["load", 0]}}})
    assert node == "LoadLatent" and "bad.latent" in message and "safetensors" in message


# ---------------------------------------------------------------------- caching, residency, progress, profile
def test_new_seed_reuses_loaded_models_and_the_text_encoding(h3):
    first = h3.run(t2va_prompt(seed=1, save_video=False))
    prompt = t2va_prompt(seed=2, save_video=False)
    second = h3.run(prompt)
    assert "text" not in second.executed and "clip" not in second.executed and "unet" not in second.executed
    assert "sample" in second.executed
    assert len(h3.runtime.shared("model_cache", dict)) == 4
    assert not torch.equal(probe(first, "probe_latent")["samples"], probe(second, "probe_latent")["samples"])


def test_text_encoder_stays_resident_and_prompts_are_cached_without_the_output_cache(
        registry, tmp_path, tmp_path_factory, configured_paths):
    install(tiny_weights(tmp_path_factory), tmp_path)
    env = H3Env(registry, tmp_path, cache="none")  # every job runs every node again
    configured_paths(env.paths)
    prompt = {
        "clip": {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_NAMES["text_encoder"][1], "type": "minimax"}},
        "text": {"class_type": "CLIPTextEncode", "inputs": {"text": "rain on a tin roof", "clip": ["clip", 0]}},
        "out": {"class_type": "TestOutput", "inputs": {"value": ["text", 0]}},
        "enc": {"class_type": "TestOutput", "inputs": {"value": ["clip", 0]}},
    }
    first = env.run(prompt)
    encoder = probe(first, "enc")
    calls = []
    original = encoder.handle.model.encode
    encoder.handle.model.encode = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        second = env.run(prompt)
        assert probe(second, "enc") is encoder  # the same loaded text encoder, not a new load
        assert calls == []  # the prompt's encoding came from the encoder's cache
        assert torch.equal(probe(second, "out")[0][0], probe(first, "out")[0][0])
        prompt["text"]["inputs"]["text"] = "rain on a glass roof"
        env.run(prompt)
        assert len(calls) == 1
    finally:
        encoder.handle.model.encode = original


def test_prompt_embeddings_are_read_from_the_embeddings_folder(h3):
    width = 48  # the tiny text encoder's width
    save_file({"emb_params": torch.randn(3, width, generator=torch.Generator().manual_seed(1))},
              str(h3.paths.models / "embeddings" / "style.safetensors"))
    prompt = {
        "clip": {"class_type": "CLIPLoader", "inputs": {"clip_name": TINY_NAMES["text_encoder"][1], "type": "minimax"}},
        "plain": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox", "clip": ["clip", 0]}},
        "styled": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox embedding:style", "clip": ["clip", 0]}},
        "o1": {"class_type": "TestOutput", "inputs": {"value": ["plain", 0]}},
        "o2": {"class_type": "TestOutput", "inputs": {"value": ["styled", 0]}},
    }
    result = h3.run(prompt)
    plain, styled = probe(result, "o1")[0][0], probe(result, "o2")[0][0]
    # "a fox" is 5 bytes; " embedding:style" becomes one space byte and the embedding's 3 rows.
    assert styled.shape[1] == plain.shape[1] + 1 + 3
    prompt["styled"]["inputs"]["text"] = "a fox embedding:missing_style"
    node, message = h3.run_error(prompt)
    assert node == "CLIPTextEncode" and "missing_style" in message and "embeddings" in message


def test_sampler_reports_progress_per_step(h3):
    seen = []
    h3.events.subscribe(lambda event, data: seen.append((data["value"], data["max"]))
                        if event == "progress" and data.get("node") == "sample" else None)
    h3.run(t2va_prompt(steps=3, save_video=False))
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_interrupting_stops_the_sampler_between_steps(h3):
    from execution.scheduler import JobControl

    control = JobControl()
    steps = []

    def on_event(event: str, data: dict) -> None:
        if event == "progress" and data.get("node") == "sample":
            steps.append(data["value"])
            control.interrupt()  # the next step's progress report raises

    h3.events.subscribe(on_event)
    result = h3.executor.run(h3.validate(t2va_prompt(steps=4)), prompt_id=str(uuid.uuid4()), control=control)
    assert result.status == "interrupted"
    assert steps == [1]
    assert "sample" not in result.executed and "save" not in result.executed


def test_profile_has_separate_rows_for_each_stage(h3):
    prompt = t2va_prompt(length=22)
    prompt["probe_video"] = {"class_type": "TestOutput", "inputs": {"value": ["video", 0]}}
    result = h3.run(prompt)
    # SaveVideo reads the frames the decoder wrote: the VIDEO holds the decoded tensor itself, not a copy.
    assert probe(result, "probe_video").images.data_ptr() == probe(result, "probe_frames").data_ptr()
    stages = {row["class_type"] for row in result.profile.values() if not row.get("cached")}
    assert {"CLIPTextEncode", "SamplerCustomAdvanced", "VAEDecode", "VAEDecodeAudio", "SaveVideo"} <= stages
    rows = {row["class_type"]: row for row in result.profile.values()}
    assert all(rows[name]["wall_ms"] > 0 for name in ("SamplerCustomAdvanced", "VAEDecode", "VAEDecodeAudio", "SaveVideo"))


# ---------------------------------------------------------------------- sampling nodes
def test_basic_scheduler_follows_the_shift_and_sigma_shift_node(h3):
    prompt = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_NAMES["transformer"][1], "weight_dtype": "default"}},
        "shift": {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["unet", 0], "shift_video": 1.0, "shift_audio": 1.0}},
        "s12": {"class_type": "BasicScheduler", "inputs": {"model": ["unet", 0], "scheduler": "simple", "steps": 4, "denoise": 1.0}},
        "s1": {"class_type": "BasicScheduler", "inputs": {"model": ["shift", 0], "scheduler": "simple", "steps": 4, "denoise": 1.0}},
        "o12": {"class_type": "TestOutput", "inputs": {"value": ["s12", 0]}},
        "o1": {"class_type": "TestOutput", "inputs": {"value": ["s1", 0]}},
    }
    result = h3.run(prompt)
    assert torch.allclose(probe(result, "o12"), torch.tensor([1.0, 0.9730, 0.9231, 0.8, 0.0]), atol=1e-4)
    assert torch.allclose(probe(result, "o1"), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]), atol=1e-6)


def test_basic_scheduler_normal_follows_the_shift_and_the_combo_keeps_comfyuis_order(h3):
    from models.h3.sampling import sigmas
    from web.object_info import object_info

    prompt = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_NAMES["transformer"][1], "weight_dtype": "default"}},
        "shift": {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["unet", 0], "shift_video": 3.0, "shift_audio": 1.0}},
        "s": {"class_type": "BasicScheduler", "inputs": {"model": ["shift", 0], "scheduler": "normal", "steps": 4, "denoise": 1.0}},
        "o": {"class_type": "TestOutput", "inputs": {"value": ["s", 0]}},
    }
    assert torch.equal(probe(h3.run(prompt), "o"), sigmas(4, shift=3.0, scheduler="normal"))
    comfy_order = ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal",
                   "linear_quadratic", "kl_optimal"]
    offered = object_info(h3.registry)["BasicScheduler"]["input"]["required"]["scheduler"][0]
    assert offered == [name for name in comfy_order if name in offered] and "normal" in offered


def test_ksampler_runs_every_step_of_ddim_uniform_where_basic_scheduler_keeps_steps_plus_one(h3):
    """At 7 steps ddim_uniform has eight (1000 // 7 leaves a remainder): ComfyUI's KSampler runs all eight,
    its BasicScheduler hands on the last 7 + 1 sigmas."""
    prompt = t2va_prompt(steps=2, seed=5, save_video=False)
    prompt["zero"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["text", 0]}}
    prompt["ks"] = {"class_type": "KSampler", "inputs": {
        "model": ["unet", 0], "seed": 5, "steps": 7, "cfg": 1.0, "sampler_name": "euler", "scheduler": "ddim_uniform",
        "positive": ["text", 0], "negative": ["zero", 0], "latent_image": ["empty", 0], "denoise": 1.0}}
    prompt["bs"] = {"class_type": "BasicScheduler", "inputs": {"model": ["unet", 0], "scheduler": "ddim_uniform",
                                                               "steps": 7, "denoise": 1.0}}
    prompt["probe_ks"] = {"class_type": "TestOutput", "inputs": {"value": ["ks", 0]}}
    prompt["probe_bs"] = {"class_type": "TestOutput", "inputs": {"value": ["bs", 0]}}
    seen = []
    h3.events.subscribe(lambda event, data: seen.append(data) if event == "progress" and data["node"] == "ks" else None)
    result = h3.run(prompt)
    assert probe(result, "probe_bs").numel() == 8
    assert [d["value"] for d in seen] == list(range(1, 9)) and {d["max"] for d in seen} == {8}
    assert torch.isfinite(probe(result, "probe_ks")["samples"]).all()


def test_ksampler_with_cfg_1_matches_the_custom_sampler(h3):
    prompt = t2va_prompt(steps=2, seed=3, save_video=False)
    prompt["neg"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["clip", 0]}}
    prompt["ks"] = {"class_type": "KSampler", "inputs": {
        "model": ["unet", 0], "seed": 3, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["text", 0], "negative": ["neg", 0], "latent_image": ["empty", 0], "denoise": 1.0}}
    prompt["ks_cfg"] = {"class_type": "KSampler", "inputs": {**prompt["ks"]["inputs"], "cfg": 3.0}}
    prompt["probe_ks"] = {"class_type": "TestOutput", "inputs": {"value": ["ks", 0]}}
    prompt["probe_cfg"] = {"class_type": "TestOutput", "inputs": {"value": ["ks_cfg", 0]}}
    result = h3.run(prompt)
    custom, plain, guided = (probe(result, n) for n in ("probe_latent", "probe_ks", "probe_cfg"))
    assert torch.equal(custom["samples"], plain["samples"])
    assert torch.equal(custom["audio_samples"], plain["audio_samples"])
    assert not torch.equal(plain["samples"], guided["samples"])
    assert torch.isfinite(guided["samples"]).all()


def test_ksampler_advanced_whole_range_matches_ksampler_and_two_passes_match_one(h3):
    prompt = t2va_prompt(steps=2, seed=3, save_video=False)
    common = {"model": ["unet", 0], "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
              "positive": ["text", 0], "negative": ["zero", 0]}
    prompt["zero"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["text", 0]}}
    prompt["ks"] = {"class_type": "KSampler", "inputs": {**common, "seed": 3, "latent_image": ["empty", 0],
                                                         "denoise": 1.0}}
    advanced = {**common, "add_noise": "enable", "noise_seed": 3, "latent_image": ["empty", 0], "start_at_step": 0,
                "end_at_step": 10000, "return_with_leftover_noise": "disable"}
    prompt["whole"] = {"class_type": "KSamplerAdvanced", "inputs": advanced}
    # The two-pass pattern of the official templates: the first pass stops with its noise left, the second
    # continues from it without adding any.
    prompt["first"] = {"class_type": "KSamplerAdvanced", "inputs": {**advanced, "end_at_step": 1,
                                                                    "return_with_leftover_noise": "enable"}}
    prompt["second"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **advanced, "add_noise": "disable", "latent_image": ["first", 0], "start_at_step": 1}}
    prompt["cut"] = {"class_type": "KSamplerAdvanced", "inputs": {**advanced, "end_at_step": 1}}
    prompt["none"] = {"class_type": "KSamplerAdvanced", "inputs": {**advanced, "start_at_step": 2}}
    for name in ("ks", "whole", "first", "second", "cut", "none"):
        prompt[f"probe_{name}"] = {"class_type": "TestOutput", "inputs": {"value": [name, 0]}}
    result = h3.run(prompt)
    ks, whole, first, second, cut, none = (probe(result, f"probe_{n}") for n in
                                           ("ks", "whole", "first", "second", "cut", "none"))
    assert torch.equal(ks["samples"], whole["samples"]) and torch.equal(ks["audio_samples"], whole["audio_samples"])
    assert torch.allclose(second["samples"], whole["samples"], atol=1e-6)
    assert torch.allclose(second["audio_samples"], whole["audio_samples"], atol=1e-6)
    assert not torch.allclose(first["samples"], whole["samples"], atol=1e-3)  # still noisy after one step
    assert not torch.allclose(cut["samples"], first["samples"], atol=1e-3)  # one step, ended on a clean estimate
    assert torch.equal(none["samples"], torch.zeros_like(none["samples"]))  # no step in range: passed through


def test_advanced_schedule_cuts_the_steps_asked_for():
    from nodes.sampling import advanced_schedule

    schedule = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.equal(advanced_schedule(schedule, 0, 10000, False), schedule)
    assert torch.equal(advanced_schedule(schedule, 1, 3, True), torch.tensor([0.75, 0.5, 0.25]))
    assert torch.equal(advanced_schedule(schedule, 1, 3, False), torch.tensor([0.75, 0.5, 0.0]))
    assert torch.equal(advanced_schedule(schedule, 2, 10000, True), torch.tensor([0.5, 0.25, 0.0]))
    assert advanced_schedule(schedule, 4, 10000, False).numel() == 0
    assert advanced_schedule(schedule, 3, 2, False).numel() == 0


def test_disable_noise_cfg_guider_and_manual_sigmas_on_the_custom_sampler(h3):
    prompt = t2va_prompt(steps=2, seed=3, save_video=False)
    prompt["manual"] = {"class_type": "ManualSigmas", "inputs": {"sigmas": "1.0, 0.8 0.0"}}
    prompt["zero"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["text", 0]}}
    prompt["cfg1"] = {"class_type": "CFGGuider", "inputs": {"model": ["unet", 0], "positive": ["text", 0],
                                                            "negative": ["zero", 0], "cfg": 1.0}}
    prompt["cfg3"] = {"class_type": "CFGGuider", "inputs": {**prompt["cfg1"]["inputs"], "cfg": 3.0}}
    prompt["off"] = {"class_type": "DisableNoise", "inputs": {}}
    sample = prompt["sample"]["inputs"]
    prompt["s_cfg1"] = {"class_type": "SamplerCustomAdvanced", "inputs": {**sample, "guider": ["cfg1", 0]}}
    prompt["s_cfg3"] = {"class_type": "SamplerCustomAdvanced", "inputs": {**sample, "guider": ["cfg3", 0]}}
    prompt["s_off"] = {"class_type": "SamplerCustomAdvanced", "inputs": {**sample, "noise": ["off", 0],
                                                                        "sigmas": ["manual", 0]}}
    prompt["ks_off"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ["unet", 0], "add_noise": "disable", "noise_seed": 99, "steps": 2, "cfg": 1.0,
        "sampler_name": "euler", "scheduler": "simple", "positive": ["text", 0], "negative": ["text", 0],
        "latent_image": ["empty", 0], "start_at_step": 0, "end_at_step": 10000,
        "return_with_leftover_noise": "disable"}}
    for name in ("manual", "zero", "s_cfg1", "s_cfg3", "s_off", "ks_off"):
        prompt[f"probe_{name}"] = {"class_type": "TestOutput", "inputs": {"value": [name, 0]}}
    prompt["probe_text"] = {"class_type": "TestOutput", "inputs": {"value": ["text", 0]}}
    result = h3.run(prompt)
    assert torch.allclose(probe(result, "probe_manual"), torch.tensor([1.0, 0.8, 0.0]))
    text, zero = probe(result, "probe_text"), probe(result, "probe_zero")
    assert torch.count_nonzero(text[0][0]) > 0 and torch.count_nonzero(zero[0][0]) == 0
    assert zero[0][0].shape == text[0][0].shape and zero[0][1].keys() == text[0][1].keys()
    assert torch.equal(probe(result, "probe_s_cfg1")["samples"], probe(result, "probe_latent")["samples"])
    assert not torch.equal(probe(result, "probe_s_cfg3")["samples"], probe(result, "probe_latent")["samples"])
    # Without noise the empty latent's zeros are sampled as they are: the seed no longer matters.
    off, ks_off = probe(result, "probe_s_off"), probe(result, "probe_ks_off")
    assert torch.isfinite(off["samples"]).all() and torch.isfinite(ks_off["samples"]).all()
    assert not torch.equal(ks_off["samples"], probe(result, "probe_latent")["samples"])


def test_manual_sigmas_without_a_number_names_the_input(h3):
    prompt = {"m": {"class_type": "ManualSigmas", "inputs": {"sigmas": "none"}},
              "o": {"class_type": "TestOutput", "inputs": {"value": ["m", 0]}}}
    node, message = h3.run_error(prompt)
    assert node == "ManualSigmas" and "'sigmas'" in message


def test_denoised_output_is_the_last_estimate(h3):
    prompt = t2va_prompt(steps=2, save_video=False)
    prompt["probe_denoised"] = {"class_type": "TestOutput", "inputs": {"value": ["sample", 1]}}
    result = h3.run(prompt)
    # The schedule ends at sigma 0, where the estimate and the sample coincide.
    assert torch.allclose(probe(result, "probe_denoised")["samples"], probe(result, "probe_latent")["samples"])


# ---------------------------------------------------------------------- conditioning nodes
def test_image_to_video_with_first_and_last_frame(h3):
    prompt = t2va_prompt(width=64, height=32, length=22, save_video=False)
    prompt["first"] = {"class_type": "EmptyImage", "inputs": {"width": 80, "height": 40, "batch_size": 1, "color": 0xFF0000}}
    prompt["last"] = {"class_type": "EmptyImage", "inputs": {"width": 40, "height": 40, "batch_size": 1, "color": 0x0000FF}}
    prompt["i2v"] = {"class_type": "MiniMaxH3ImageToVideo", "inputs": {
        "clip": ["clip", 0], "vae": ["vv", 0], "prompt": "a sunset", "width": 64, "height": 32, "length": 22,
        "first_frame": ["first", 0], "last_frame": ["last", 0]}}
    prompt["guider"]["inputs"]["conditioning"] = ["i2v", 0]
    prompt["sample"]["inputs"]["latent_image"] = ["i2v", 1]
    prompt["probe_cond"] = {"class_type": "TestOutput", "inputs": {"value": ["i2v", 0]}}
    result = h3.run(prompt)
    keyframes = probe(result, "probe_cond")[0][1]["keyframes"]
    assert [k["frame_index"] for k in keyframes] == [0, 21]
    assert all(tuple(k["latent"].shape) == (1, 24, 1, 2, 4) for k in keyframes)
    assert tuple(probe(result, "probe_latent")["samples"].shape) == (1, 24, 7, 2, 4)
    assert probe(result, "probe_frames").shape == (22, 32, 64, 3)


def test_reference_to_video_with_every_kind_of_reference(h3, monkeypatch):
    shown = []
    plain_encode = TextEncoder.encode

    def recording_encode(self, text, **kwargs):
        shown.append([type(reference).__name__ for reference in kwargs.get("references", ())])
        return plain_encode(self, text, **kwargs)

    monkeypatch.setattr(TextEncoder, "encode", recording_encode)
    prompt = t2va_prompt(width=64, height=32, length=22, save_video=False)
    prompt["picture"] = {"class_type": "EmptyImage", "inputs": {"width": 96, "height": 48, "batch_size": 1, "color": 0x336699}}
    prompt["clip_frames"] = {"class_type": "EmptyImage", "inputs": {"width": 40, "height": 32, "batch_size": 7, "color": 0x993366}}
    prompt["sound_latent"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 32, "height": 32, "length": 5}}
    prompt["sound"] = {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["sound_latent", 0], "vae": ["av", 0]}}
    prompt["r2v"] = {"class_type": "MiniMaxH3ReferenceToVideo", "inputs": {
        "clip": ["clip", 0], "vae": ["vv", 0], "audio_vae": ["av", 0], "prompt": "<Picture 1> walks; <Audio 1> plays",
        "width": 64, "height": 32, "length": 22, "ref_image_size": "match", "ref_video_size": "match",
        "ref_images.ref_image_0": ["picture", 0], "ref_videos.ref_video_0": ["clip_frames", 0],
        "ref_video_audios.ref_video_audio_0": ["sound", 0], "ref_audios.ref_audio_0": ["sound", 0]}}
    prompt["guider"]["inputs"]["conditioning"] = ["r2v", 0]
    prompt["sample"]["inputs"]["latent_image"] = ["r2v", 1]
    prompt["probe_cond"] = {"class_type": "TestOutput", "inputs": {"value": ["r2v", 0]}}
    result = h3.run(prompt)
    refs = probe(result, "probe_cond")[0][1]["references"]
    assert [r["kind"] for r in refs] == ["image", "video", "audio"]
    # H3's layout for the encoder: pictures, each video after its soundtrack's label, then lone sounds.
    assert shown == [["ImageReference", "AudioReference", "VideoReference", "AudioReference"]]
    # The picture is scaled down (keeping its 2:1 aspect) to the generation's 64x32 area: one 2x4 latent frame.
    assert tuple(refs[0]["latent"].shape) == (1, 24, 1, 2, 4)
    # The clip's 7 frames are cut to whole encoder clips (5 frames: 2 latent frames), 40x32 onto the 32 grid.
    assert tuple(refs[1]["latent"].shape) == (1, 24, 2, 2, 2)
    assert refs[1]["audio_latent"].shape[:3] == (1, 32, 2)
    assert refs[2]["audio_latent"].shape[:3] == (1, 32, 2)
    assert refs[2]["audio_latent"].shape[-1] == 8  # 5 frames of sound: 0.2 s at 40 latent frames per second
    assert tuple(probe(result, "probe_latent")["samples"].shape) == (1, 24, 7, 2, 4)


# ---------------------------------------------------------------------- VAE nodes
def test_vae_encode_decode_round_trip_shapes(h3):
    prompt = {
        "vv": {"class_type": "VAELoader", "inputs": {"vae_name": TINY_NAMES["video_vae"][1]}},
        "av": {"class_type": "VAELoader", "inputs": {"vae_name": TINY_NAMES["audio_vae"][1]}},
        # 32x32 frames: a larger clip makes the kernels compile the encoder's convolutions (seconds on a CPU).
        "frames": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 32, "batch_size": 22, "color": 0x808080}},
        "enc": {"class_type": "VAEEncode", "inputs": {"pixels": ["frames", 0], "vae": ["vv", 0]}},
        "dec": {"class_type": "VAEDecode", "inputs": {"samples": ["enc", 0], "vae": ["vv", 0]}},
        "silence_latent": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 32, "height": 32, "length": 22}},
        "sound": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["silence_latent", 0], "vae": ["av", 0]}},
        "enc_a": {"class_type": "VAEEncodeAudio", "inputs": {"audio": ["sound", 0], "vae": ["av", 0]}},
        "dec_a": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["enc_a", 0], "vae": ["av", 0]}},
        "o_lat": {"class_type": "TestOutput", "inputs": {"value": ["enc", 0]}},
        "o_img": {"class_type": "TestOutput", "inputs": {"value": ["dec", 0]}},
        "o_alat": {"class_type": "TestOutput", "inputs": {"value": ["enc_a", 0]}},
        "o_aud": {"class_type": "TestOutput", "inputs": {"value": ["dec_a", 0]}},
    }
    result = h3.run(prompt)
    assert tuple(probe(result, "o_lat")["samples"].shape) == (1, 24, 7, 2, 2)
    assert tuple(probe(result, "o_img").shape) == (22, 32, 32, 3)
    assert tuple(probe(result, "o_alat")["audio_samples"].shape) == (1, 32, 2, 37)
    assert tuple(probe(result, "o_aud")["waveform"].shape) == (1, 2, 37 * 800)


def test_decoders_refuse_the_other_kind_of_vae(h3):
    prompt = t2va_prompt(save_video=False)
    prompt["decode"]["inputs"]["vae"] = ["av", 0]
    node, message = h3.run_error(prompt)
    assert node == "VAEDecode" and "audio VAE" in message and "VAEDecodeAudio" in message


# ---------------------------------------------------------------------- loaders
def test_clip_loader_refuses_types_it_cannot_load(h3):
    prompt = t2va_prompt(save_video=False)
    prompt["clip"]["inputs"]["type"] = "sd3"
    with pytest.raises(PromptError) as info:
        h3.validate(prompt)
    assert "minimax" in str(info.value.to_json())


def test_loader_names_the_file_and_what_it_found(h3):
    prompt = t2va_prompt(save_video=False)
    shutil.copyfile(h3.paths.models / "vae" / TINY_NAMES["video_vae"][1],
                    h3.paths.models / "diffusion_models" / "not_a_transformer.safetensors")
    prompt["unet"]["inputs"]["unet_name"] = "not_a_transformer.safetensors"
    node, message = h3.run_error(prompt)
    assert node == "UNETLoader" and "not_a_transformer.safetensors" in message and "video vae" in message


def test_lora_changes_the_model_and_strength_zero_does_not(h3, tmp_path):
    write_tiny_lora(h3.paths.models / "loras" / "tiny_lora.safetensors",
                    h3.paths.models / "diffusion_models" / TINY_NAMES["transformer"][1])
    prompt = t2va_prompt(steps=2, save_video=False)
    for name, strength in (("lora", 1.0), ("lora_off", 0.0)):
        prompt[name] = {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": ["unet", 0], "lora_name": "tiny_lora.safetensors", "strength_model": strength}}
        prompt[f"g_{name}"] = {"class_type": "BasicGuider", "inputs": {"model": [name, 0], "conditioning": ["text", 0]}}
        prompt[f"s_{name}"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
            **prompt["sample"]["inputs"], "guider": [f"g_{name}", 0]}}
        prompt[f"p_{name}"] = {"class_type": "TestOutput", "inputs": {"value": [f"s_{name}", 0]}}
    result = h3.run(prompt)
    base = probe(result, "probe_latent")["samples"]
    assert not torch.equal(probe(result, "p_lora")["samples"], base)
    assert torch.equal(probe(result, "p_lora_off")["samples"], base)
    # The base model was not modified by the adapter: a later run without it gives the same latent again.
    again = h3.run(t2va_prompt(steps=2, seed=8, save_video=False))
    reference = h3.run(t2va_prompt(steps=2, seed=8, save_video=False))
    assert torch.equal(probe(again, "probe_latent")["samples"], probe(reference, "probe_latent")["samples"])


def test_lora_loader_applies_to_the_text_encoder_by_strength_clip(h3):
    models = h3.paths.models
    write_tiny_lora(models / "loras" / "both.safetensors", models / "diffusion_models" / TINY_NAMES["transformer"][1],
                    text_encoder_file=models / "text_encoders" / TINY_NAMES["text_encoder"][1])
    prompt = t2va_prompt(save_video=False)
    for name, strength_clip in (("with", 1.0), ("without", 0.0)):
        prompt[f"lora_{name}"] = {"class_type": "LoraLoader", "inputs": {
            "model": ["unet", 0], "clip": ["clip", 0], "lora_name": "both.safetensors", "strength_model": 1.0,
            "strength_clip": strength_clip}}
        prompt[f"text_{name}"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox in the snow",
                                                                             "clip": [f"lora_{name}", 1]}}
        prompt[f"p_{name}"] = {"class_type": "TestOutput", "inputs": {"value": [f"text_{name}", 0]}}
    prompt["p_base"] = {"class_type": "TestOutput", "inputs": {"value": ["text", 0]}}
    result = h3.run(prompt)
    base, with_lora, without = (probe(result, n)[0][0] for n in ("p_base", "p_with", "p_without"))
    assert torch.equal(without, base)
    assert not torch.equal(with_lora, base)


def test_sigma_shift_survives_a_lora_stacked_after_it(h3):
    write_tiny_lora(h3.paths.models / "loras" / "tiny_lora.safetensors",
                    h3.paths.models / "diffusion_models" / TINY_NAMES["transformer"][1])
    prompt = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_NAMES["transformer"][1], "weight_dtype": "default"}},
        "shift": {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["unet", 0], "shift_video": 1.0, "shift_audio": 1.0}},
        "lora": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["shift", 0], "lora_name": "tiny_lora.safetensors",
                                                                 "strength_model": 0.5}},
        "sched": {"class_type": "BasicScheduler", "inputs": {"model": ["lora", 0], "scheduler": "simple", "steps": 2, "denoise": 1.0}},
        "o": {"class_type": "TestOutput", "inputs": {"value": ["sched", 0]}},
    }
    assert torch.allclose(probe(h3.run(prompt), "o"), torch.tensor([1.0, 0.5, 0.0]))


def test_image_workflow_gives_one_image_per_latent(h3):
    """EmptyLatentImage -> H3 sampler -> VAEDecode -> SaveImage: one image file per latent, at the image size."""
    from PIL import Image

    prompt = t2va_prompt(width=48, height=32, save_video=False)
    for probe_id in ("decode_audio", "probe_audio", "av"):
        prompt.pop(probe_id)
    prompt["empty"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 48, "height": 32, "batch_size": 2}}
    prompt["save"] = {"class_type": "SaveImage", "inputs": {"images": ["decode", 0], "filename_prefix": "img/h3"}}
    result = h3.run(prompt)
    latent = result.outputs["probe_latent"]["values"][0]
    assert tuple(latent["samples"].shape[:3]) == (2, 24, 1)
    images = result.outputs["save"]["images"]
    assert len(images) == 2
    for item in images:
        path = h3.paths.folder(item["type"]) / item["subfolder"] / item["filename"]
        assert Image.open(path).size == (48, 32)


def test_audio_given_as_any_mapping_is_encoded_and_a_reference_takes_its_first_clip():
    from collections.abc import Mapping

    from nodes import h3 as h3_nodes
    from nodes.vae import encode_waveform

    class LazyAudio(Mapping):  # what a video-loading pack hands on: a Mapping, not a dict
        def __init__(self, waveform, rate):
            self._values = {"waveform": waveform, "sample_rate": rate}

        def __getitem__(self, key):
            return self._values[key]

        def __iter__(self):
            return iter(self._values)

        def __len__(self):
            return len(self._values)

    class RecordingVAE:
        audio_sample_rate = 16000

        def __init__(self):
            self.model = self
            self.seen = None

        def encode(self, waveform):
            self.seen = waveform
            return torch.zeros(waveform.shape[0], 32, 2, 4)

    audio = LazyAudio(torch.randn(2, 1, 800), 8000)
    first = h3_nodes._first(audio)
    assert first["waveform"].shape == (1, 1, 800) and first["sample_rate"] == 8000
    vae = RecordingVAE()
    assert encode_waveform("VAEEncodeAudio", vae, audio).shape == (2, 32, 2, 4)
    assert vae.seen.shape == (2, 2, 1600)  # resampled to the VAE's rate and made stereo
