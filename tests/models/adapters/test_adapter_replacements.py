"""FastH3-style adapter files: LoRA pairs with full-rank deltas (`diff`, `diff_b`) and weight replacements
(`set_weight`, `set_bias`), on the full tiny DiT and on the pruned FastH3 DiT stored int8 convrot.

A replacement takes the weight's place whatever the strength (as ComfyUI's `set` does) and, like every patch,
lands where it stands in the patch order; on a quantized layer it replaces the dequantized weight at take time.
"""
from __future__ import annotations

import pytest
import torch

from models.adapters import load_adapter
from models.h3.make_tiny import build_tiny
from models.h3.tiny_released import pruned_transformer_bytes
from models.loading import load_model
from models.patcher import ModelHandle, apply_patches
from tests.models.adapters.helpers import assert_unchanged, rand, snapshot, write_adapter
from tests.models.adapters.test_adapter_quantized import _float_twin, _inputs


def _fasth3_tensors(model, prefix="diffusion_model."):
    """A LoRA on qkv_proj, a diff on fc2, a diff_b on the video head, set_weight + set_bias on a modulation."""
    qkv, fc2 = model.blocks[0].attn.qkv_proj, model.blocks[1].mlp.fc2
    mod = model.blocks[1].adaln_proj.linear
    return {
        f"{prefix}blocks.0.attn.qkv_proj.lora_A.weight": rand(4, qkv.in_features, seed=1) * 0.2,
        f"{prefix}blocks.0.attn.qkv_proj.lora_B.weight": rand(qkv.out_features, 4, seed=2) * 0.2,
        f"{prefix}blocks.1.mlp.fc2.diff": rand(fc2.out_features, fc2.in_features, seed=3) * 0.02,
        f"{prefix}final_layer.video_out.diff_b": rand(model.final_layer.video_out.out_features, seed=4) * 0.1,
        f"{prefix}blocks.1.adaln_proj.linear.set_weight": rand(mod.out_features, mod.in_features, seed=5) * 0.05,
        f"{prefix}blocks.1.adaln_proj.linear.set_bias": rand(mod.out_features, seed=6) * 0.05,
    }


def test_deltas_and_replacements_on_the_full_float_model(tmp_path):
    model = build_tiny("transformer").float()
    before = snapshot(model)
    tensors = _fasth3_tensors(model)
    adapter = load_adapter(write_adapter(tmp_path / "fasth3.safetensors", tensors))
    merged = ModelHandle(model).with_adapter(adapter, 0.5).merged().model
    p = "diffusion_model."
    lora = tensors[f"{p}blocks.0.attn.qkv_proj.lora_B.weight"] @ tensors[f"{p}blocks.0.attn.qkv_proj.lora_A.weight"]
    torch.testing.assert_close(merged.blocks[0].attn.qkv_proj.weight, model.blocks[0].attn.qkv_proj.weight + 0.5 * lora)
    torch.testing.assert_close(merged.blocks[1].mlp.fc2.weight,
                               model.blocks[1].mlp.fc2.weight + 0.5 * tensors[f"{p}blocks.1.mlp.fc2.diff"])
    torch.testing.assert_close(merged.final_layer.video_out.bias,
                               model.final_layer.video_out.bias + 0.5 * tensors[f"{p}final_layer.video_out.diff_b"])
    # A replacement ignores the strength.
    torch.testing.assert_close(merged.blocks[1].adaln_proj.linear.weight,
                               tensors[f"{p}blocks.1.adaln_proj.linear.set_weight"])
    torch.testing.assert_close(merged.blocks[1].adaln_proj.linear.bias, tensors[f"{p}blocks.1.adaln_proj.linear.set_bias"])
    assert_unchanged(model, before)


def test_a_delta_stacked_after_a_replacement_adds_to_the_new_value(tmp_path):
    model = build_tiny("transformer").float()
    linear = model.blocks[0].attn.out_proj
    value = rand(*linear.weight.shape, seed=8)
    diff = rand(*linear.weight.shape, seed=9)
    first = load_adapter(write_adapter(tmp_path / "set.safetensors", {"blocks.0.attn.out_proj.set_weight": value}))
    second = load_adapter(write_adapter(tmp_path / "diff.safetensors", {"blocks.0.attn.out_proj.diff": diff}))
    after = ModelHandle(model).with_adapter(first, 1.0).with_adapter(second, 0.25).merged().model
    torch.testing.assert_close(after.blocks[0].attn.out_proj.weight, value + 0.25 * diff)
    before = ModelHandle(model).with_adapter(second, 0.25).with_adapter(first, 1.0).merged().model
    torch.testing.assert_close(before.blocks[0].attn.out_proj.weight, value)


@pytest.fixture(scope="module")
def fasth3_int8(tmp_path_factory):
    path = tmp_path_factory.mktemp("fasth3") / "fasth3_pruned_int8_convrot.safetensors"
    path.write_bytes(pruned_transformer_bytes(2003, gate_compress=True))
    return load_model(path, dtype=torch.float32).model  # float32 compute, so the float twin is its oracle


def test_on_the_pruned_fasth3_int8_model_the_patches_land_on_the_dequantized_weights(tmp_path, monkeypatch,
                                                                                     fasth3_int8):
    monkeypatch.setenv("WEFT_KERNEL_BACKEND", "quantized_linear:eager")
    model = fasth3_int8
    before = snapshot(model)
    tensors = _fasth3_tensors(model, prefix="")
    gate = model.blocks[0].attn.to_gate_compress
    tensors["blocks.0.attn.to_gate_compress.set_weight"] = rand(*gate.weight.shape, seed=11)
    tensors["blocks.1.attn.out_proj.set_weight"] = rand(*model.blocks[1].attn.out_proj.dense_weight_shape, seed=12) * 0.1
    adapter = load_adapter(write_adapter(tmp_path / "fasth3_int8.safetensors", tensors))
    handle = ModelHandle(model).with_adapter(adapter, 0.7)
    assert len(handle.applied[0].patches) == 7  # nothing refused
    with handle.active():
        out_proj = model.blocks[1].attn.out_proj
        taken = apply_patches(out_proj, "weight", out_proj.dequantized_weight())
        torch.testing.assert_close(taken, tensors["blocks.1.attn.out_proj.set_weight"])
    float_handle = ModelHandle(_float_twin(model)).with_adapter(adapter, 0.7)
    inputs = _inputs()
    with torch.no_grad():
        for a, b, c in zip(handle(*inputs), float_handle(*inputs), model(*inputs)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())
            assert (a - c).abs().max() > 1e-3
    assert_unchanged(model, before)


def test_a_replacement_of_the_wrong_shape_is_refused_by_name(tmp_path):
    model = build_tiny("transformer").float()
    file = write_adapter(tmp_path / "bad.safetensors", {
        "blocks.0.attn.out_proj.set_weight": torch.zeros(3, 3),
        "blocks.0.attn.qkv_proj.lora_A.weight": torch.zeros(2, 64), "blocks.0.attn.qkv_proj.lora_B.weight": torch.zeros(288, 2),
        "blocks.1.attn.qkv_proj.lora_A.weight": torch.zeros(2, 64), "blocks.1.attn.qkv_proj.lora_B.weight": torch.zeros(288, 2)})
    with pytest.raises(ValueError, match=r"'blocks.0.attn.out_proj' \(set\) does not fit|blocks.0.attn.out_proj.*set"):
        ModelHandle(model).with_adapter(load_adapter(file), 1.0)


def test_both_bias_kinds_in_one_entry_are_refused(tmp_path):
    file = write_adapter(tmp_path / "both.safetensors", {"final_layer.video_out.diff_b": torch.zeros(96),
                                                          "final_layer.video_out.set_bias": torch.zeros(96)})
    with pytest.raises(ValueError, match="both a bias delta"):
        load_adapter(file)
