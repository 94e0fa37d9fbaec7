"""H3 control nodes through the executor on tiny weights: guides, noise masks, saved conditioning, embeddings,
reference limits, and every workflow of issue 6 run headless.

Sizes are tiny (32x32 or 64x32 frames, one or two sampling steps); the workflows run at their own size
(96x64, 22 frames, 4 steps).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from execution.convert import ui_to_api
from execution.errors import PromptError
from models.h3 import packing
from nodes.h3_control import frame_range_masks, guide_frame_count, reference_count_problem
from media.audio import write_flac as write_audio_file
from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths is a fixture)
    H3Env, configured_paths, install, mp4_streams, probe, t2va_prompt, tiny_weights,
)

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
F = 5.0 / 3.0  # clock units per pixel frame


@pytest.fixture
def env(registry, tmp_path, tmp_path_factory, configured_paths) -> H3Env:
    install(tiny_weights(tmp_path_factory), tmp_path)
    env = H3Env(registry, tmp_path)
    configured_paths(env.paths)
    return env


def write_tone(env: H3Env, name: str = "tone.flac", seconds: float = 1.0, rate: int = 44100) -> str:
    """A stereo 440 Hz tone at 44.1 kHz in the input folder (so guides must resample it)."""
    t = torch.arange(int(seconds * rate)) / rate
    wave = 0.5 * torch.sin(2 * math.pi * 440.0 * t)
    write_audio_file(env.paths.input / name, torch.stack([wave, wave]), rate)
    return name


SAMPLING_NODES = ("noise", "select", "sched", "guider", "sample", "decode", "decode_audio", "probe_latent",
                  "probe_frames", "probe_audio")


def guide_prompt(length: int = 22, width: int = 32, height: int = 32, steps: int = 1, *, sample: bool = True,
                 **t2va) -> dict:
    """t2va plus two guide images and probes; without `sample`, only the conditioning side (no sampler, no decode)."""
    prompt = t2va_prompt(width=width, height=height, length=length, steps=steps, save_video=False, **t2va)
    if not sample:
        for key in SAMPLING_NODES:
            del prompt[key]
    prompt["red"] = {"class_type": "EmptyImage", "inputs": {"width": 48, "height": 40, "batch_size": 1, "color": 0xC83C28}}
    prompt["blue"] = {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 32, "batch_size": 1, "color": 0x2850C8}}
    prompt["probe_text"] = {"class_type": "TestOutput", "inputs": {"value": ["text", 0]}}
    prompt["probe_empty"] = {"class_type": "TestOutput", "inputs": {"value": ["empty", 0]}}
    return prompt


def add_guide(prompt: dict, node_id: str, source: str, frame_idx: int, *, image: str | None = None,
              audio: str | None = None, vae: bool = True, audio_vae: bool = True) -> None:
    inputs = {"positive": [source, 0], "latent": ["empty", 0], "frame_idx": frame_idx}
    if image:
        inputs["image"] = [image, 0]
    if audio:
        inputs["audio"] = [audio, 0]
    if vae:
        inputs["vae"] = ["vv", 0]
    if audio_vae:
        inputs["audio_vae"] = ["av", 0]
    prompt[node_id] = {"class_type": "MiniMaxH3AddGuide", "inputs": inputs}


def use_conditioning(prompt: dict, node_id: str) -> None:
    if "guider" in prompt:
        prompt["guider"]["inputs"]["conditioning"] = [node_id, 0]
    prompt["probe_cond"] = {"class_type": "TestOutput", "inputs": {"value": [node_id, 0]}}


# ---------------------------------------------------------------------- MiniMaxH3AddGuide
def test_guides_are_keyframe_rows_at_their_frames_with_condition_timesteps(env):
    prompt = guide_prompt()
    prompt["tone"] = {"class_type": "LoadAudio", "inputs": {"audio": write_tone(env)}}
    add_guide(prompt, "g0", "text", 0, image="red")
    add_guide(prompt, "g1", "g0", -1, image="blue")
    add_guide(prompt, "g2", "g1", 11, audio="tone")
    use_conditioning(prompt, "g2")
    result = env.run(prompt)
    hidden, extras = probe(result, "probe_cond")[0]
    keyframes = extras["keyframes"]
    # Guides chain, in order; -1 is the last of the 22 frames.
    assert [k["frame_index"] for k in keyframes] == [0, 21, 11]
    assert tuple(keyframes[0]["latent"].shape) == (1, 24, 1, 2, 2) and keyframes[0]["audio_latent"] is None
    assert tuple(keyframes[1]["latent"].shape) == (1, 24, 1, 2, 2)
    # The sound starts at audio latent frame 5/3 * 11 = 18.3 of 37: cropped to the 18 whole frames left.
    assert keyframes[2]["latent"] is None and tuple(keyframes[2]["audio_latent"].shape) == (1, 32, 2, 18)
    # The upstream text conditioning is not changed by the guides.
    assert "keyframes" not in probe(result, "probe_text")[0][1]

    text_len = int(extras["attention_mask"].sum())
    items = packing.condition_items(extras, 0, target_frames=22, latent_h=2, latent_w=2, audio_t=37)
    layout = packing.build_layout(text_len, 7, 2, 2, 37, items)
    roles = [(s.role, s.stop - s.start) for s in layout.segments]
    assert roles == [("text", text_len), ("cond_video", 1), ("cond_video", 1), ("cond_audio", 36), ("audio", 74),
                     ("video", 7)]
    pos = layout.positions
    first, last, sound = layout.segments[1:4]
    assert pos[first.start, 0] == pytest.approx(text_len + 0.0)
    assert pos[last.start, 0] == pytest.approx(text_len + F * 21)
    assert pos[sound.start:sound.start + 18, 0].tolist() == pytest.approx([text_len + F * 11 + k for k in range(18)])
    # The keyframes sit on the target's spatial grid.
    torch.testing.assert_close(pos[first.start, 1:], pos[layout.segment("video").start, 1:])
    t_rows, tags = packing.row_timesteps(layout, sigma_video=0.9, sigma_audio=0.7)
    assert t_rows[first.start:last.stop].tolist() == pytest.approx([0.999, 0.999])
    assert tags[first.start:last.stop].tolist() == [packing.TAG_VIDEO] * 2
    assert t_rows[sound.start:sound.stop].tolist() == pytest.approx([1.0] * 36)
    assert tags[sound.start:sound.stop].tolist() == [packing.TAG_AUDIO] * 36
    assert t_rows[layout.segment("video").start:].tolist() == pytest.approx([0.1] * 7)


def test_audio_guides_are_resampled_to_32_khz(env):
    # 0.2 s at 44.1 kHz is 8820 samples; at 32 kHz it is 6400 samples: 8 latent frames of 800 (not 12).
    prompt = guide_prompt(sample=False)
    prompt["tone"] = {"class_type": "LoadAudio", "inputs": {"audio": write_tone(env, "short.flac", seconds=0.2)}}
    add_guide(prompt, "g0", "text", 0, audio="tone")
    use_conditioning(prompt, "g0")
    (keyframe,) = probe(env.run(prompt), "probe_cond")[0][1]["keyframes"]
    assert tuple(keyframe["audio_latent"].shape) == (1, 32, 2, 8)


def test_add_guide_leaves_the_latent_and_its_mask_alone_and_changes_the_result(env):
    prompt = guide_prompt()
    prompt["masks"] = {"class_type": "MiniMaxH3FrameRangeMasks", "inputs": {"samples": ["empty", 0], "start_frame": 5,
                                                                            "frame_count": 12}}
    prompt["masked"] = {"class_type": "MiniMaxH3SetLatentNoiseMasks", "inputs": {
        "samples": ["empty", 0], "video_mask": ["masks", 0], "audio_mask": ["masks", 1]}}
    prompt["g0"] = {"class_type": "MiniMaxH3AddGuide", "inputs": {
        "positive": ["text", 0], "latent": ["masked", 0], "frame_idx": 0, "vae": ["vv", 0], "image": ["red", 0]}}
    prompt["sample"]["inputs"]["latent_image"] = ["masked", 0]
    prompt["probe_masked"] = {"class_type": "TestOutput", "inputs": {"value": ["masked", 0]}}
    unguided = probe(env.run(prompt), "probe_latent")
    use_conditioning(prompt, "g0")
    result = env.run(prompt)
    latent = probe(result, "probe_masked")
    assert set(latent) == {"samples", "audio_samples", "frame_rate", "length", "noise_mask", "audio_noise_mask"}
    assert not latent["samples"].any() and not latent["audio_samples"].any()
    expected_video, expected_audio = frame_range_masks(latent, 5, 12)
    torch.testing.assert_close(latent["noise_mask"][0, 0], expected_video, rtol=0, atol=0)
    torch.testing.assert_close(latent["audio_noise_mask"], expected_audio.reshape(1, -1), rtol=0, atol=0)
    guided = probe(result, "probe_latent")
    assert not torch.equal(guided["samples"], unguided["samples"])


@pytest.mark.parametrize("frame_idx, resolved", [(-1, 21), (-22, 0), (-11, 11), (21, 21)])
def test_negative_frame_indices_count_from_the_end(env, frame_idx, resolved):
    prompt = guide_prompt(sample=False)
    add_guide(prompt, "g0", "text", frame_idx, image="blue")
    use_conditioning(prompt, "g0")
    (keyframe,) = probe(env.run(prompt), "probe_cond")[0][1]["keyframes"]
    assert keyframe["frame_index"] == resolved


@pytest.mark.parametrize("batch, frames, latent_t", [(1, 1, 1), (4, 1, 1), (5, 5, 2), (9, 5, 2), (22, 22, 7),
                                                     (30, 22, 7)])
def test_image_batches_use_one_frame_or_whole_encoder_clips(env, batch, frames, latent_t):
    assert guide_frame_count(batch) == frames
    prompt = guide_prompt(sample=False)
    prompt["clip_frames"] = {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 32, "batch_size": batch,
                                                                    "color": 0x808080}}
    add_guide(prompt, "g0", "text", 0, image="clip_frames")
    use_conditioning(prompt, "g0")
    (keyframe,) = probe(env.run(prompt), "probe_cond")[0][1]["keyframes"]
    assert tuple(keyframe["latent"].shape) == (1, 24, latent_t, 2, 2)


def test_a_guide_on_an_odd_latent_grid_is_padded_like_the_target(env):
    prompt = guide_prompt(width=48, height=32, steps=1)
    add_guide(prompt, "g0", "text", 0, image="red")
    use_conditioning(prompt, "g0")
    result = env.run(prompt)
    (keyframe,) = probe(result, "probe_cond")[0][1]["keyframes"]
    assert tuple(keyframe["latent"].shape) == (1, 24, 1, 2, 3)
    assert tuple(probe(result, "probe_latent")["samples"].shape) == (1, 24, 7, 2, 3)


REFUSALS = [
    (dict(), "connect an image or an audio clip"),
    (dict(image="red", vae=False), "an image guide needs the video VAE on input 'vae'"),
    (dict(audio="tone", audio_vae=False), "an audio guide needs the audio VAE on input 'audio_vae'"),
    (dict(frame_idx=22, image="red"), "frame_idx 22 is outside the clip: it has frames 0..21"),
    (dict(frame_idx=-23, image="red"), "frame_idx -23 is outside the clip: it has frames 0..21"),
    (dict(frame_idx=20, image="five"), "covers frames 20..24, but the clip has frames 0..21"),
    (dict(image="red", swap_vaes=True), "input 'vae' is an H3 audio VAE"),
]


@pytest.mark.parametrize("case, message", REFUSALS, ids=[
    "nothing", "image-without-vae", "audio-without-audio-vae", "past-the-end", "before-the-start",
    "clip-does-not-fit", "wrong-vae-kind"])
def test_add_guide_refusals_name_the_input_and_the_frames(env, case, message):
    prompt = guide_prompt(sample=False)
    prompt["tone"] = {"class_type": "LoadAudio", "inputs": {"audio": write_tone(env)}}
    prompt["five"] = {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 32, "batch_size": 5, "color": 0}}
    case = dict(case)
    swap = case.pop("swap_vaes", False)
    add_guide(prompt, "g0", "text", case.pop("frame_idx", 0), **case)
    if swap:
        prompt["g0"]["inputs"]["vae"] = ["av", 0]
    use_conditioning(prompt, "g0")
    node_type, error = env.run_error(prompt)
    assert node_type == "MiniMaxH3AddGuide"
    assert message in error and error.startswith("MiniMaxH3AddGuide")


# ---------------------------------------------------------------------- noise masks
def test_set_latent_noise_mask_reduces_by_max_to_patches(env):
    # A 64x64 pixel mask for a 64x64 clip (4x4 latent, 2x2 patches): each patch covers 32x32 pixels.
    # LoadImage's MASK is 1 - alpha / 255.
    alpha = Image.new("L", (64, 64), 255)                  # mask 0 (keep) everywhere
    alpha.putpixel((3, 5), 178)                            # patch (0, 0): one pixel at 77/255 = 0.30196
    alpha.putpixel((40, 40), 127)                          # patch (1, 1): one pixel at 128/255 = 0.50196
    for x in range(0, 32):
        alpha.putpixel((x, 50), 0)                         # patch (1, 0): a row at 1.0
    image = Image.new("RGBA", (64, 64), (10, 20, 30, 255))
    image.putalpha(alpha)
    image.save(env.paths.input / "mask.png")
    prompt = t2va_prompt(width=64, height=64, length=5, save_video=False)
    prompt["load"] = {"class_type": "LoadImage", "inputs": {"image": "mask.png"}}
    prompt["masked"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["empty", 0], "mask": ["load", 1]}}
    prompt["probe_masked"] = {"class_type": "TestOutput", "inputs": {"value": ["masked", 0]}}
    prompt["sample"]["inputs"]["latent_image"] = ["masked", 0]
    latent = probe(env.run(prompt), "probe_masked")
    assert tuple(latent["noise_mask"].shape) == (1, 1, 1, 64, 64)
    rows = packing.reduce_video_mask(latent["noise_mask"], 1, 2, 4, 4)
    # By hand: max per patch, kept as it is (no rounding): 77/255 and 128/255.
    expected = torch.tensor([[77 / 255, 0.0], [1.0, 128 / 255]]).expand(1, 2, 2, 2)
    torch.testing.assert_close(rows, expected, rtol=0, atol=1e-7)


def test_frame_range_masks_by_hand():
    latent = {"samples": torch.zeros(1, 24, 7, 2, 4), "audio_samples": torch.zeros(1, 32, 2, 37), "length": 22,
              "frame_rate": 24.0}
    video, audio = frame_range_masks(latent, 7, 8)   # frames 7..14: 0.2917 s .. 0.625 s
    assert video.shape == (22, 2, 4) and video[:, 0, 0].tolist() == [0.0] * 7 + [1.0] * 8 + [0.0] * 7
    # Audio latent frames of 25 ms overlapping [0.2917, 0.625): 11 (0.275..0.3) through 24 (0.6..0.625).
    assert audio.shape == (1, 1, 37) and audio.flatten().nonzero().flatten().tolist() == list(range(11, 25))
    # Pixel frames -> latent frames (1 frame, then 4 each) by max: latents 2..4 hold frames 5..16.
    rows = packing.reduce_video_mask(video, 1, 7, 2, 4)
    assert rows[0, :, 0, 0].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert packing.reduce_audio_mask(audio, 1, 37).flatten().tolist() == audio.flatten().tolist()
    with pytest.raises(ValueError, match="end at frame 22; the clip has frames 0..21"):
        frame_range_masks(latent, 15, 8)


def masked_regeneration_prompt(start: int, count: int, seed: int = 9) -> dict:
    prompt = t2va_prompt(width=64, height=32, length=22, steps=2, save_video=False)
    prompt["masks"] = {"class_type": "MiniMaxH3FrameRangeMasks", "inputs": {"samples": ["sample", 0],
                                                                            "start_frame": start, "frame_count": count}}
    prompt["masked"] = {"class_type": "MiniMaxH3SetLatentNoiseMasks", "inputs": {
        "samples": ["sample", 0], "video_mask": ["masks", 0], "audio_mask": ["masks", 1]}}
    prompt["noise2"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}}
    prompt["resample"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
        "noise": ["noise2", 0], "guider": ["guider", 0], "sampler": ["select", 0], "sigmas": ["sched", 0],
        "latent_image": ["masked", 0]}}
    prompt["probe_regen"] = {"class_type": "TestOutput", "inputs": {"value": ["resample", 0]}}
    for key in ("decode", "decode_audio", "probe_frames", "probe_audio"):
        del prompt[key]
    return prompt


@pytest.mark.parametrize("sampler", ["euler", "res_multistep"])
def test_a_zero_mask_region_comes_back_as_the_input_latent(env, sampler):
    prompt = masked_regeneration_prompt(7, 8)
    prompt["select"]["inputs"]["sampler_name"] = sampler
    result = env.run(prompt)
    original, regen = probe(result, "probe_latent"), probe(result, "probe_regen")
    keep_v = torch.tensor([1, 1, 0, 0, 0, 1, 1], dtype=torch.bool)          # latent frames outside 2..4
    torch.testing.assert_close(regen["samples"][:, :, keep_v], original["samples"][:, :, keep_v], rtol=0, atol=1e-6)
    assert not torch.allclose(regen["samples"][:, :, ~keep_v], original["samples"][:, :, ~keep_v])
    keep_a = torch.ones(37, dtype=torch.bool)
    keep_a[11:25] = False
    torch.testing.assert_close(regen["audio_samples"][..., keep_a], original["audio_samples"][..., keep_a],
                               rtol=0, atol=1e-6)
    assert not torch.allclose(regen["audio_samples"][..., ~keep_a], original["audio_samples"][..., ~keep_a])


def test_a_mask_of_ones_is_the_same_as_no_mask(env):
    prompt = masked_regeneration_prompt(0, 22)
    prompt["plain"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
        "noise": ["noise2", 0], "guider": ["guider", 0], "sampler": ["select", 0], "sigmas": ["sched", 0],
        "latent_image": ["sample", 0]}}
    prompt["probe_plain"] = {"class_type": "TestOutput", "inputs": {"value": ["plain", 0]}}
    result = env.run(prompt)
    masked = probe(result, "probe_regen")
    assert masked["noise_mask"].min() == 1 and masked["audio_noise_mask"].min() == 1
    plain = probe(result, "probe_plain")
    torch.testing.assert_close(masked["samples"], plain["samples"], rtol=0, atol=1e-6)
    torch.testing.assert_close(masked["audio_samples"], plain["audio_samples"], rtol=0, atol=1e-6)


def test_mask_refusals_name_the_input_and_the_sizes(env):
    prompt = t2va_prompt(width=32, height=32, length=22, save_video=False)
    # Masks made for another clip: 5 frames (2 latent frames) and 8 audio latent frames.
    prompt["short"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 32, "height": 32, "length": 5}}
    prompt["short_masks"] = {"class_type": "MiniMaxH3FrameRangeMasks", "inputs": {
        "samples": ["short", 0], "start_frame": 0, "frame_count": 2}}
    cases = [
        ({"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["empty", 0], "mask": ["short_masks", 0]}},
         "SetLatentNoiseMask: input 'mask' has 5 frames; the latent needs 1, 7 (latent frames) or 22 (pixel frames)"),
        ({"class_type": "MiniMaxH3SetLatentNoiseMasks", "inputs": {"samples": ["empty", 0]}},
         "MiniMaxH3SetLatentNoiseMasks: connect a video_mask, an audio_mask or both"),
        ({"class_type": "MiniMaxH3SetLatentNoiseMasks", "inputs": {"samples": ["empty", 0],
                                                                   "audio_mask": ["short_masks", 1]}},
         "MiniMaxH3SetLatentNoiseMasks: input 'audio_mask' has 8 values on its last axis; the latent's audio has 37"),
    ]
    for node, message in cases:
        trial = dict(prompt, masked=node)
        trial["sample"] = json.loads(json.dumps(prompt["sample"]))
        trial["sample"]["inputs"]["latent_image"] = ["masked", 0]
        node_type, error = env.run_error(trial)
        assert node_type == node["class_type"] and message in error, error


# ---------------------------------------------------------------------- prompt embeddings and saved conditioning
def test_prompt_embeddings_are_spliced_and_a_wrong_width_is_refused(env):
    folder = env.paths.models / "embeddings"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"emb": torch.randn(3, 48, generator=torch.Generator().manual_seed(1))}, str(folder / "style.safetensors"))
    save_file({"emb": torch.randn(3, 40)}, str(folder / "too_narrow.safetensors"))
    prompt = t2va_prompt(save_video=False, text="a fox embedding:style")
    prompt["plain"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox ", "clip": ["clip", 0]}}
    prompt["probe_plain"] = {"class_type": "TestOutput", "inputs": {"value": ["plain", 0]}}
    prompt["probe_text"] = {"class_type": "TestOutput", "inputs": {"value": ["text", 0]}}
    result = env.run(prompt)
    with_embedding, plain = probe(result, "probe_text")[0][0], probe(result, "probe_plain")[0][0]
    # BOS + "a fox " (6 bytes) + EOS, and with the embedding's 3 rows in place of its name.
    assert plain.shape[1] == 8 and with_embedding.shape[1] == 11
    prompt["text"]["inputs"]["text"] = "a fox embedding:too_narrow"
    node_type, error = env.run_error(prompt)
    assert node_type == "CLIPTextEncode"
    assert "embedding 'too_narrow' has width 40" in error and "48" in error
    prompt["text"]["inputs"]["text"] = "a fox embedding:missing"
    node_type, error = env.run_error(prompt)
    assert "no missing.safetensors is in" in error


def test_saved_conditioning_loads_back_instead_of_the_text_encoder(env):
    prompt = t2va_prompt(save_video=False, text="a red fox in the snow")
    prompt["save_cond"] = {"class_type": "MiniMaxH3SaveConditioning", "inputs": {
        "conditioning": ["text", 0], "filename_prefix": "conditioning/fox"}}
    first = env.run(prompt)
    item = first.outputs["save_cond"]["conditioning"][0]
    saved = env.paths.folder("output") / item["subfolder"] / item["filename"]
    shutil.copyfile(saved, env.paths.input / "fox.safetensors")

    loaded_prompt = t2va_prompt(save_video=False)
    del loaded_prompt["text"]
    loaded_prompt["cond"] = {"class_type": "MiniMaxH3LoadConditioning", "inputs": {
        "model": ["unet", 0], "conditioning": "fox.safetensors"}}
    loaded_prompt["guider"]["inputs"]["conditioning"] = ["cond", 0]
    loaded_prompt["probe_cond"] = {"class_type": "TestOutput", "inputs": {"value": ["cond", 0]}}
    second = env.run(loaded_prompt)
    assert torch.equal(probe(second, "probe_latent")["samples"], probe(first, "probe_latent")["samples"])
    assert torch.equal(probe(second, "probe_latent")["audio_samples"], probe(first, "probe_latent")["audio_samples"])
    # The annotated name reads the saved file straight from the output folder.
    loaded_prompt["cond"]["inputs"]["conditioning"] = f"{item['subfolder']}/{item['filename']} [output]"
    assert torch.equal(probe(env.run(loaded_prompt), "probe_cond")[0][0], probe(second, "probe_cond")[0][0])

    save_file({"conditioning": torch.randn(1, 6, 40)}, str(env.paths.input / "narrow.safetensors"))
    loaded_prompt["cond"]["inputs"]["conditioning"] = "narrow.safetensors"
    node_type, error = env.run_error(loaded_prompt)
    assert node_type == "MiniMaxH3LoadConditioning"
    assert "narrow.safetensors holds conditioning of width 40" in error and "width 48" in error
    save_file({"something_else": torch.zeros(2)}, str(env.paths.input / "other.safetensors"))
    loaded_prompt["cond"]["inputs"]["conditioning"] = "other.safetensors"
    assert "holds no 'conditioning' tensor" in env.run_error(loaded_prompt)[1]


def test_saved_conditioning_keeps_its_token_tags(tmp_path):
    from nodes.h3_control import read_conditioning_file
    path = tmp_path / "tagged.safetensors"
    save_file({"conditioning": torch.randn(1, 4, 48), "token_tags": torch.tensor([[1, 0, 0, 1]])}, str(path))
    ((hidden, extras),) = read_conditioning_file(path)
    assert hidden.shape == (1, 4, 48) and extras["token_tags"].tolist() == [[1, 0, 0, 1]]
    save_file({"conditioning": torch.randn(1, 4, 48), "token_tags": torch.tensor([[1, 0]])}, str(path))
    with pytest.raises(ValueError, match="'token_tags' of shape"):
        read_conditioning_file(path)


# ---------------------------------------------------------------------- reference limits
def reference_prompt(images: int = 0, videos: int = 0, audios: int = 0) -> dict:
    prompt = t2va_prompt(width=64, height=32, length=5, save_video=False)
    prompt["picture"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 32, "batch_size": 1, "color": 0}}
    prompt["clip_frames"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 32, "batch_size": 5,
                                                                    "color": 0}}
    prompt["sound"] = {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["empty", 0], "vae": ["av", 0]}}
    inputs = {"clip": ["clip", 0], "vae": ["vv", 0], "audio_vae": ["av", 0], "prompt": "<Picture 1>", "width": 64,
              "height": 32, "length": 5, "ref_image_size": "match"}
    inputs.update({f"ref_images.ref_image_{i}": ["picture", 0] for i in range(images)})
    inputs.update({f"ref_videos.ref_video_{i}": ["clip_frames", 0] for i in range(videos)})
    inputs.update({f"ref_audios.ref_audio_{i}": ["sound", 0] for i in range(audios)})
    prompt["r2v"] = {"class_type": "MiniMaxH3ReferenceToVideo", "inputs": inputs}
    prompt["guider"]["inputs"]["conditioning"] = ["r2v", 0]
    prompt["sample"]["inputs"]["latent_image"] = ["r2v", 1]
    prompt["probe_cond"] = {"class_type": "TestOutput", "inputs": {"value": ["r2v", 0]}}
    return prompt


@pytest.mark.parametrize("counts, message", [
    ((10, 0, 0), "10 reference images given; at most 9 are allowed"),
    ((1, 4, 0), "4 reference videos given; at most 3 are allowed"),
    ((1, 0, 4), "4 reference audios given; at most 3 are allowed"),
    ((9, 3, 1), "13 references given (9 images, 3 videos, 1 audios); at most 12 are allowed in all"),
])
def test_reference_limits_are_refused_at_validation(env, counts, message):
    with pytest.raises(PromptError) as info:
        env.validate(reference_prompt(*counts))
    errors = info.value.node_errors["r2v"]["errors"]
    assert any(message in e["message"] and "MiniMaxH3ReferenceToVideo" in e["message"] for e in errors), errors


def test_references_within_the_limits_run(env):
    assert reference_count_problem(9, 3, 0) is None and reference_count_problem(0, 1, 3) is None
    assert reference_count_problem(0, 0, 0) is None and reference_count_problem(0, 0, 2) is None
    env.validate(reference_prompt(9, 3, 0))
    result = env.run(reference_prompt(2, 0, 1))
    refs = probe(result, "probe_cond")[0][1]["references"]
    assert [r["kind"] for r in refs] == ["image", "image", "audio"]


# ---------------------------------------------------------------------- clip helpers
def test_image_from_batch_and_trim_audio_duration(env):
    prompt = t2va_prompt(width=32, height=32, length=22, save_video=False)
    prompt["tail"] = {"class_type": "ImageFromBatch", "inputs": {"image": ["decode", 0], "batch_index": 17, "length": 5}}
    prompt["late"] = {"class_type": "ImageFromBatch", "inputs": {"image": ["decode", 0], "batch_index": 30, "length": 9}}
    prompt["end_sound"] = {"class_type": "TrimAudioDuration", "inputs": {"audio": ["decode_audio", 0],
                                                                         "start_index": -0.25, "duration": 60.0}}
    for key in ("tail", "late", "end_sound"):
        prompt["probe_" + key] = {"class_type": "TestOutput", "inputs": {"value": [key, 0]}}
    result = env.run(prompt)
    frames, sound = probe(result, "probe_frames"), probe(result, "probe_audio")
    torch.testing.assert_close(probe(result, "probe_tail"), frames[17:22])
    torch.testing.assert_close(probe(result, "probe_late"), frames[21:22])  # clamped into the batch, as ComfyUI
    trimmed = probe(result, "probe_end_sound")
    assert trimmed["sample_rate"] == 32000 and trimmed["waveform"].shape[-1] == 8000
    torch.testing.assert_close(trimmed["waveform"], sound["waveform"][..., -8000:])
    prompt["end_sound"]["inputs"].update(start_index=5.0, duration=1.0)  # past the end: ComfyUI keeps the last sample
    assert probe(env.run(prompt), "probe_end_sound")["waveform"].shape[-1] == 1
    prompt["end_sound"]["inputs"].update(start_index=0.5, duration=0.0)
    assert "select no sound" in env.run_error(prompt)[1]


# ---------------------------------------------------------------------- the workflows, headless
def workflow_prompt(env: H3Env, name: str) -> dict:
    """A shipped workflow converted to an API prompt, as `main.py run` converts it."""
    return ui_to_api(json.loads((WORKFLOWS / name).read_text(encoding="utf-8")), env.registry)


def run_workflow(env: H3Env, prompt: dict, probes: dict[str, list] | None = None):
    """Run a converted workflow (with TestOutput probes on the given links): (result, {prefix: mp4 streams})."""
    for probe_id, link in (probes or {}).items():
        prompt[probe_id] = {"class_type": "TestOutput", "inputs": {"value": link}}
    result = env.run(prompt)
    return result, {prompt[node_id]["inputs"]["filename_prefix"]: mp4_streams(env.output_file(result, node_id))
                    for node_id, node in prompt.items() if node["class_type"] == "SaveVideo"}


def node_of(prompt: dict, class_type: str, title: str | None = None) -> str:
    found = [nid for nid, node in prompt.items() if node["class_type"] == class_type
             and (title is None or node.get("_meta", {}).get("title") == title)]
    assert len(found) == 1, (class_type, title, found)
    return found[0]


def test_workflow_first_last_frame(env):
    prompt = workflow_prompt(env, "h3_fl2va.json")
    result, videos = run_workflow(env, prompt, {"probe_cond": [node_of(prompt, "MiniMaxH3ImageToVideo"), 0]})
    assert [k["frame_index"] for k in probe(result, "probe_cond")[0][1]["keyframes"]] == [0, 21]
    assert videos["video/h3_fl2va"]["frames"] == 22 and videos["video/h3_fl2va"]["audio_streams"] == 1


def test_workflow_add_guide(env):
    prompt = workflow_prompt(env, "h3_add_guide.json")
    guides = [nid for nid, node in prompt.items() if node["class_type"] == "MiniMaxH3AddGuide"]
    last = next(nid for nid in guides if not any(prompt[o]["inputs"].get("positive") == [nid, 0] for o in guides))
    result, videos = run_workflow(env, prompt, {"probe_guides": [last, 0]})
    keyframes = probe(result, "probe_guides")[0][1]["keyframes"]
    assert [k["frame_index"] for k in keyframes] == [0, 21, 11]
    assert tuple(keyframes[0]["latent"].shape) == tuple(keyframes[1]["latent"].shape) == (1, 24, 1, 4, 6)
    assert keyframes[2]["latent"] is None and keyframes[2]["audio_latent"].shape[-1] == 18
    assert videos["video/h3_add_guide"]["frames"] == 22


def test_workflow_masked_regeneration_keeps_everything_but_the_middle(env):
    prompt = workflow_prompt(env, "h3_masked_regeneration.json")
    original = node_of(prompt, "SamplerCustomAdvanced", "Original clip")
    regen = node_of(prompt, "SamplerCustomAdvanced", "Regenerate the middle")
    result, videos = run_workflow(env, prompt, {"probe_a": [original, 0], "probe_b": [regen, 0]})
    a, b = probe(result, "probe_a"), probe(result, "probe_b")
    keep = torch.tensor([1, 1, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert torch.equal(a["samples"][:, :, keep], b["samples"][:, :, keep])
    assert not torch.allclose(a["samples"][:, :, ~keep], b["samples"][:, :, ~keep])
    keep_a = torch.ones(37, dtype=torch.bool)
    keep_a[11:25] = False
    assert torch.equal(a["audio_samples"][..., keep_a], b["audio_samples"][..., keep_a])
    assert videos["video/h3_original"]["frames"] == videos["video/h3_middle_regenerated"]["frames"] == 22


def test_workflow_reference_to_video_with_two_images(env):
    prompt = workflow_prompt(env, "h3_ref2va_two_images.json")
    result, videos = run_workflow(env, prompt, {"probe_refs": [node_of(prompt, "MiniMaxH3ReferenceToVideo"), 0]})
    refs = probe(result, "probe_refs")[0][1]["references"]
    assert [r["kind"] for r in refs] == ["image", "image"]
    assert videos["video/h3_ref2va_two_images"]["frames"] == 22


def test_workflow_video_continuation(env):
    prompt = workflow_prompt(env, "h3_video_continuation.json")
    guide = node_of(prompt, "MiniMaxH3AddGuide")
    result, videos = run_workflow(env, prompt, {"probe_guide": [guide, 0]})
    (keyframe,) = probe(result, "probe_guide")[0][1]["keyframes"]
    # The last 5 frames of clip 1 (2 latent frames) and 0.21 s of its sound (9 latent frames) at frame 0.
    assert keyframe["frame_index"] == 0 and keyframe["latent"].shape[2] == 2 and keyframe["audio_latent"].shape[-1] == 9
    info = videos["video/h3_continued"]
    assert info["frames"] == 22 + 17 and info["audio_streams"] == 1


def test_workflow_video_continuation_loop_through_the_cli(env, tmp_path):
    import main

    code = main.main(["run", str(WORKFLOWS / "h3_video_continuation_loop.json"), "--base-directory", str(tmp_path)])
    assert code == 0
    (path,) = (tmp_path / "output" / "video").glob("h3_continued_loop_*.mp4")
    info = mp4_streams(path)
    assert info["frames"] == 22 + 3 * 17 and info["audio_streams"] == 1
