"""The model-agnostic core nodes the official templates use (nodes/utility.py and the ones that sit in their
topic's module: image, media, sampling, conditioning): what each computes, and that each is declared with the
node id and inputs the official templates save; the count of official templates each appears in is what the
editor note reports."""
from __future__ import annotations

import json
import zlib

import av
import numpy as np
import pytest
import torch
from PIL import Image

from execution import templates
from nodes import conditioning, image, media, sampling, utility

# Nodes added because at least three official templates use them, besides those of nodes/utility.py.
TEMPLATE_CORE = {"SaveImageAdvanced", "ImageCompare", "SaveAudioAdvanced", "KSamplerAdvanced", "DisableNoise",
                 "CFGGuider", "ManualSigmas", "ConditioningZeroOut", "SplitSigmas", "SetFirstSigma"}
SPECS = {spec.node_id: spec for spec in utility.NODES}
SPECS.update({spec.node_id: spec for module in (image, media, sampling, conditioning) for spec in module.NODES
              if spec.node_id in TEMPLATE_CORE})


def run(node_id, **kwargs):
    return SPECS[node_id].execute(**kwargs)


def test_strings():
    assert run("StringConcatenate", string_a="a red", string_b="fox", delimiter=" ") == ("a red fox",)
    assert run("StringReplace", string="a.b.c", find=".", replace="/") == ("a/b/c",)
    assert run("RegexReplace", string="Cat cat CAT", regex_pattern="cat", replace="dog") == ("dog dog dog",)
    assert run("RegexReplace", string="Cat cat", regex_pattern="cat", replace="dog", case_insensitive=False) == \
        ("Cat dog",)
    assert run("RegexReplace", string="x1 x2 x3", regex_pattern=r"x(\d)", replace=r"<\1>", count=2) == \
        ("<1> <2> x3",)
    assert run("RegexReplace", string="a\nb", regex_pattern="^b", replace="B", multiline=True) == ("a\nB",)
    assert run("RegexReplace", string="a\nb", regex_pattern="a.b", replace="-", dotall=True) == ("-",)
    with pytest.raises(ValueError, match="RegexReplace: regex_pattern '\\(' is not a valid"):
        run("RegexReplace", string="x", regex_pattern="(", replace="")


def test_image_scale_by_and_masks():
    image = torch.rand(2, 10, 20, 3)
    (scaled,) = run("ImageScaleBy", image=image, upscale_method="area", scale_by=0.5)
    assert scaled.shape == (2, 5, 10, 3)
    torch.testing.assert_close(scaled, image.view(2, 5, 2, 10, 2, 3).mean(dim=(2, 4)))  # each 2x2 block's mean
    assert run("ImageScaleBy", image=image, upscale_method="bilinear", scale_by=1.55)[0].shape == (2, 16, 31, 3)
    rgba = torch.rand(1, 4, 4, 4)
    (green,) = run("ImageToMask", image=rgba, channel="green")
    assert torch.equal(green, rgba[..., 1])
    with pytest.raises(ValueError, match="no alpha channel"):
        run("ImageToMask", image=image, channel="alpha")
    (inverted,) = run("InvertMask", mask=green)
    torch.testing.assert_close(inverted, 1.0 - green)
    # JoinImageWithAlpha: opacity is 1 - mask; a mask of another size is resized to the picture.
    mask = torch.zeros(1, 2, 4)
    mask[:, :, 2:] = 1.0  # right half transparent
    (joined,) = run("JoinImageWithAlpha", image=torch.rand(1, 4, 8, 3), alpha=mask)
    assert joined.shape == (1, 4, 8, 4)
    assert joined[0, :, 0, 3].eq(1.0).all() and joined[0, :, -1, 3].eq(0.0).all()


def _templates_using(node_id: str) -> list[str]:
    used = []
    for name in templates.official_names():
        text = templates.official_text(name) or ""
        if f'"type": "{node_id}"' in text or f'"type":"{node_id}"' in text:
            workflow = json.loads(text)
            graphs = [workflow, *((workflow.get("definitions") or {}).get("subgraphs") or [])]
            if any(n.get("type") == node_id for g in graphs for n in g.get("nodes") or []):
                used.append(name)
    return used


@pytest.mark.parametrize("node_id", sorted(SPECS))
def test_each_is_used_by_at_least_three_official_templates_with_the_inputs_they_save(node_id):
    """The templates' saved nodes name the same inputs (their `inputs` entries with a widget)."""
    used = _templates_using(node_id)
    assert len(used) >= 3, used
    declared = set()
    for inp in SPECS[node_id].inputs:  # a dynamic combo's options and an auto-grow group's slots are dotted
        declared.add(inp.name)
        for option in (inp.dynamic_options or {}).values():
            declared.update(f"{inp.name}.{sub.name}" for sub in option)
        if inp.template is not None:
            declared.update(f"{inp.name}.{inp.prefix}{i}" for i in range(inp.grow_max))
    declared.add("audioUI")  # the editor's player widget on an audio output node, never sent
    for name in used:
        workflow = json.loads(templates.official_text(name))
        graphs = [workflow, *((workflow.get("definitions") or {}).get("subgraphs") or [])]
        for node in (n for g in graphs for n in g.get("nodes") or [] if n.get("type") == node_id):
            saved = {i["name"] for i in node.get("inputs") or [] if isinstance(i, dict) and i.get("name")}
            assert saved <= declared, (name, saved - declared)


# ---------------------------------------------------------------------- batches, text, saving and comparing
def test_batch_images_fits_every_batch_to_the_first():
    red = torch.zeros(2, 4, 6, 3)
    red[..., 0] = 1.0
    grey = torch.full((1, 8, 12, 1), 0.5)  # twice the size, one channel
    rgba = torch.rand(1, 4, 6, 4)
    (batch,) = run("BatchImagesNode", images={"image0": red, "image1": grey, "image2": rgba})
    assert batch.shape == (4, 4, 6, 4)
    assert torch.equal(batch[:2, ..., :3], red) and torch.equal(batch[:3, ..., 3], torch.ones(3, 4, 6))
    torch.testing.assert_close(batch[2, ..., :3], torch.full((4, 6, 3), 0.5))
    assert torch.equal(batch[3], rgba[0])
    with pytest.raises(ValueError, match="BatchImagesNode: input 'images' has no image"):
        run("BatchImagesNode", images={})


def test_save_text_writes_the_file_and_indents_json(ctx):
    out = run("SaveText", text="a fox", filename_prefix="notes/h3", format="txt")
    assert out.values == ("a fox",) and out.ui["text"] == ("a fox",)
    item = out.ui["files"][0]
    assert (ctx.paths.output / item["subfolder"] / item["filename"]).read_text() == "a fox"
    assert item["filename"].endswith(".txt") and item["subfolder"] == "notes"
    out = run("SaveText", text='{"a": [1, 2]}', filename_prefix="j", format="json")
    written = (ctx.paths.output / out.ui["files"][0]["filename"]).read_text()
    assert written == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    out = run("SaveText", text="not json", filename_prefix="j", format="json")
    assert (ctx.paths.output / out.ui["files"][0]["filename"]).read_text() == "not json"


def _png16_samples(data: bytes) -> np.ndarray:
    """(H, W, C) uint16 samples of a 16-bit PNG this test's frames make (one IDAT, filter 0 rows)."""
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert data[24] == 16  # bit depth
    channels = {0: 1, 2: 3, 6: 4}[data[25]]
    start = data.index(b"IDAT") + 4
    length = int.from_bytes(data[start - 8:start - 4], "big")
    raw = np.frombuffer(zlib.decompress(data[start:start + length]), dtype=np.uint8).reshape(height, -1)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].copy().view(">u2").reshape(height, width, channels)


def test_save_image_advanced_writes_8_and_16_bit_pngs(ctx):
    images = torch.rand(2, 3, 5, 3)
    out = run("SaveImageAdvanced", images=images, filename_prefix="adv",
              format={"format": "png", "bit_depth": "16-bit", "input_color_space": "sRGB"},
              prompt={"1": {"class_type": "X"}})
    assert out.values == (images,) and len(out.ui["images"]) == 2
    data = (ctx.paths.output / out.ui["images"][1]["filename"]).read_bytes()
    samples = _png16_samples(data)
    assert np.array_equal(samples, (images[1].numpy() * 65535).round().astype(np.uint16))
    with Image.open(ctx.paths.output / out.ui["images"][1]["filename"]) as opened:  # a valid PNG to Pillow too
        assert opened.size == (5, 3) and json.loads(opened.info["prompt"]) == {"1": {"class_type": "X"}}
    out = run("SaveImageAdvanced", images=images[:1], filename_prefix="adv8",
              format={"format": "png", "bit_depth": "8-bit", "input_color_space": "sRGB"})
    with Image.open(ctx.paths.output / out.ui["images"][0]["filename"]) as opened:
        assert opened.mode == "RGB"
        assert np.array_equal(np.asarray(opened), (images[0].numpy() * 255).astype(np.uint8))
    with pytest.raises(ValueError, match="SaveImageAdvanced: input 'format' is 'exr'; Weft writes only 'png'"):
        run("SaveImageAdvanced", images=images, filename_prefix="x", format={"format": "exr"})


def test_image_compare_previews_each_side(ctx):
    a, b = torch.zeros(1, 4, 4, 3), torch.ones(2, 4, 4, 3)
    out = run("ImageCompare", image_a=a, image_b=b)
    assert out.values == () and len(out.ui["a_images"]) == 1 and len(out.ui["b_images"]) == 2
    assert all(item["type"] == "temp" for item in out.ui["a_images"] + out.ui["b_images"])
    with Image.open(ctx.paths.temp / out.ui["b_images"][0]["filename"]) as opened:
        assert np.asarray(opened).min() == 255
    assert run("ImageCompare", image_a=a).ui["b_images"] == []


@pytest.mark.parametrize("format, quality, codec, rate", [("flac", None, "flac", 24000), ("mp3", "V0", "mp3", 24000),
                                                          ("mp3", "128k", "mp3", 24000),
                                                          ("opus", "96k", "opus", 48000)])
def test_save_audio_advanced_writes_each_format(ctx, format, quality, codec, rate):
    seconds = torch.linspace(0, 1, 24000)
    waveform = torch.stack([torch.sin(2 * torch.pi * 440 * seconds), torch.sin(2 * torch.pi * 220 * seconds)]) * 0.5
    audio = {"waveform": waveform.unsqueeze(0), "sample_rate": 24000}
    choice = {"format": format, **({"quality": quality} if quality else {})}
    out = run("SaveAudioAdvanced", audio=audio, filename_prefix="audio/h3", format=choice)
    item = out.ui["audio"][0]
    assert item["filename"].endswith("." + format) and item["subfolder"] == "audio"
    with av.open(str(ctx.paths.output / item["subfolder"] / item["filename"])) as container:
        stream = container.streams.audio[0]
        assert codec in stream.codec_context.name and stream.rate == rate and stream.channels == 2
        decoded = sum(frame.samples for frame in container.decode(stream))
    assert abs(decoded / rate - 1.0) < 0.1
    if quality == "128k":
        assert abs(stream.bit_rate - 128_000) < 1000


def test_save_audio_advanced_refuses_an_unknown_quality(ctx):
    audio = {"waveform": torch.zeros(1, 1, 100), "sample_rate": 24000}
    with pytest.raises(ValueError, match="SaveAudioAdvanced: input 'format.quality' is '999k'; mp3 takes V0"):
        run("SaveAudioAdvanced", audio=audio, filename_prefix="a", format={"format": "mp3", "quality": "999k"})


def test_image_batch_repeat_invert_and_masks_as_images():
    a, b = torch.rand(1, 4, 6, 3), torch.rand(2, 8, 12, 3)
    (joined,) = run("ImageBatch", image1=a, image2=b)
    assert joined.shape == (3, 4, 6, 3) and torch.equal(joined[0], a[0])
    (repeated,) = run("RepeatImageBatch", image=b, amount=3)
    assert repeated.shape == (6, 8, 12, 3) and torch.equal(repeated[4], b[0]) and torch.equal(repeated[5], b[1])
    (inverted,) = run("ImageInvert", image=a)
    torch.testing.assert_close(inverted + a, torch.ones_like(a))
    mask = torch.rand(2, 5, 7)
    (grey,) = run("MaskToImage", mask=mask)
    assert grey.shape == (2, 5, 7, 3) and all(torch.equal(grey[..., c], mask) for c in range(3))
    (solid,) = run("SolidMask", value=0.25, width=7, height=5)
    assert solid.shape == (1, 5, 7) and torch.equal(solid, torch.full((1, 5, 7), 0.25))


def test_split_and_set_first_sigma():
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    high, low = run("SplitSigmas", sigmas=sigmas, step=2)
    assert torch.equal(high, torch.tensor([1.0, 0.75, 0.5])) and torch.equal(low, torch.tensor([0.5, 0.25, 0.0]))
    (changed,) = run("SetFirstSigma", sigmas=sigmas, sigma=0.9)
    assert torch.equal(changed, torch.tensor([0.9, 0.75, 0.5, 0.25, 0.0])) and sigmas[0] == 1.0
    with pytest.raises(ValueError, match="SetFirstSigma: input 'sigmas' is empty"):
        run("SetFirstSigma", sigmas=torch.zeros(0), sigma=1.0)
