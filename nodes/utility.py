"""Model-agnostic core utility nodes the official templates use around any model: strings, images by a
factor, masks from and into images.

Each keeps ComfyUI's node id, input names, combo values and outputs, so a template that uses it converts
and runs unchanged; the work is small and done here or in `media.image`.
"""
from __future__ import annotations

import re

import torch

from media.image import UPSCALE_METHODS, check_image, scale_batch, scale_images
from nodes.spec import Input, NodeSpec, Output

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
]
