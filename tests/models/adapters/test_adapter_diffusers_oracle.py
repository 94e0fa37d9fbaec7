"""Weft and diffusers' own MiniMax-H3 LoRA loading agree, file by file, on the key layouts seen in the wild.

The oracle is diffusers' `MiniMaxH3LoraLoaderMixin.lora_state_dict` (its converter: prefixes, kohya's
flattened names, alpha folding, fused qkv split into to_q / to_k / to_v, the SwiGLU half swap, the
DiffSynth head de-interleave, the metadata alpha), merged here into diffusers' transformer as PEFT merges a
LoRA (W + alpha / r * B @ A, alpha = r when the file gives none), then run by diffusers' own forward. Weft
loads the same file onto its own model; both must give the same velocities.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from models.adapters import load_adapter
from models.h3 import transformer
from models.h3.make_tiny import build_tiny
from models.patcher import ModelHandle
from tests.models.adapters.helpers import rand, write_adapter

pytest.importorskip("diffusers", minversion="0.42.1")
from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin  # noqa: E402

from tests.models.h3.test_h3_diffusers_parity import diffusers_forward, inputs, to_diffusers  # noqa: E402

# Modules of the original checkpoint the files adapt (fused qkv, SwiGLU fc1, AdaLN, heads, refiner, embedders).
MODULES = ["blocks.0.attn.qkv_proj", "blocks.1.mlp.fc1", "blocks.1.mlp.fc2", "blocks.0.adaln_proj.linear",
           "final_layer.adaln_proj.linear", "final_layer.video_out", "token_refiner.blocks.0.attn.qkv_proj",
           "time_embedder.proj_out", "condition_proj"]


def _factors(model, rank=4):
    found = {}
    for seed, name in enumerate(MODULES):
        layer = model.get_submodule(name)
        found[name] = (rand(rank, layer.in_features, seed=2 * seed) * 0.15,
                       rand(layer.out_features, rank, seed=2 * seed + 1) * 0.15)
    return found


def _native(prefix, down, up, alpha=None, underscored=False):
    def write(model):
        tensors = {}
        for name, (a, b) in _factors(model).items():
            base = prefix + (name.replace(".", "_") if underscored else name)
            tensors[base + down], tensors[base + up] = a, b
            if alpha is not None:
                tensors[base + ".alpha"] = torch.tensor(alpha)
        return tensors
    return write


def _diffusers_layout(model):
    """diffusers' own names: to_q / to_k / to_v with one shared down, ff.net.0.proj, norm_out, proj_out, ..."""
    names = {"blocks.1.mlp.fc1": "transformer_blocks.1.ff.net.0.proj", "blocks.1.mlp.fc2": "transformer_blocks.1.ff.net.2",
             "blocks.0.adaln_proj.linear": "transformer_blocks.0.adaln_proj.linear",
             "final_layer.adaln_proj.linear": "norm_out.linear", "final_layer.video_out": "proj_out",
             "time_embedder.proj_out": "time_embedder.linear_2", "condition_proj": "context_embedder"}
    tensors = {}
    for name, (a, b) in _factors(model).items():
        if name.endswith("attn.qkv_proj"):
            stem = "transformer_blocks.0" if name.startswith("blocks") else "token_refiner.refiner_blocks.0"
            for i, part in enumerate(("to_q", "to_k", "to_v")):
                rows = b.shape[0] // 3
                tensors[f"transformer.{stem}.attn.{part}.lora_A.weight"] = rand(*a.shape, seed=90 + i) * 0.15
                tensors[f"transformer.{stem}.attn.{part}.lora_B.weight"] = b[i * rows:(i + 1) * rows].contiguous()
            continue
        tensors[f"transformer.{names[name]}.lora_A.weight"] = a
        tensors[f"transformer.{names[name]}.lora_B.weight"] = b
    return tensors


# layout -> (tensors from the model, file metadata)
LAYOUTS = {
    "ai_toolkit_diffusion_model": (_native("diffusion_model.", ".lora_A.weight", ".lora_B.weight", alpha=2.0), None),
    "bare_alpha_less": (_native("", ".lora_A.weight", ".lora_B.weight"), None),
    "bare_metadata_alpha": (_native("", ".lora_A.weight", ".lora_B.weight"), {"alpha": "8"}),
    "kohya_musubi": (_native("lora_unet_", ".lora_down.weight", ".lora_up.weight", alpha=3.0, underscored=True), None),
    "diffsynth_peft_default": (_native("", ".lora_A.default.weight", ".lora_B.default.weight"), None),
    "diffusers_split_qkv": (_diffusers_layout, None),
}


def _merged_by_diffusers(model, path):
    """diffusers' transformer for `model` with the file merged as diffusers reads it."""
    state, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(path), return_lora_metadata=True)
    reference = to_diffusers(model)
    alpha = None if not metadata else metadata.get("transformer.lora_alpha")
    with torch.no_grad():
        for key, down in state.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            up = state[key.replace(".lora_A.", ".lora_B.")]
            scale = 1.0 if alpha is None else float(alpha) / down.shape[0]
            layer = reference.get_submodule(module)
            layer.weight += scale * (up.double() @ down.double()).to(layer.weight.dtype)
    return reference


def _model_for(layout):
    """The tiny DiT; for DiffSynth's layout one with 128-wide heads, the only head size diffusers de-interleaves."""
    if not layout.startswith("diffsynth"):
        return build_tiny("transformer").float()
    model = transformer.H3Transformer(dataclasses.replace(transformer.TINY_CONFIG, num_heads=2, head_dim=128))
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model.eval()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_weft_and_diffusers_load_the_file_the_same_way(tmp_path, layout):
    model = _model_for(layout)
    make, metadata = LAYOUTS[layout]
    path = write_adapter(tmp_path / f"{layout}.safetensors", make(model), metadata=metadata)
    reference = _merged_by_diffusers(model, path)
    handle = ModelHandle(model).with_adapter(load_adapter(path), 1.0)
    video, audio, text = inputs(2)
    for sigmas in ((0.8, 0.55), (0.3, 0.2)):
        with torch.no_grad():
            v, a = handle(video[None], audio[None], text[None], *sigmas)
            plain_v, _ = model(video[None], audio[None], text[None], *sigmas)
        rv, ra = diffusers_forward(reference, video, audio, text, *sigmas)
        torch.testing.assert_close(v[0], rv, rtol=0, atol=2e-5)
        torch.testing.assert_close(a[0], ra, rtol=0, atol=2e-5)
        assert (v[0] - plain_v[0]).abs().max() > 1e-3  # the adapter changes the output
