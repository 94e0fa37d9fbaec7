"""The three official FastH3 templates (VSA sparse attention, the int8 dense backend) validate and run unchanged
on the tiny released-format files, the same way tests/test_templates.py runs the base model's templates.

Their FastH3 DiTs are tiny pruned int8-convrot files with `to_gate_compress` in every block. At tiny sizes the
sequence is far below the templates' min_tokens (12288), so the blocks attend densely with the int8 backend
the templates choose; a second run lowers min_tokens so VSA itself runs inside a template. A run changes
what tests/test_templates.py changes (which also runs each of them end to end with the other local templates).
"""
from __future__ import annotations

import pytest
import torch

from execution.convert import ui_to_api
from tests.test_templates import (  # noqa: F401 (fixtures)
    TEXT_ENCODER, add_inputs, configured_paths, env, fit_to_tiny, load_template, nodes_of, released_models,
)

# Template -> (the DiT it loads, the node that builds its latent)
FASTH3 = {
    "video_fastvideo_fasth3_t2v.json": ("fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors",
                                        "MiniMaxH3ImageToVideo"),
    "video_fastvideo_fasth3_i2v.json": ("fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors",
                                        "MiniMaxH3ImageToVideo"),
    "video_fasth3_ominiref_r2v.json": ("fasth3_omniref_8step_pruned_int8_convrot.safetensors",
                                       "MiniMaxH3ReferenceToVideo"),
}


def tiny_prompt(env, name: str) -> dict:
    prompt = ui_to_api(load_template(name), env.registry)
    add_inputs(env, prompt)
    changed = fit_to_tiny(prompt, turbo=False)               # the schedulers' 8 distilled steps -> 2 included
    assert all(key.endswith((".megapixels", ".value", ".steps")) for key in changed)
    return prompt


@pytest.mark.parametrize("name", list(FASTH3))
def test_fasth3_template_validates_unchanged(env, name):
    prompt = ui_to_api(load_template(name), env.registry)
    add_inputs(env, prompt)
    validated = env.validate(prompt)
    assert nodes_of(prompt, "SaveVideo")[0] in validated.outputs
    (sparse,) = nodes_of(prompt, "BlockSparseAttention")
    inputs = prompt[sparse]["inputs"]
    assert (inputs["selection"], inputs["selection.keep_percent"], inputs["min_tokens"]) == ("vsa", 10, 12288)
    (backend,) = nodes_of(prompt, "ModelAttentionBackend")
    assert prompt[backend]["inputs"]["attention"] == "comfy kitchen attention"
    assert {prompt[n]["inputs"]["unet_name"] for n in nodes_of(prompt, "UNETLoader")} == {FASTH3[name][0]}
    assert {prompt[n]["inputs"]["clip_name"] for n in nodes_of(prompt, "CLIPLoader")} == {TEXT_ENCODER}


def test_vsa_runs_inside_the_t2v_template_when_the_sequence_is_long_enough(env):
    name = "video_fastvideo_fasth3_t2v.json"
    frames = {}
    for min_tokens in (12288, 0):
        prompt = tiny_prompt(env, name)
        (sparse,) = nodes_of(prompt, "BlockSparseAttention")
        prompt[sparse]["inputs"]["min_tokens"] = min_tokens
        (decode,) = nodes_of(prompt, "VAEDecode")
        prompt["probe"] = {"class_type": "TestOutput", "inputs": {"value": [decode, 0]}}
        result = env.run(prompt)
        frames[min_tokens] = result.outputs["probe"]["values"][0]
    assert torch.isfinite(frames[0]).all()
    assert not torch.equal(frames[0], frames[12288])
