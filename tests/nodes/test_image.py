"""Core image nodes: called through their specs with a RunContext, and once through the executor."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import media.image as image_media
import nodes.files as node_files
import nodes.image as image_nodes
from execution.context import RunContext, activate, deactivate
from execution.paths import Paths, UnsafePathError
from execution.validation import validate_prompt
from web.object_info import node_info

SPECS = {spec.node_id: spec for spec in image_nodes.NODES}



def run(node_id, **kwargs):
    return SPECS[node_id].execute(**kwargs)


def write_rgba(path, width=5, height=4, seed=0):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 4), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return pixels


# ---------------------------------------------------------------------- LoadImage
def test_load_image_rgba_gives_image_and_inverted_alpha_mask(ctx):
    pixels = write_rgba(ctx.paths.input / "a.png")
    image, mask = run("LoadImage", image="a.png")
    assert image.shape == (1, 4, 5, 3) and image.dtype == torch.float32
    assert torch.allclose(image[0], torch.from_numpy(pixels[..., :3]).float() / 255)
    assert mask.shape == (1, 4, 5)
    assert torch.allclose(mask[0], 1 - torch.from_numpy(pixels[..., 3]).float() / 255)


def test_load_image_without_alpha_has_comfy_zero_mask(ctx):
    Image.new("RGB", (6, 3), (255, 0, 0)).save(ctx.paths.input / "red.jpg", quality=100)
    image, mask = run("LoadImage", image="red.jpg")
    assert image.shape == (1, 3, 6, 3)
    assert image[..., 0].min() > 0.95 and image[..., 1].max() < 0.05
    assert mask.shape == (1, 64, 64) and mask.abs().max() == 0


def test_load_image_animated_gif_frames_and_16_bit_png(ctx):
    frames = [Image.new("RGB", (4, 4), (v, v, v)) for v in (0, 128, 255)]
    frames[0].save(ctx.paths.input / "anim.gif", save_all=True, append_images=frames[1:], duration=40)
    image, mask = run("LoadImage", image="anim.gif")
    assert image.shape == (3, 4, 4, 3)
    assert image[0].max() < 0.01 and image[2].min() > 0.99

    grey16 = np.full((2, 3), 65535 // 2, dtype=np.uint16)
    Image.fromarray(grey16).save(ctx.paths.input / "deep.png")
    image, _ = run("LoadImage", image="deep.png")
    assert image.shape == (1, 2, 3, 3)
    assert torch.allclose(image, torch.full_like(image, (65535 // 2) / 65535), atol=1e-4)


def test_load_image_counts_pixels_over_all_frames_before_decoding(ctx, monkeypatch):
    # The attack: a few KB of GIF holding 80 frames of 1000x1000 (80 MP decoded, about 1 GB as floats).
    frames = [Image.new("P", (1000, 1000), v % 2) for v in range(80)]
    frames[0].save(ctx.paths.input / "bomb.gif", save_all=True, append_images=frames[1:])
    assert (ctx.paths.input / "bomb.gif").stat().st_size < 200_000
    decoded = []
    monkeypatch.setattr(image_media, "_rgb_plane", lambda frame: decoded.append(frame) or None)
    with pytest.raises(ValueError, match=r"LoadImage: .*'bomb.gif'.*80 frame\(s\) of 1000x1000.*64 MP"):
        run("LoadImage", image="bomb.gif")
    assert decoded == []  # refused before any frame was decoded
    monkeypatch.setattr(image_media, "MAX_DECODE_FRAMES", 50)
    monkeypatch.setattr(image_media, "MAX_DECODE_PIXELS", 10**12)
    with pytest.raises(ValueError, match="has 80 frames; at most 50"):
        run("LoadImage", image="bomb.gif")


def test_load_image_annotated_output_and_subfolder(ctx):
    write_rgba(ctx.paths.output / "made.png", seed=1)
    write_rgba(ctx.paths.input / "sub" / "deep.png", seed=2)
    assert run("LoadImage", image="made.png [output]")[0].shape == (1, 4, 5, 3)
    assert run("LoadImage", image="sub/deep.png")[0].shape == (1, 4, 5, 3)


def test_load_image_refuses_non_image_file_by_name(ctx):
    (ctx.paths.input / "fake.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="LoadImage: cannot read image file 'fake.png'"):
        run("LoadImage", image="fake.png")


def test_load_image_choices_list_images_in_input_folder_only(ctx):
    write_rgba(ctx.paths.input / "b.png")
    write_rgba(ctx.paths.input / "sub" / "c.webp")
    (ctx.paths.input / "notes.txt").write_text("x")
    write_rgba(ctx.paths.input / ".hidden.png")
    write_rgba(ctx.paths.output / "elsewhere.png")
    choices = SPECS["LoadImage"].input("image").choice_list()
    assert choices == ["b.png", "sub/c.webp"]
    info = node_info(SPECS["LoadImage"])["input"]["required"]["image"]
    assert info[0] == choices and info[1]["image_upload"] is True


def test_load_image_fingerprint_follows_file_content(ctx):
    path = ctx.paths.input / "f.png"
    write_rgba(path, seed=3)
    fingerprint = SPECS["LoadImage"].fingerprint
    first = fingerprint(image="f.png")
    assert fingerprint(image="f.png") == first
    write_rgba(path, seed=4)
    assert fingerprint(image="f.png") != first


def test_load_image_validation_names_folder_searched(ctx):
    validate = SPECS["LoadImage"].validate_inputs
    write_rgba(ctx.paths.input / "ok.png")
    assert validate(image="ok.png") is True
    message = validate(image="missing.png")
    assert isinstance(message, str) and "missing.png" in message and str(ctx.paths.input) in message
    assert str(ctx.paths.output) in validate(image="missing.png [output]")


@pytest.mark.parametrize("name", ["../outside.png", "/etc/passwd", "sub/../../outside.png", "a\\..\\b.png", "x\x00.png"])
def test_load_image_refuses_names_leaving_input_folder(ctx, tmp_path, name):
    write_rgba(tmp_path / "outside.png")
    result = SPECS["LoadImage"].validate_inputs(image=name)
    assert result is not True and "invalid image file" in result
    with pytest.raises(UnsafePathError):
        run("LoadImage", image=name)


def test_load_image_refuses_symlink_out_of_input_folder(ctx, tmp_path):
    secret = tmp_path / "secret.png"
    write_rgba(secret)
    (ctx.paths.input / "link.png").symlink_to(secret)
    with pytest.raises(UnsafePathError):
        run("LoadImage", image="link.png")


# ---------------------------------------------------------------------- SaveImage / PreviewImage
def test_save_image_writes_numbered_pngs_with_metadata(ctx):
    images = torch.rand(2, 4, 6, 3, generator=torch.Generator().manual_seed(0))
    prompt = {"1": {"class_type": "SaveImage", "inputs": {}}}
    out = run("SaveImage", images=images, filename_prefix="shots/run", prompt=prompt,
              extra_pnginfo={"workflow": {"nodes": []}})
    assert out.values[0] is images
    assert out.ui == {"images": [
        {"filename": "run_00001_.png", "subfolder": "shots", "type": "output"},
        {"filename": "run_00002_.png", "subfolder": "shots", "type": "output"},
    ]}
    folder = ctx.paths.output / "shots"
    assert sorted(p.name for p in folder.iterdir()) == ["run_00001_.png", "run_00002_.png"]  # no temp left
    with Image.open(folder / "run_00002_.png") as png:
        assert json.loads(png.text["prompt"]) == prompt
        assert json.loads(png.text["workflow"]) == {"nodes": []}
        saved = torch.from_numpy(np.array(png.convert("RGB"))).float() / 255
    # Truncated to 8 bits as ComfyUI writes pixels: never above the value, less than one step below.
    assert (images[1] - saved).min() >= -1e-6 and (images[1] - saved).max() < 1 / 255 + 1e-6
    again = run("SaveImage", images=images[:1], filename_prefix="shots/run")
    assert again.ui["images"][0]["filename"] == "run_00003_.png"


def test_save_image_drops_metadata_over_the_cap_and_says_so(ctx, caplog):
    """A prompt bigger than the 1 MB cap is left out of the PNG (the small workflow stays); a warning says so."""
    huge = {"1": {"class_type": "SaveImage", "inputs": {"note": "x" * (node_files.MAX_EMBEDDED_METADATA_BYTES + 10)}}}
    with caplog.at_level("WARNING", logger="nodes.files"):
        out = run("SaveImage", images=torch.zeros(1, 8, 8, 3), filename_prefix="big", prompt=huge,
                  extra_pnginfo={"workflow": {"nodes": []}})
    path = ctx.paths.output / out.ui["images"][0]["filename"]
    assert path.stat().st_size < 100_000
    with Image.open(path) as png:
        assert "prompt" not in png.text and json.loads(png.text["workflow"]) == {"nodes": []}
    assert any("'prompt'" in r.getMessage() and "cap" in r.getMessage() for r in caplog.records)


def test_save_image_expands_size_tokens(ctx):
    out = run("SaveImage", images=torch.zeros(1, 3, 5, 3), filename_prefix="%width%x%height%")
    assert out.ui["images"][0]["filename"] == "5x3_00001_.png"


def test_save_image_never_overwrites_with_pattern_characters_in_prefix(ctx):
    first = run("SaveImage", images=torch.zeros(1, 2, 2, 3), filename_prefix="shot[1]").ui["images"][0]
    second = run("SaveImage", images=torch.ones(1, 2, 2, 3), filename_prefix="shot[1]").ui["images"][0]
    assert (first["filename"], second["filename"]) == ("shot[1]_00001_.png", "shot[1]_00002_.png")
    with Image.open(ctx.paths.output / first["filename"]) as png:
        assert png.getpixel((0, 0)) == (0, 0, 0)


@pytest.mark.parametrize("prefix", ["../escape", "/tmp/abs", "a/../../escape"])
def test_save_image_refuses_prefix_leaving_output_folder(ctx, tmp_path, prefix):
    with pytest.raises(UnsafePathError):
        run("SaveImage", images=torch.zeros(1, 2, 2, 3), filename_prefix=prefix)
    assert not list(tmp_path.glob("escape*"))


@pytest.mark.parametrize("prefix", ["bell\x07", "two\nlines", "sub\x1b/shot"])
def test_save_image_refuses_control_characters_in_prefix(ctx, prefix):
    with pytest.raises(UnsafePathError, match="cannot hold"):
        run("SaveImage", images=torch.zeros(1, 2, 2, 3), filename_prefix=prefix)
    assert not list(ctx.paths.output.rglob("*.png"))


def test_save_image_refuses_non_image(ctx):
    with pytest.raises(TypeError, match="SaveImage"):
        run("SaveImage", images=torch.zeros(2, 2, 3), filename_prefix="x")


def test_preview_image_goes_to_temp(ctx):
    out = run("PreviewImage", images=torch.ones(1, 2, 2, 4))
    (entry,) = out.ui["images"]
    assert entry["type"] == "temp" and entry["filename"].startswith("ComfyUI_temp_")
    with Image.open(ctx.paths.temp / entry["filename"]) as png:
        assert png.mode == "RGBA"


# ---------------------------------------------------------------------- EmptyImage, scaling, size
def test_empty_image_color():
    (image,) = run("EmptyImage", width=3, height=2, batch_size=2, color=0xFF8000)
    assert image.shape == (2, 2, 3, 3)
    assert torch.allclose(image[1, 1, 2], torch.tensor([1.0, 128 / 255, 0.0]))


@pytest.mark.parametrize("method", image_nodes.UPSCALE_METHODS)
def test_image_scale_every_method(method):
    image = torch.rand(2, 8, 12, 3, generator=torch.Generator().manual_seed(1))
    (out,) = run("ImageScale", image=image, upscale_method=method, width=7, height=5, crop="disabled")
    assert out.shape == (2, 5, 7, 3) and out.min() >= 0 and out.max() <= 1
    flat = torch.full((1, 8, 12, 3), 0.25)
    (same,) = run("ImageScale", image=flat, upscale_method=method, width=20, height=9, crop="center")
    assert torch.allclose(same, torch.full_like(same, 0.25), atol=1e-3)


def test_image_scale_zero_keeps_aspect_and_center_crop():
    image = torch.zeros(1, 10, 20, 3)
    image[:, :, 5:15] = 1.0  # a bright middle band, dark at the sides
    (out,) = run("ImageScale", image=image, upscale_method="nearest-exact", width=0, height=5, crop="disabled")
    assert out.shape == (1, 5, 10, 3)
    (passthrough,) = run("ImageScale", image=image, upscale_method="bilinear", width=0, height=0, crop="disabled")
    assert passthrough is image
    # Center crop to a square keeps only the middle 10 columns: all bright.
    (square,) = run("ImageScale", image=image, upscale_method="nearest-exact", width=10, height=10, crop="center")
    assert torch.equal(square, torch.ones(1, 10, 10, 3))


def test_image_scale_to_total_pixels():
    image = torch.rand(1, 256, 512, 3)
    (out,) = run("ImageScaleToTotalPixels", image=image, upscale_method="area", megapixels=1.0, resolution_steps=1)
    assert out.shape == (1, 724, 1448, 3)
    (stepped,) = run("ImageScaleToTotalPixels", image=image, upscale_method="bilinear", megapixels=0.25,
                     resolution_steps=64)
    assert stepped.shape[1] % 64 == 0 and stepped.shape[2] % 64 == 0


def test_get_image_size_reports_and_shows_text(ctx, events):
    assert run("GetImageSize", image=torch.zeros(3, 5, 7, 3)) == (7, 5, 3)
    texts = [data["text"] for event, data in events if event == "progress_text"]
    assert texts == ["3 x 7x5 pixels"]


# ---------------------------------------------------------------------- declarations, executor
def test_declarations_match_comfyui():
    def order(node_id):
        return node_info(SPECS[node_id])["input_order"]

    assert order("LoadImage") == {"required": ["image"]}
    assert order("SaveImage") == {"required": ["images", "filename_prefix"], "hidden": ["prompt", "extra_pnginfo"]}
    assert order("ImageScale")["required"] == ["image", "upscale_method", "width", "height", "crop"]
    assert order("ImageScaleToTotalPixels")["required"] == ["image", "upscale_method", "megapixels", "resolution_steps"]
    assert order("EmptyImage")["required"] == ["width", "height", "batch_size", "color"]
    assert node_info(SPECS["LoadImage"])["output"] == ["IMAGE", "MASK"]
    assert node_info(SPECS["GetImageSize"])["output_name"] == ["width", "height", "batch_size"]
    assert node_info(SPECS["SaveImage"])["input"]["required"]["filename_prefix"][1]["default"] == "ComfyUI"


def test_workflow_runs_through_executor(runner, paths):
    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 6, "batch_size": 1, "color": 0x00FF00}},
        "2": {"class_type": "ImageScale", "inputs": {"image": ["1", 0], "upscale_method": "bilinear", "width": 4,
                                                      "height": 0, "crop": "disabled"}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "wf"}},
    }
    result = runner.run(prompt)
    assert result.status == "success", result.error
    (entry,) = result.outputs["3"]["images"]
    with Image.open(paths.output / entry["filename"]) as png:
        assert png.size == (4, 3)
        assert json.loads(png.text["prompt"])["3"]["class_type"] == "SaveImage"


def test_missing_image_file_error_through_validation(registry, paths):
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "nope.png"}},
        "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    # Choice lists read the running context's folders, so validation runs inside one.
    token = activate(RunContext(prompt_id="", node_id="", display_node_id="", paths=paths))
    try:
        with pytest.raises(ValueError) as caught:
            validate_prompt(prompt, registry)
    finally:
        deactivate(token)
    text = json.dumps(caught.value.to_json())
    assert "nope.png" in text and "searched folder" in text


def test_rebatch_images_regroups_every_frame_in_order():
    batches = [torch.full((2, 3, 4, 3), 0.1), torch.full((1, 3, 4, 3), 0.2), torch.full((3, 3, 4, 3), 0.3)]
    [out] = run("RebatchImages", images=batches, batch_size=[4])
    assert [tuple(b.shape) for b in out] == [(4, 3, 4, 3), (2, 3, 4, 3)]
    assert torch.equal(torch.cat(out), torch.cat(batches))
    with pytest.raises(ValueError, match="RebatchImages: input 'images' mixes picture sizes"):
        run("RebatchImages", images=[torch.zeros(1, 3, 4, 3), torch.zeros(1, 5, 4, 3)], batch_size=[2])
