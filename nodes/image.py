"""Image nodes: load, save (plain or with a choice of format), preview, compare, fill, resize and measure
IMAGE batches.

The pixel work (decoding, PNG encoding, cropping, resizing) is in `media.image`; the folders in
`nodes.files`. IMAGE is (B, H, W, C) in 0..1; the MASK LoadImage gives is 1 where the picture is
transparent.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from execution.context import current
from execution.paths import atomic_write_bytes
from media.image import (
    CROP_METHODS, IMAGE_EXTENSIONS, UPSCALE_METHODS, check_image, encode_png, encode_png16, load_image_file,
    scale_batch, scale_images,
)
from nodes import MAX_RESOLUTION
from nodes.files import file_metadata, output_target, temp_prefix
from nodes.spec import Input, NodeOutput, NodeSpec, Output

PNG_COMPRESS_LEVEL = 4
PREVIEW_COMPRESS_LEVEL = 1  # previews are thrown away: favour speed over size
_PREFIX_TOOLTIP = (
    "Start of the saved file's name. A '/' puts the file in a subfolder; %width%, %height%, %year%, %month%, "
    "%day%, %hour%, %minute% and %second% are replaced by their values."
)


def _load_image(image: Path) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return load_image_file(image)
    except ValueError as exc:  # not a picture, cut short, or too large
        raise ValueError(f"LoadImage: cannot read image file {image.name!r}: {exc}") from exc


def _write_pngs(node: str, images: torch.Tensor, prefix: str, kind: str, compress_level: int,
                metadata: dict[str, Any], *, encode=encode_png, name: str = "images") -> list[dict[str, str]]:
    images = check_image(node, images, name)
    written = []
    for index, frame in enumerate(images):
        path, filename, subfolder = output_target(kind, prefix.replace("%batch_num%", str(index)), "png",
                                                  width=int(frame.shape[1]), height=int(frame.shape[0]))
        atomic_write_bytes(path, encode(frame, compress_level=compress_level, metadata=metadata))
        written.append({"filename": filename, "subfolder": subfolder, "type": kind})
    return written


def _save_image(images: torch.Tensor, filename_prefix: str, prompt: Any = None,
                extra_pnginfo: Any = None) -> NodeOutput:
    written = _write_pngs("SaveImage", images, filename_prefix, "output", PNG_COMPRESS_LEVEL,
                          file_metadata(prompt, extra_pnginfo))
    return NodeOutput.of(images, ui={"images": written})


def _preview_image(images: torch.Tensor, prompt: Any = None, extra_pnginfo: Any = None) -> NodeOutput:
    written = _write_pngs("PreviewImage", images, temp_prefix(), "temp", PREVIEW_COMPRESS_LEVEL,
                          file_metadata(prompt, extra_pnginfo))
    return NodeOutput.of(images, ui={"images": written})


# SaveImageAdvanced's formats and their options. ComfyUI offers EXR and AVIF as well; Weft writes PNG only.
PNG_BIT_DEPTHS = {"8-bit": encode_png, "16-bit": encode_png16}


def _save_image_advanced(images: torch.Tensor, filename_prefix: str, format: dict, prompt: Any = None,
                         extra_pnginfo: Any = None) -> NodeOutput:
    node = "SaveImageAdvanced"
    chosen = format.get("format") if isinstance(format, dict) else format
    if chosen != "png":
        raise ValueError(f"{node}: input 'format' is {chosen!r}; Weft writes only 'png' (8 or 16 bits per channel)")
    depth = format.get("bit_depth", "8-bit")
    if depth not in PNG_BIT_DEPTHS:
        raise ValueError(f"{node}: input 'format.bit_depth' is {depth!r}; the choices are {', '.join(PNG_BIT_DEPTHS)}")
    written = _write_pngs(node, images, filename_prefix, "output", PNG_COMPRESS_LEVEL,
                          file_metadata(prompt, extra_pnginfo), encode=PNG_BIT_DEPTHS[depth])
    return NodeOutput.of(images, ui={"images": written})


def _image_compare(image_a: torch.Tensor | None = None, image_b: torch.Tensor | None = None,
                   compare_view: Any = None) -> NodeOutput:
    # The editor's slider shows the two sides from these lists; either side may be left unconnected.
    sides = {}
    for key, name, value in (("a_images", "image_a", image_a), ("b_images", "image_b", image_b)):
        sides[key] = [] if value is None else _write_pngs("ImageCompare", value, temp_prefix(), "temp",
                                                          PREVIEW_COMPRESS_LEVEL, {}, name=name)
    return NodeOutput(ui=sides)


def _empty_image(width: int, height: int, batch_size: int, color: int) -> tuple[torch.Tensor]:
    red, green, blue = (color >> 16) & 0xFF, (color >> 8) & 0xFF, color & 0xFF
    rgb = torch.tensor([red, green, blue], dtype=torch.float32) / 255.0
    return (rgb.expand(batch_size, height, width, 3).contiguous(),)


def _image_scale(image: torch.Tensor, upscale_method: str, width: int, height: int, crop: str) -> tuple[torch.Tensor]:
    image = check_image("ImageScale", image)
    if width == 0 and height == 0:
        return (image,)
    source_h, source_w = image.shape[1], image.shape[2]
    if width == 0:  # derived from the height, proportions kept
        width = max(1, round(source_w * height / source_h))
    elif height == 0:
        height = max(1, round(source_h * width / source_w))
    return (scale_images(image, width, height, upscale_method, crop),)


def _image_scale_to_total_pixels(image: torch.Tensor, upscale_method: str, megapixels: float,
                                 resolution_steps: int) -> tuple[torch.Tensor]:
    image = check_image("ImageScaleToTotalPixels", image)
    source_h, source_w = image.shape[1], image.shape[2]
    # One factor for both sides, so the area becomes megapixels * 2^20 and the proportions stay.
    factor = math.sqrt(megapixels * 1024 * 1024 / (source_w * source_h))
    step = resolution_steps
    width = max(step, round(source_w * factor / step) * step)
    height = max(step, round(source_h * factor / step) * step)
    return (scale_images(image, int(width), int(height), upscale_method),)


# ResizeImageMaskNode's ways of choosing the new size (ComfyUI's option names).
RESIZE_TYPES = ("scale dimensions", "scale by multiplier", "scale longer dimension", "scale shorter dimension",
                "scale width", "scale height", "scale total pixels", "match size", "scale to multiple")


def _image_or_mask(node: str, value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.dim() == 3:
        return value
    return check_image(node, value, name)


def _proportional(width: int, height: int, new_width: int, new_height: int) -> tuple[int, int]:
    """(width, height) for a target where a 0 side follows from the other, proportions kept."""
    if new_width == 0:
        new_width = max(1, round(width * new_height / height))
    elif new_height == 0:
        new_height = max(1, round(height * new_width / width))
    return new_width, new_height


def _side_scaled(width: int, height: int, size: int, longer: bool) -> tuple[int, int]:
    """The longer (or shorter) side set to `size`, the other in proportion; a square gets size x size."""
    if width == height:
        return size, size
    if (height > width) == longer:
        return round(width / height * size), size
    return size, round(height / width * size)


def _multiple_cover(batch: torch.Tensor, multiple: int, method: str) -> torch.Tensor:
    """Sides cut down to multiples of `multiple`: scaled so the target is covered, then the middle kept."""
    height, width = int(batch.shape[1]), int(batch.shape[2])
    target_w, target_h = width // multiple * multiple, height // multiple * multiple
    if multiple <= 1 or target_w == 0 or target_h == 0 or (target_w, target_h) == (width, height):
        return batch
    if target_w / width >= target_h / height:
        scaled_w, scaled_h = target_w, max(target_h, math.ceil(height * target_w / width))
    else:
        scaled_w, scaled_h = max(target_w, math.ceil(width * target_h / height)), target_h
    scaled = scale_batch(batch, scaled_w, scaled_h, method)
    top, left = (scaled_h - target_h) // 2, (scaled_w - target_w) // 2
    return scaled[:, top:top + target_h, left:left + target_w]


def _resize_image_mask(input: torch.Tensor, resize_type: dict, scale_method: str) -> tuple[torch.Tensor]:
    node = "ResizeImageMaskNode"
    batch = _image_or_mask(node, input, "input")
    choice = resize_type.get("resize_type")
    height, width = int(batch.shape[1]), int(batch.shape[2])
    crop = resize_type.get("crop", "disabled")
    if choice == "scale dimensions":
        if resize_type["width"] == 0 and resize_type["height"] == 0:
            return (batch,)
        size = _proportional(width, height, int(resize_type["width"]), int(resize_type["height"]))
    elif choice == "scale by multiplier":
        size = round(width * resize_type["multiplier"]), round(height * resize_type["multiplier"])
    elif choice in ("scale longer dimension", "scale shorter dimension"):
        key = "longer_size" if choice == "scale longer dimension" else "shorter_size"
        size = _side_scaled(width, height, int(resize_type[key]), longer=key == "longer_size")
    elif choice == "scale width":
        size = _proportional(width, height, int(resize_type["width"]), 0)
    elif choice == "scale height":
        size = _proportional(width, height, 0, int(resize_type["height"]))
    elif choice == "scale total pixels":
        factor = math.sqrt(int(resize_type["megapixels"] * 1024 * 1024) / (width * height))
        size = round(width * factor), round(height * factor)
    elif choice == "match size":
        match = _image_or_mask(node, resize_type.get("match"), "resize_type.match")
        size = int(match.shape[2]), int(match.shape[1])
    elif choice == "scale to multiple":
        return (_multiple_cover(batch, int(resize_type["multiple"]), scale_method),)
    else:
        raise ValueError(f"{node}: resize_type {choice!r} is not one of {', '.join(RESIZE_TYPES)}")
    try:
        return (scale_batch(batch, size[0], size[1], scale_method, crop),)
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


def _get_image_size(image: torch.Tensor, unique_id: Any = None) -> tuple[int, int, int]:
    image = check_image("GetImageSize", image)
    count, height, width = int(image.shape[0]), int(image.shape[1]), int(image.shape[2])
    current().progress(1, 1, text=f"{count} x {width}x{height} pixels")
    return width, height, count


_HIDDEN_METADATA = [Input.hidden("prompt", "PROMPT"), Input.hidden("extra_pnginfo", "EXTRA_PNGINFO")]
_CROP = Input.combo("crop", list(CROP_METHODS), "center",
                    tooltip="When the new shape differs: 'center' cuts the middle to the new proportions first, "
                            "'disabled' stretches.")
_SIDE = dict(min=0, max=MAX_RESOLUTION, step=1)

def _rebatch_images(images: list[torch.Tensor], batch_size: list[int]) -> tuple[list[torch.Tensor]]:
    size = int(batch_size[0])
    frames = [frame for batch in images for frame in check_image("RebatchImages", batch, "images").split(1)]
    shapes = {tuple(frame.shape[1:]) for frame in frames}
    if len(shapes) > 1:
        raise ValueError(f"RebatchImages: input 'images' mixes picture sizes {sorted(shapes)}; a batch holds one "
                         "size, so resize them to one size first")
    return ([torch.cat(frames[i:i + size]) for i in range(0, len(frames), size)],)


NODES = [
    NodeSpec(
        node_id="LoadImage", display_name="Load Image", category="image", python_module="nodes",
        description="Reads a picture from the input folder. Besides the frames it outputs a MASK taken from the "
                    "transparency: 1 where the picture is see-through, 0 where it is opaque.",
        execute=_load_image, inputs=[Input.file("image", extensions=IMAGE_EXTENSIONS, upload="image")],
        outputs=[Output("IMAGE"), Output("MASK")],
        search_aliases=("load image", "open image", "import image", "image input", "upload image"),
    ),
    NodeSpec(
        node_id="SaveImage", display_name="Save Image", category="image", python_module="nodes",
        description="Writes every image of the batch as a numbered PNG file in the output folder, with the "
                    "workflow stored inside so the editor can reopen it.",
        execute=_save_image, output_node=True,
        inputs=[
            Input.link("images", "IMAGE", tooltip="Images to write, one file each."),
            Input.string("filename_prefix", "ComfyUI", tooltip=_PREFIX_TOOLTIP),
            Input.hidden("prompt", "PROMPT", as_string=True),  # ComfyUI's classic node: bare strings
            Input.hidden("extra_pnginfo", "EXTRA_PNGINFO", as_string=True),
        ],
        outputs=[Output("IMAGE", "images")],
        search_aliases=("save", "save image", "export image", "output image", "write image"),
    ),
    NodeSpec(
        node_id="PreviewImage", display_name="Preview Image", category="image", python_module="nodes",
        description="Shows the images in the editor; the files go to the temporary folder rather than the "
                    "output folder.",
        execute=_preview_image, output_node=True,
        inputs=[
            Input.link("images", "IMAGE"),
            Input.hidden("prompt", "PROMPT", as_string=True),  # ComfyUI's classic node: bare strings
            Input.hidden("extra_pnginfo", "EXTRA_PNGINFO", as_string=True),
        ],
        outputs=[Output("IMAGE", "images")],
        search_aliases=("preview", "preview image", "show image", "view image"),
    ),
    NodeSpec(
        node_id="EmptyImage", category="image", python_module="nodes",
        description="A batch of images painted in one solid colour, written as the number 0xRRGGBB.",
        execute=_empty_image,
        inputs=[
            Input.int("width", 512, min=1, max=MAX_RESOLUTION, step=1),
            Input.int("height", 512, min=1, max=MAX_RESOLUTION, step=1),
            Input.int("batch_size", 1, min=1, max=4096),
            Input.int("color", 0, min=0, max=0xFFFFFF, step=1, display="color"),
        ],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="ImageScale", display_name="Upscale Image", category="image/upscaling", python_module="nodes",
        description="Resizes images to width x height. A side set to 0 follows from the other so the proportions "
                    "stay; with both at 0 the images pass through untouched.",
        execute=_image_scale,
        inputs=[
            Input.link("image", "IMAGE"),
            Input.combo("upscale_method", list(UPSCALE_METHODS)),
            Input.int("width", 512, min=0, max=MAX_RESOLUTION, step=1),
            Input.int("height", 512, min=0, max=MAX_RESOLUTION, step=1),
            Input.combo("crop", list(CROP_METHODS)),
        ],
        outputs=[Output("IMAGE")],
        search_aliases=("resize", "resize image", "scale image", "image resize"),
    ),
    NodeSpec(
        node_id="ImageScaleToTotalPixels", display_name="Scale Image to Total Pixels", category="image/upscaling",
        python_module="comfy_extras.nodes_post_processing",
        description="Resizes images, proportions kept, so each holds about `megapixels` x 1024 x 1024 pixels; "
                    "both sides are rounded to multiples of `resolution_steps`.",
        execute=_image_scale_to_total_pixels,
        inputs=[
            Input.link("image", "IMAGE"),
            Input.combo("upscale_method", list(UPSCALE_METHODS)),
            Input.float("megapixels", 1.0, min=0.01, max=16.0, step=0.01),
            Input.int("resolution_steps", 1, min=1, max=256),
        ],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="GetImageSize", display_name="Get Image Size", category="image",
        python_module="comfy_extras.nodes_images",
        description="Outputs a batch's width and height in pixels and how many images it holds, and shows them "
                    "on the node.",
        execute=_get_image_size,
        inputs=[Input.link("image", "IMAGE"), Input.hidden("unique_id", "UNIQUE_ID")],
        outputs=[Output("INT", "width"), Output("INT", "height"), Output("INT", "batch_size")],
        search_aliases=("dimensions", "resolution", "image info"),
    ),
    NodeSpec(
        node_id="ResizeImageMaskNode", display_name="Resize Image/Mask", category="transform",
        python_module="comfy_extras.nodes_post_processing",
        description="Resizes an image batch or a mask batch; resize_type chooses how the new size is found.",
        execute=_resize_image_mask,
        inputs=[
            Input.match_type("input", "input_type", allowed="IMAGE,MASK", tooltip="Images or masks to resize."),
            Input.dynamic_combo("resize_type", {
                "scale dimensions": [
                    Input.int("width", 512, **_SIDE, tooltip="New width in pixels; 0 follows from the height."),
                    Input.int("height", 512, **_SIDE, tooltip="New height in pixels; 0 follows from the width."),
                    _CROP],
                "scale by multiplier": [Input.float("multiplier", 1.0, min=0.01, max=8.0, step=0.01,
                                                    tooltip="Factor applied to both sides.")],
                "scale longer dimension": [Input.int("longer_size", 512, **_SIDE,
                                                     tooltip="New length of the longer side; proportions kept.")],
                "scale shorter dimension": [Input.int("shorter_size", 512, **_SIDE,
                                                      tooltip="New length of the shorter side; proportions kept.")],
                "scale width": [Input.int("width", 512, **_SIDE, tooltip="New width; the height follows.")],
                "scale height": [Input.int("height", 512, **_SIDE, tooltip="New height; the width follows.")],
                "scale total pixels": [Input.float("megapixels", 1.0, min=0.01, max=16.0, step=0.01,
                                                   tooltip="Pixel budget in millions (1.0 is 1024 x 1024); "
                                                           "proportions kept.")],
                "match size": [Input.link("match", "IMAGE,MASK", tooltip="Images or masks whose size to take."),
                               _CROP],
                "scale to multiple": [Input.int("multiple", 8, min=1, max=MAX_RESOLUTION, step=1,
                                                tooltip="Both sides become multiples of this: the picture is "
                                                        "scaled to cover that size and its middle kept.")],
            }, tooltip="How the new size is chosen."),
            Input.combo("scale_method", list(UPSCALE_METHODS), "area",
                        tooltip="Resampling filter: area suits shrinking, lanczos enlarging, nearest-exact "
                                "pixel art."),
        ],
        outputs=[Output("COMFY_MATCHTYPE_V3", "resized", match_type="input_type")],
        search_aliases=("resize", "resize image", "resize mask", "scale image", "scale mask"),
    ),
    NodeSpec(
        node_id="RebatchImages", display_name="Rebatch Images", category="image/batch",
        python_module="comfy_extras.nodes_rebatch",
        description="Takes every image of every incoming batch, in order, and regroups them into batches of "
                    "batch_size; the last batch holds what is left.",
        execute=_rebatch_images, input_is_list=True,
        inputs=[Input.link("images", "IMAGE"), Input.int("batch_size", 1, min=1, max=4096)],
        outputs=[Output("IMAGE", is_list=True)],
    ),
    NodeSpec(
        node_id="SaveImageAdvanced", display_name="Save Image (Advanced)", category="image", python_module=
        "comfy_extras.nodes_images",
        description="Writes every image of the batch as a numbered file in the output folder, in the format "
                    "chosen (PNG of 8 or 16 bits per channel), with the workflow stored inside.",
        execute=_save_image_advanced, output_node=True,
        inputs=[
            Input.link("images", "IMAGE", tooltip="Images to write, one file each."),
            Input.string("filename_prefix", "ComfyUI", tooltip=_PREFIX_TOOLTIP),
            Input.dynamic_combo("format", {"png": [
                Input.combo("bit_depth", ["8-bit", "16-bit"], "8-bit",
                            tooltip="Bits per channel: 16 keeps smooth gradients for further editing."),
                Input.combo("input_color_space", ["sRGB"], "sRGB", tooltip="How the pixel values are meant: "
                                                                             "sRGB, written as they are."),
            ]}, tooltip="File format."),
            *_HIDDEN_METADATA,
        ],
        outputs=[Output("IMAGE", "images")],
        search_aliases=("save", "save image", "export image", "output image", "write image", "16-bit png"),
    ),
    NodeSpec(
        node_id="ImageCompare", display_name="Image Compare", category="image", python_module=
        "comfy_extras.nodes_image_compare",
        description="Shows two images on one node with a slider between them; nothing is saved to the output "
                    "folder.",
        execute=_image_compare, output_node=True,
        inputs=[
            Input.link("image_a", "IMAGE", optional=True, tooltip="Left side of the slider."),
            Input.link("image_b", "IMAGE", optional=True, tooltip="Right side of the slider."),
            # The editor's slider: it holds no value a run needs, and saved workflows store none.
            Input.link("compare_view", "IMAGECOMPARE", optional=True),
        ],
        outputs=[],
        search_aliases=("compare", "before after", "slider"),
    ),
]
