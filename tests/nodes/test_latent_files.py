"""SaveLatent / LoadLatent on H3's latents: every kind of LATENT Weft makes goes through a `.latent` file and
comes back bit for bit; a latent saved in one run decodes in another; another model family's latent is
refused."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths and h3 are fixtures)
    H3Env, configured_paths, h3, install, t2va_prompt, tiny_weights)

# Each kind of LATENT the nodes make: name -> (node, output index) in `kinds_prompt`.
KINDS = {
    "sampled_av": ("sample", 0),  # both streams, frame_rate, length
    "masked_av": ("masked", 0),  # both streams and both noise masks
    "video_only": ("separate", 0),  # LTXVSeparateAVLatent's picture stream (with its mask)
    "audio_only": ("separate", 1),  # its sound stream: "type": "audio"
    "image": ("image", 0),  # EmptyLatentImage: one latent frame, an empty sound stream
    "encoded_video": ("encode", 0),  # VAEEncode
    "encoded_audio": ("encode_audio", 0),  # VAEEncodeAudio
}


def kinds_prompt() -> dict:
    prompt = t2va_prompt(save_video=False)
    prompt.update({
        "ranges": {"class_type": "MiniMaxH3FrameRangeMasks", "inputs": {"samples": ["sample", 0], "start_frame": 1,
                                                                        "frame_count": 2}},
        "masked": {"class_type": "MiniMaxH3SetLatentNoiseMasks", "inputs": {
            "samples": ["sample", 0], "video_mask": ["ranges", 0], "audio_mask": ["ranges", 1]}},
        "separate": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["masked", 0]}},
        "image": {"class_type": "EmptyLatentImage", "inputs": {"width": 32, "height": 48, "batch_size": 2}},
        "encode": {"class_type": "VAEEncode", "inputs": {"pixels": ["decode", 0], "vae": ["vv", 0]}},
        "encode_audio": {"class_type": "VAEEncodeAudio", "inputs": {"audio": ["decode_audio", 0], "vae": ["av", 0]}},
    })
    for name, (node, index) in KINDS.items():
        prompt[f"save_{name}"] = {"class_type": "SaveLatent", "inputs": {"samples": [node, index],
                                                                          "filename_prefix": f"kinds/{name}"}}
        prompt[f"probe_{name}"] = {"class_type": "TestOutput", "inputs": {"value": [node, index]}}
    return prompt


def same_latent(loaded: dict, original: dict) -> None:
    """Equal keys (entries holding None aside), tensors equal bit for bit with their dtypes, other values equal."""
    original = {k: v for k, v in original.items() if v is not None}
    assert sorted(loaded) == sorted(original)
    for key, value in original.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value and type(loaded[key]) is type(value), key


def load_prompt(name: str, *, decode: bool = False) -> dict:
    prompt = {"load": {"class_type": "LoadLatent", "inputs": {"latent": name}},
              "out": {"class_type": "TestOutput", "inputs": {"value": ["load", 0]}}}
    if decode:
        base = t2va_prompt(save_video=False)
        for node in ("vv", "av", "decode", "decode_audio", "probe_frames", "probe_audio"):
            prompt[node] = base[node]
        prompt["decode"]["inputs"]["samples"] = prompt["decode_audio"]["inputs"]["samples"] = ["load", 0]
    return prompt


def _separate_run(registry, folder, weights, configured_paths) -> H3Env:
    """A run with its own executor, models and folders under `folder`: it shares nothing with another but files."""
    install(weights, folder)
    env = H3Env(registry, folder)
    configured_paths(env.paths)
    return env


def test_every_kind_of_latent_round_trips_bit_for_bit_and_decodes_in_another_run(
        registry, tmp_path, tmp_path_factory, configured_paths):  # noqa: F811
    weights = tiny_weights(tmp_path_factory)
    first = _separate_run(registry, tmp_path / "one", weights, configured_paths)
    made = first.run(kinds_prompt())
    # Another run, with its own executor, models and folders: it sees only the files.
    second = _separate_run(registry, tmp_path / "two", weights, configured_paths)
    for name in KINDS:
        saved = first.output_file(made, f"save_{name}", "latents")
        with safe_open(str(saved), framework="pt") as handle:
            metadata = handle.metadata()
            assert "latent_format_version_0" in handle.keys()
        assert json.loads(metadata["prompt"])["sample"]["class_type"] == "SamplerCustomAdvanced"
        assert metadata["latent_family"] == "minimax_h3"
        shutil.copyfile(saved, second.paths.input / f"{name}.latent")
        loaded = second.run(load_prompt(f"{name}.latent"))
        same_latent(loaded.outputs["out"]["values"][0], made.outputs[f"probe_{name}"]["values"][0])
    original = made.outputs["probe_masked_av"]["values"][0]
    assert original["noise_mask"] is not None and original["audio_noise_mask"] is not None  # the masks were there
    assert made.outputs["probe_audio_only"]["values"][0]["type"] == "audio"

    decoded = second.run(load_prompt("sampled_av.latent", decode=True))
    assert torch.equal(decoded.outputs["probe_frames"]["values"][0], made.outputs["probe_frames"]["values"][0])
    assert torch.equal(decoded.outputs["probe_audio"]["values"][0]["waveform"],
                       made.outputs["probe_audio"]["values"][0]["waveform"])


def test_a_latent_of_another_model_family_is_refused_naming_the_file_and_the_shapes(h3):  # noqa: F811
    # As ComfyUI saves an SD latent: four channels, the marker, no family entry.
    save_file({"latent_tensor": torch.zeros(1, 4, 8, 8), "latent_format_version_0": torch.tensor([])},
              str(h3.paths.input / "sd.latent"), metadata={"prompt": "{}"})
    node, message = h3.run_error(load_prompt("sd.latent"))
    assert node == "LoadLatent"
    assert "sd.latent" in message and "another model family" in message and "[1, 4, 8, 8]" in message
    assert "input 'latent'" in message

    # An H3-shaped tensor in a file that says it is another family's.
    save_file({"latent_tensor": torch.zeros(1, 24, 2, 2, 2), "latent_format_version_0": torch.tensor([])},
              str(h3.paths.input / "other.latent"), metadata={"latent_family": "wan21"})
    node, message = h3.run_error(load_prompt("other.latent"))
    assert node == "LoadLatent" and "'wan21'" in message and "other.latent" in message


def test_a_latent_file_with_damaged_fields_is_refused(h3):  # noqa: F811
    save_file({"latent_tensor": torch.zeros(1, 24, 2, 2, 2)}, str(h3.paths.input / "odd.latent"),
              metadata={"latent_fields": "[1, 2"})
    node, message = h3.run_error(load_prompt("odd.latent"))
    assert node == "LoadLatent" and "odd.latent" in message and "metadata" in message


def _ksampler(latent: list, *, add_noise: str, start: int, end: int, leftover: str) -> dict:
    return {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ["unet", 0], "add_noise": add_noise, "noise_seed": 11, "steps": 4, "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "positive": ["text", 0], "negative": ["text", 0], "latent_image": latent,
        "start_at_step": start, "end_at_step": end, "return_with_leftover_noise": leftover}}


def test_a_latent_saved_part_way_through_the_schedule_is_finished_by_another_run(
        registry, tmp_path, tmp_path_factory, configured_paths):  # noqa: F811
    weights = tiny_weights(tmp_path_factory)
    first = _separate_run(registry, tmp_path / "one", weights, configured_paths)
    base = t2va_prompt(save_video=False, length=22)
    prompt = {node: base[node] for node in ("unet", "clip", "text", "empty")}
    prompt.update({
        # Frames 5-14 generated, the rest kept: the file must carry the noise masks for run 2 to keep them too.
        "ranges": {"class_type": "MiniMaxH3FrameRangeMasks", "inputs": {"samples": ["empty", 0], "start_frame": 5,
                                                                        "frame_count": 10}},
        "masked": {"class_type": "MiniMaxH3SetLatentNoiseMasks", "inputs": {
            "samples": ["empty", 0], "video_mask": ["ranges", 0], "audio_mask": ["ranges", 1]}},
        # Steps 0-1 of 4, keeping the noise that is left, saved; and, for reference, all 4 steps in one go.
        "half": _ksampler(["masked", 0], add_noise="enable", start=0, end=2, leftover="enable"),
        "save": {"class_type": "SaveLatent", "inputs": {"samples": ["half", 0], "filename_prefix": "part/half"}},
        "whole": _ksampler(["masked", 0], add_noise="enable", start=0, end=10000, leftover="disable"),
        "probe_whole": {"class_type": "TestOutput", "inputs": {"value": ["whole", 0]}},
    })
    made = first.run(prompt)

    # Another run with its own executor, cache, models and folders finishes steps 2-3 from the file.
    second = _separate_run(registry, tmp_path / "two", weights, configured_paths)
    shutil.copyfile(first.output_file(made, "save", "latents"), second.paths.input / "half.latent")
    rest = {node: base[node] for node in ("unet", "clip", "text")}
    rest.update({
        "load": {"class_type": "LoadLatent", "inputs": {"latent": "half.latent"}},
        "rest": _ksampler(["load", 0], add_noise="disable", start=2, end=10000, leftover="disable"),
        "probe_rest": {"class_type": "TestOutput", "inputs": {"value": ["rest", 0]}},
    })
    finished = second.run(rest).outputs["probe_rest"]["values"][0]
    whole = made.outputs["probe_whole"]["values"][0]
    assert finished["samples"].shape == whole["samples"].shape == (1, 24, 7, 2, 2)
    # Bit for bit: the same float32 steps run on the same values, split across two runs by a file.
    for key in ("samples", "audio_samples"):
        assert torch.equal(finished[key], whole[key]), key
    assert finished["frame_rate"] == whole["frame_rate"] and finished["length"] == whole["length"] == 22
    assert torch.equal(finished["noise_mask"], whole["noise_mask"])
    # Latent frame 0 (pixel frame 0) was kept, so it is still the empty latent's zeros; frame 3 (9-12) was made.
    assert not finished["samples"][:, :, 0].any() and finished["samples"][:, :, 3].abs().sum() > 0
