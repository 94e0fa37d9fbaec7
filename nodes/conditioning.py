"""Conditioning nodes: text prompts encoded by the text encoder on the CLIP wire.

CONDITIONING is a list with one `[hidden (B, L, D), extras]` entry (models/h3/__init__.py); extras hold
the `attention_mask` and, from the H3 nodes, `keyframes` and `references`.
"""
from __future__ import annotations

from typing import Any

from nodes.loaders import check_clip
from nodes.spec import Input, NodeSpec, Output


def _clip_text_encode(text: str, clip: Any) -> tuple[list]:
    return (check_clip("CLIPTextEncode", clip).encode(text, node="CLIPTextEncode"),)


NODES = [
    NodeSpec(
        node_id="CLIPTextEncode", display_name="CLIP Text Encode (Prompt)", category="conditioning",
        python_module="nodes",
        description="Encodes a text prompt using a CLIP model into an embedding that can be used to guide the "
                    "diffusion model towards generating specific images.",
        execute=_clip_text_encode,
        inputs=[
            Input.string("text", multiline=True, dynamic_prompts=True, tooltip="The text to be encoded."),
            Input.link("clip", "CLIP", tooltip="The CLIP model used for encoding the text."),
        ],
        outputs=[Output("CONDITIONING", tooltip="A conditioning containing the embedded text used to guide the "
                                                "diffusion model.")],
        search_aliases=("text prompt", "positive prompt", "negative prompt", "encode text"),
    ),
]
