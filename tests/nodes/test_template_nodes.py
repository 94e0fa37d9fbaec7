"""Nodes the official H3 templates use around the model: splitting an AV latent, slicing a video, resizing
an image or mask batch."""
from __future__ import annotations

import pytest
import torch

from media.video import VideoComponents
from nodes.image import _resize_image_mask
from nodes.latent import _separate_av_latent
from nodes.media import _video_slice
from tests.nodes.test_h3_nodes import (  # noqa: F401 (configured_paths and h3 are fixtures)
    configured_paths, h3, probe, t2va_prompt,
)


def test_separate_av_latent_splits_streams_and_masks():
    video, audio = torch.randn(1, 24, 2, 4, 4), torch.randn(1, 32, 2, 8)
    vmask, amask = torch.rand(1, 2, 4, 4), torch.rand(1, 8)
    latent = {"samples": video, "audio_samples": audio, "noise_mask": vmask, "audio_noise_mask": amask,
              "frame_rate": 24.0, "length": 5}
    v, a = _separate_av_latent(latent)
    assert v["samples"] is video and v["noise_mask"] is vmask and "audio_samples" not in v
    assert a["audio_samples"] is audio and a["audio_noise_mask"] is amask and "samples" not in a
    assert v["length"] == a["length"] == 5


def test_separate_av_latent_names_the_missing_stream():
    with pytest.raises(ValueError, match="LTXVSeparateAVLatent: input 'av_latent' has no audio stream"):
        _separate_av_latent({"samples": torch.zeros(1, 24, 1, 2, 2)})


def _clip(frames=24, rate=24, seconds=1.0):
    images = torch.arange(frames, dtype=torch.float32).view(frames, 1, 1, 1).expand(frames, 4, 4, 3) / frames
    audio = {"waveform": torch.arange(int(32000 * seconds), dtype=torch.float32).view(1, 1, -1).expand(1, 2, -1),
             "sample_rate": 32000}
    return VideoComponents(images=images.contiguous(), audio=audio, frame_rate=rate)


def test_video_slice_keeps_the_frames_and_sound_of_the_stretch():
    clip = _clip()
    (whole,) = _video_slice(clip, 0.0, 0.0, False)
    assert whole is clip                                     # the templates' [0, 0, false]: unchanged
    (part,) = _video_slice(clip, 0.25, 0.5, False)
    parts = part.get_components()
    assert torch.equal(parts.images, clip.images[6:18])
    assert torch.equal(parts.audio["waveform"], clip.audio["waveform"][..., 8000:24000])
    (tail,) = _video_slice(clip, 0.5, 0.0, False)
    assert tail.get_frame_count() == 12


def test_video_slice_refusals_name_the_node():
    clip = _clip()
    with pytest.raises(ValueError, match="Video Slice: .*strict_duration"):
        _video_slice(clip, 0.5, 1.0, True)
    with pytest.raises(ValueError, match="Video Slice: .*nothing of it starts"):
        _video_slice(clip, 2.0, 0.0, False)


@pytest.mark.parametrize("shape, size, expected", [((1, 30, 60, 3), 1024, (512, 1024)), ((2, 60, 30), 20, (20, 10)),
                                                   ((1, 16, 16, 3), 8, (8, 8))])
def test_resize_scales_the_longer_side_of_images_and_masks(shape, size, expected):
    (out,) = _resize_image_mask(torch.rand(shape), {"resize_type": "scale longer dimension", "longer_size": size},
                                "lanczos")
    assert tuple(out.shape[1:3]) == expected and out.shape[0] == shape[0] and out.dim() == len(shape)
    assert float(out.min()) >= 0 and float(out.max()) <= 1


def test_resize_other_types():
    image = torch.rand(1, 30, 50, 3)
    (out,) = _resize_image_mask(image, {"resize_type": "scale dimensions", "width": 20, "height": 0, "crop": "center"}, "area")
    assert tuple(out.shape) == (1, 12, 20, 3)
    (out,) = _resize_image_mask(image, {"resize_type": "scale by multiplier", "multiplier": 0.5}, "area")
    assert tuple(out.shape) == (1, 15, 25, 3)
    (out,) = _resize_image_mask(image, {"resize_type": "scale shorter dimension", "shorter_size": 60}, "area")
    assert tuple(out.shape) == (1, 60, 100, 3)
    (out,) = _resize_image_mask(image, {"resize_type": "scale to multiple", "multiple": 16}, "area")
    assert tuple(out.shape) == (1, 16, 48, 3)
    (out,) = _resize_image_mask(image, {"resize_type": "match size", "match": torch.rand(2, 7, 9), "crop": "center"}, "area")
    assert tuple(out.shape) == (1, 7, 9, 3)
    with pytest.raises(ValueError, match="ResizeImageMaskNode: resize_type 'sideways'"):
        _resize_image_mask(image, {"resize_type": "sideways"}, "area")


def test_text_to_image_through_the_av_split(h3):
    """EmptyLatentImage -> H3 sampler -> LTXVSeparateAVLatent -> VAEDecode: one image, as the t2i template wires it."""
    prompt = t2va_prompt(width=48, height=32, save_video=False)
    for unused in ("decode_audio", "probe_audio", "av"):
        prompt.pop(unused)
    prompt["empty"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 48, "height": 32, "batch_size": 1}}
    prompt["split"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sample", 0]}}
    prompt["decode"]["inputs"]["samples"] = ["split", 0]
    prompt["probe_audio"] = {"class_type": "TestOutput", "inputs": {"value": ["split", 1]}}
    result = h3.run(prompt)
    assert tuple(probe(result, "probe_frames").shape) == (1, 32, 48, 3)
    assert tuple(probe(result, "probe_audio")["audio_samples"].shape) == (1, 32, 2, 0)
