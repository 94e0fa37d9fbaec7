"""Model-agnostic core utility nodes the official templates use around any model: strings, images by a
factor, masks from and into images, a batch joined from several images, text saved to a file.

Each keeps ComfyUI's node id, input names, combo values and outputs, so a template that uses it converts
and runs unchanged; the work is small and done here or in `media.image`.
"""
from __future__ import annotations

import json
import re

import torch

from execution.paths import atomic_write_bytes
from media.image import UPSCALE_METHODS, check_image, scale_batch, scale_images
from nodes import MAX_RESOLUTION
from nodes.files import output_target
from nodes.spec import Input, NodeOutput, NodeSpec, Output

MASK_CHANNELS = ("red", "green", "blue", "alpha")


def _concatenate(string_a: str, string_b: str, delimiter: str) -> tuple[str]:
    return (f"{string_a}{delimiter}{string_b}",)


def _replace(string: str, find: str, replace: str) -> tuple[str]:
    return (string.replace(find, replace),)


def _regex_replace(string: str, regex_pattern: str, replace: str, case_insensitive: bool = True,
                   multiline: bool = False, dotall: bool = False, count: int = 0) -> tuple[str]:
    flags = (re.IGNORECASE if case_insensitive else 0) | (re.MULTILINE if multiline else 0) | \
        (re.DOTALL if dotall else 0)
    try:
        pattern = re.compile(regex_pattern, flags)
    except re.error as exc:
        raise ValueError(f"RegexReplace: regex_pattern {regex_pattern!r} is not a valid expression: {exc}") from None
    return (pattern.sub(replace, string, count=int(count)),)


def _image_scale_by(image: torch.Tensor, upscale_method: str, scale_by: float) -> tuple[torch.Tensor]:
    image = check_image("ImageScaleBy", image)
    width = max(1, round(image.shape[2] * scale_by))
    height = max(1, round(image.shape[1] * scale_by))
    return (scale_images(image, width, height, upscale_method),)


def _image_to_mask(image: torch.Tensor, channel: str) -> tuple[torch.Tensor]:
    image = check_image("ImageToMask", image)
    index = MASK_CHANNELS.index(channel)
    if index >= image.shape[-1]:
        raise ValueError(f"ImageToMask: channel {channel!r} asked of images with {image.shape[-1]} channels "
                         "(no alpha channel)")
    return (image[..., index].clone(),)


def _check_mask(node: str, mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 3):
        raise TypeError(f"{node}: input {name!r} must be a MASK (B, H, W), got "
                        f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    return mask if mask.dim() == 3 else mask.unsqueeze(0)


def _invert_mask(mask: torch.Tensor) -> tuple[torch.Tensor]:
    return (1.0 - _check_mask("InvertMask", mask),)


def _join_image_with_alpha(image: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor]:
    image = check_image("JoinImageWithAlpha", image)
    alpha = _check_mask("JoinImageWithAlpha", alpha, "alpha")
    count = min(image.shape[0], alpha.shape[0])
    height, width = image.shape[1], image.shape[2]
    if tuple(alpha.shape[1:]) != (height, width):
        alpha = scale_batch(alpha.float(), width, height, "bilinear")
    # A MASK is 1 where a picture is transparent (as LoadImage gives it): opacity is its complement.
    return (torch.cat([image[:count, ..., :3], (1.0 - alpha[:count]).unsqueeze(-1).to(image.dtype)], dim=-1),)


def _batch_images(images: dict) -> tuple[torch.Tensor]:
    node = "BatchImagesNode"
    batches = [check_image(node, value, f"images.{name}") for name, value in images.items() if value is not None]
    if not batches:
        raise ValueError(f"{node}: input 'images' has no image connected; connect at least one")
    return (_joined(batches),)


def _image_batch(image1: torch.Tensor, image2: torch.Tensor) -> tuple[torch.Tensor]:
    return (_joined([check_image("ImageBatch", image1, "image1"), check_image("ImageBatch", image2, "image2")]),)


def _joined(batches: list[torch.Tensor]) -> torch.Tensor:
    """The batches one after the other, each fitted to the first one's size and to the most channels."""
    height, width = batches[0].shape[1], batches[0].shape[2]
    channels = max(batch.shape[-1] for batch in batches)
    fitted = []
    for batch in batches:
        # Every batch takes the first one's size (centre-cropped to its proportions, then resized) ...
        if (batch.shape[1], batch.shape[2]) != (height, width):
            batch = scale_batch(batch, width, height, "bilinear", "center")
        # ... and the most channels: grey is spread to RGB, a missing alpha is opaque.
        if batch.shape[-1] == 1 and channels > 1:
            batch = batch.expand(-1, -1, -1, 3)
        if batch.shape[-1] < channels:
            batch = torch.cat([batch, torch.ones_like(batch[..., :1])], dim=-1)
        fitted.append(batch.to(batches[0].dtype))
    return torch.cat(fitted, dim=0)


def _repeat_image_batch(image: torch.Tensor, amount: int) -> tuple[torch.Tensor]:
    return (check_image("RepeatImageBatch", image).repeat(int(amount), 1, 1, 1),)


def _image_invert(image: torch.Tensor) -> tuple[torch.Tensor]:
    return (1.0 - check_image("ImageInvert", image),)


def _mask_to_image(mask: torch.Tensor) -> tuple[torch.Tensor]:
    mask = _check_mask("MaskToImage", mask)
    return (mask.unsqueeze(-1).expand(-1, -1, -1, 3).contiguous(),)


def _solid_mask(value: float, width: int, height: int) -> tuple[torch.Tensor]:
    return (torch.full((1, int(height), int(width)), float(value), dtype=torch.float32),)


SAVE_TEXT_FORMATS = ("txt", "md", "json")


def _save_text(text: str, filename_prefix: str, format: str) -> NodeOutput:
    if not isinstance(text, str):
        raise TypeError(f"SaveText: input 'text' takes a STRING, got {type(text).__name__}")
    body = text
    if format == "json":
        # Valid JSON is written indented for reading; anything else is written as it came.
        try:
            body = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pass
    path, filename, subfolder = output_target("output", filename_prefix, format)
    atomic_write_bytes(path, body.encode("utf-8"))
    return NodeOutput.of(text, ui={"text": (text,),
                                   "files": [{"filename": filename, "subfolder": subfolder, "type": "output"}]})


_TEXT = {"multiline": True}
NODES = [
    NodeSpec(
        node_id="StringConcatenate", display_name="Concatenate", category="utils/string",
        python_module="comfy_extras.nodes_string",
        description="Joins two texts, with the delimiter between them.",
        execute=_concatenate,
        inputs=[Input.string("string_a", **_TEXT), Input.string("string_b", **_TEXT),
                Input.string("delimiter", "", tooltip="Put between the two texts (empty: nothing).")],
        outputs=[Output("STRING")],
    ),
    NodeSpec(
        node_id="StringReplace", display_name="Replace", category="utils/string",
        python_module="comfy_extras.nodes_string",
        description="Replaces every occurrence of `find` in the text with `replace` (plain text, not a pattern).",
        execute=_replace,
        inputs=[Input.string("string", **_TEXT), Input.string("find", **_TEXT), Input.string("replace", **_TEXT)],
        outputs=[Output("STRING")],
    ),
    NodeSpec(
        node_id="RegexReplace", display_name="Regex Replace", category="utils/string",
        python_module="comfy_extras.nodes_string",
        description="Replaces what a regular expression matches in the text; `replace` may refer to groups "
                    "(\\1, \\g<name>).",
        execute=_regex_replace,
        inputs=[
            Input.string("string", **_TEXT), Input.string("regex_pattern", **_TEXT),
            Input.string("replace", **_TEXT),
            Input.boolean("case_insensitive", True, optional=True, tooltip="Letters match in either case."),
            Input.boolean("multiline", False, optional=True, tooltip="^ and $ match at every line's ends."),
            Input.boolean("dotall", False, optional=True, tooltip="'.' matches line breaks too."),
            Input.int("count", 0, min=0, max=100, optional=True,
                      tooltip="At most this many replacements, from the start; 0 replaces every match."),
        ],
        outputs=[Output("STRING")],
    ),
    NodeSpec(
        node_id="ImageScaleBy", display_name="Upscale Image By", category="image/upscaling", python_module="nodes",
        description="Resizes images by one factor on both sides (rounded to whole pixels).",
        execute=_image_scale_by,
        inputs=[Input.link("image", "IMAGE"), Input.combo("upscale_method", list(UPSCALE_METHODS)),
                Input.float("scale_by", 1.0, min=0.01, max=8.0, step=0.01)],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="ImageToMask", display_name="Convert Image to Mask", category="mask",
        python_module="comfy_extras.nodes_mask",
        description="One channel of the images as a MASK.",
        execute=_image_to_mask,
        inputs=[Input.link("image", "IMAGE"), Input.combo("channel", list(MASK_CHANNELS))],
        outputs=[Output("MASK")],
    ),
    NodeSpec(
        node_id="InvertMask", display_name="Invert Mask", category="mask", python_module="comfy_extras.nodes_mask",
        description="1 minus the mask: what was covered is uncovered and the other way round.",
        execute=_invert_mask, inputs=[Input.link("mask", "MASK")], outputs=[Output("MASK")],
    ),
    NodeSpec(
        node_id="JoinImageWithAlpha", display_name="Join Image with Alpha", category="mask/compositing",
        python_module="comfy_extras.nodes_compositing",
        description="Adds an alpha channel to RGB images from a MASK (1 in the mask is transparent), resized to "
                    "the images when its size differs.",
        execute=_join_image_with_alpha,
        inputs=[Input.link("image", "IMAGE"), Input.link("alpha", "MASK")],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="BatchImagesNode", display_name="Batch Images", category="image",
        python_module="comfy_extras.nodes_post_processing",
        description="Joins several image batches into one, in slot order. Each takes the first one's size (cropped "
                    "to its proportions from the centre, then resized) and the most channels among them.",
        execute=_batch_images,
        inputs=[Input.autogrow("images", Input.link("image", "IMAGE", tooltip="A batch to add."), prefix="image",
                               min=2, max=50)],
        outputs=[Output("IMAGE")],
        search_aliases=("batch", "image batch", "batch images", "combine images", "merge images", "stack images"),
    ),
    NodeSpec(
        node_id="SaveText", display_name="Save Text", category="text", python_module="comfy_extras.nodes_text",
        description="Writes the text to a numbered file in the output folder and shows it on the node.",
        execute=_save_text, output_node=True,
        inputs=[
            Input.string("text", force_input=True, tooltip="Text to write."),
            Input.string("filename_prefix", "ComfyUI", tooltip="Start of the file's name; a '/' makes a subfolder "
                                                                "and %year%, %month%, %day% ... are replaced."),
            Input.combo("format", list(SAVE_TEXT_FORMATS), "txt",
                        tooltip="File extension; with 'json', text that is valid JSON is written indented."),
        ],
        outputs=[Output("STRING", "text")],
        search_aliases=("save text", "write text", "export text"),
    ),
    NodeSpec(
        node_id="ImageBatch", display_name="Batch Images", category="image", python_module="nodes",
        description="Puts image2's batch after image1's; image2 is cropped to image1's proportions from the centre "
                    "and resized to its size when they differ. (Batch Images with any number of inputs is "
                    "BatchImagesNode.)",
        execute=_image_batch, inputs=[Input.link("image1", "IMAGE"), Input.link("image2", "IMAGE")],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="RepeatImageBatch", display_name="RepeatImageBatch", category="image/batch",
        python_module="comfy_extras.nodes_images",
        description="The batch repeated `amount` times, one copy after the other.",
        execute=_repeat_image_batch,
        inputs=[Input.link("image", "IMAGE"), Input.int("amount", 1, min=1, max=4096, tooltip="How many copies.")],
        outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="ImageInvert", display_name="Invert Image", category="image", python_module="nodes",
        description="1 minus every channel value: a negative of the images.",
        execute=_image_invert, inputs=[Input.link("image", "IMAGE")], outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="MaskToImage", display_name="Convert Mask to Image", category="mask",
        python_module="comfy_extras.nodes_mask",
        description="The MASK as grey images: each of the three channels holds the mask's value.",
        execute=_mask_to_image, inputs=[Input.link("mask", "MASK")], outputs=[Output("IMAGE")],
    ),
    NodeSpec(
        node_id="SolidMask", display_name="SolidMask", category="mask", python_module="comfy_extras.nodes_mask",
        description="One MASK of the given size, the same value everywhere.",
        execute=_solid_mask,
        inputs=[Input.float("value", 1.0, min=0.0, max=1.0, step=0.01, tooltip="The value of every pixel."),
                Input.int("width", 512, min=1, max=MAX_RESOLUTION, step=1),
                Input.int("height", 512, min=1, max=MAX_RESOLUTION, step=1)],
        outputs=[Output("MASK")],
    ),
]
