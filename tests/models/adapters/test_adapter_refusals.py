"""Every refusal names the file, the entry or module and, for shape problems, the expected and found shapes;
nothing is half-applied and the base model is untouched."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models.adapters import load_adapter
from models.patcher import ModelHandle
from tests.models.adapters.helpers import HIDDEN, INNER, assert_unchanged, rand, snapshot, tiny_h3, write_adapter


def refuse(tmp_path, tensors, *fragments, model=None, name="bad.safetensors"):
    """Write `tensors`, try to load and apply them, and check the ValueError holds every fragment."""
    model = tiny_h3() if model is None else model
    before = snapshot(model)
    file = write_adapter(tmp_path / name, tensors)
    with pytest.raises(ValueError) as caught:
        ModelHandle(model).with_adapter(load_adapter(file), 1.0)
    message = str(caught.value)
    for fragment in (str(file), *fragments):
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert_unchanged(model, before)
    return message


def lora(path, out_dim, in_dim, rank=2, seed=0):
    return {f"{path}.lora_up.weight": rand(out_dim, rank, seed=seed),
            f"{path}.lora_down.weight": rand(rank, in_dim, seed=seed + 1)}


def test_factors_that_do_not_fit_the_module(tmp_path):
    refuse(tmp_path, {**lora("blocks.0.attn.qkv_proj", 3 * INNER, HIDDEN - 1),
                      **lora("blocks.0.attn.out_proj", HIDDEN, INNER, seed=5)},
           "'blocks.0.attn.qkv_proj'", "(144, 32)", "(144, 31)", "does not fit", "nothing was applied")


def test_lokr_for_a_split_projection_whose_kronecker_shape_does_not_fit_its_row_block(tmp_path):
    # kron((4, 4), (16, 8)) is (64, 32), but the v block of qkv_proj is (48, 32): refused, not approximated.
    refuse(tmp_path, {"lycoris_transformer_blocks_0_attn_to_v.lokr_w1": rand(4, 4, seed=1),
                      "lycoris_transformer_blocks_0_attn_to_v.lokr_w2": rand(16, 8, seed=2)},
           "v row block (rows 96:144)", "'blocks.0.attn.qkv_proj'", "expected a weight delta of shape (48, 32)",
           "found (64, 32)", "lokr")


def test_an_entry_for_a_module_the_model_does_not_have(tmp_path):
    tensors = {**lora("lora_unet_blocks_0_attn_out_proj", HIDDEN, INNER),
               **lora("lora_unet_blocks_1_attn_out_proj", HIDDEN, INNER, seed=2),
               **lora("lora_unet_blocks_0_mlp_fc2", HIDDEN, 40, seed=4),
               **lora("lora_unet_blocks_7_attn_out_proj", HIDDEN, INNER, seed=6)}
    refuse(tmp_path, tensors, "1 of its 4 model entries", "modules the model does not have",
           "'lora_unet_blocks_7_attn_out_proj'")


def test_a_file_for_a_different_model_is_refused_whole(tmp_path):
    tensors = {**lora("lora_unet_down_blocks_0_attentions_0_proj_in", 320, 320),
               **lora("lora_unet_down_blocks_0_attentions_0_proj_out", 320, 320, seed=2),
               **lora("lora_unet_mid_block_attentions_0_proj_in", 1280, 1280, seed=4),
               **lora("lora_unet_blocks_0_attn_out_proj", HIDDEN, INNER, seed=6)}
    refuse(tmp_path, tensors, "this adapter is for a different model", "3 of its 4")


@pytest.mark.parametrize("how", ["int8 weight", "weight_scale"])
def test_packed_quantised_base_weights(tmp_path, how):
    model = tiny_h3()
    layer = model.blocks[0].attn.out_proj
    if how == "int8 weight":
        # 4-bit values packed two per byte: half the columns, int8 storage.
        layer.weight = nn.Parameter(torch.zeros(HIDDEN, INNER // 2, dtype=torch.int8), requires_grad=False)
    else:
        layer.register_buffer("weight_scale", torch.ones(HIDDEN, 1))
    stored = tuple(layer.weight.shape)
    refuse(tmp_path, lora("blocks.0.attn.out_proj", HIDDEN, INNER), "'blocks.0.attn.out_proj'", "packed-quantised",
           f"stored shape {stored}", f"({HIDDEN}, {INNER})", model=model)


def test_bias_delta_for_a_module_without_bias(tmp_path):
    refuse(tmp_path, {"blocks.0.attn.qkv_proj.diff_b": rand(3 * INNER, seed=1)}, "'blocks.0.attn.qkv_proj'",
           "has no bias")


def test_dora_magnitude_of_the_wrong_shape(tmp_path):
    refuse(tmp_path, {**lora("blocks.0.mlp.fc2", HIDDEN, 40), "blocks.0.mlp.fc2.dora_scale": rand(1, 7, seed=3)},
           "DoRA magnitude of shape (1, 7)", "'blocks.0.mlp.fc2'", "(32, 40)")


def test_unknown_tensor_kinds(tmp_path):
    refuse(tmp_path, {"lycoris_blocks_0_attn_out_proj.oft_blocks": rand(4, 8, 8, seed=1)},
           "not LoRA, LoKr, LoHa or full-delta factors", "oft_blocks")


def test_incomplete_or_mixed_entries(tmp_path):
    refuse(tmp_path, {"lora_unet_blocks_0_attn_out_proj.lora_up.weight": rand(HIDDEN, 2, seed=1)},
           "'lora_unet_blocks_0_attn_out_proj'", "without its down factor", name="half.safetensors")
    refuse(tmp_path, {"lycoris_blocks_0_attn_out_proj.lokr_w1": rand(4, 4, seed=1)},
           "needs lokr_w2", name="lokr_half.safetensors")
    refuse(tmp_path, {**lora("blocks.0.attn.out_proj", HIDDEN, INNER), "blocks.0.attn.out_proj.hada_w1_a": rand(2, 2, seed=9)},
           "mixes LoHa and LoRA", name="mixed.safetensors")
    refuse(tmp_path, {"lora_unet_blocks_0_attn_out_proj.lora_up.weight": rand(HIDDEN, 3, seed=1),
                      "lora_unet_blocks_0_attn_out_proj.lora_down.weight": rand(2, INNER, seed=2)},
           "disagree on the rank", "(32, 3)", "(2, 48)", name="rank.safetensors")


def test_only_safetensors_files_are_read(tmp_path):
    pickle_like = tmp_path / "style.pt"
    pickle_like.write_bytes(b"\x80\x04not opened")
    with pytest.raises(ValueError, match=r"only \.safetensors"):
        load_adapter(pickle_like)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="not a readable safetensors file") as caught:
        load_adapter(broken)
    assert str(broken) in str(caught.value)


def test_a_file_for_a_bigger_model_with_the_same_names_is_refused_whole(tmp_path):
    # The real H3's shapes (hidden 5376) on our names: every entry names a module we have, none fits.
    tensors = {**lora("diffusion_model.blocks.0.attn.out_proj", 5376, 7168),
               **lora("diffusion_model.blocks.1.attn.out_proj", 5376, 7168, seed=2)}
    refuse(tmp_path, tensors, "this adapter is for a different model: 2 of its 2 model entries do not fit",
           "'blocks.1.attn.out_proj'", "(5376, 7168)", f"({HIDDEN}, {INNER})")
