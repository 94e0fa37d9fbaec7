"""Conditioning nodes: a text prompt turned into CONDITIONING by the encoder on the CLIP wire.

CONDITIONING is a list holding one `[hidden (B, L, D), extras]` pair (see models/h3/__init__.py): the
extras carry the `attention_mask` (and, from the Qwen3-VL encoder, the `token_tags`), and the H3 nodes add
`keyframes` and `references` to them.
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
        description="Runs the text encoder over a prompt. The result steers sampling toward what the prompt "
                    "describes (on the positive input) or away from it (on the negative one). `embedding:name` "
                    "in the text inserts a textual-inversion file from models/embeddings.",
        execute=_clip_text_encode,
        inputs=[
            Input.string("text", multiline=True, dynamic_prompts=True, tooltip="The prompt."),
            Input.link("clip", "CLIP", tooltip="Text encoder from Load CLIP."),
        ],
        outputs=[Output("CONDITIONING", tooltip="The encoded prompt, ready for a guider or sampler.")],
        search_aliases=("text prompt", "positive prompt", "negative prompt", "encode text"),
    ),
]
