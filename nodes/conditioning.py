"""Conditioning nodes: a text prompt turned into CONDITIONING by the encoder on the CLIP wire, and a
CONDITIONING with its encoding zeroed (the "no prompt" a negative input takes).

CONDITIONING is a list holding one `[hidden (B, L, D), extras]` pair (see models/h3/__init__.py): the
extras carry the `attention_mask` (and, from the Qwen3-VL encoder, the `token_tags`), and the H3 nodes add
`keyframes` and `references` to them.
"""
from __future__ import annotations

from typing import Any

import torch

from nodes.loaders import check_clip
from nodes.spec import Input, NodeSpec, Output


def _clip_text_encode(text: str, clip: Any) -> tuple[list]:
    return (check_clip("CLIPTextEncode", clip).encode(text, node="CLIPTextEncode"),)


def _conditioning_zero_out(conditioning: list) -> tuple[list]:
    if not isinstance(conditioning, list) or not all(isinstance(entry, (list, tuple)) and len(entry) == 2
                                                     and isinstance(entry[0], torch.Tensor) for entry in conditioning):
        raise TypeError(f"ConditioningZeroOut: input 'conditioning' must be a CONDITIONING, got "
                        f"{type(conditioning).__name__}")
    zeroed = []
    for hidden, extras in conditioning:
        extras = dict(extras)
        # The pooled vector some encoders add is part of the encoding too; masks and attached pictures stay.
        if isinstance(extras.get("pooled_output"), torch.Tensor):
            extras["pooled_output"] = torch.zeros_like(extras["pooled_output"])
        zeroed.append([torch.zeros_like(hidden), extras])
    return (zeroed,)


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
    NodeSpec(
        node_id="ConditioningZeroOut", display_name="ConditioningZeroOut", category="advanced/conditioning",
        python_module="nodes",
        description="The same CONDITIONING with its encoded text set to zeros: an empty prompt of the same shape, "
                    "often given as the negative. Masks, frames and references attached to it stay.",
        execute=_conditioning_zero_out,
        inputs=[Input.link("conditioning", "CONDITIONING")],
        outputs=[Output("CONDITIONING")],
    ),
]
