"""The patcher: stacking, on-the-fly vs merged, the base never changing, and the memory manager's take path."""
from __future__ import annotations

import pytest
import torch

from models import memory
from models.adapters import load_adapter
from models.patcher import ModelHandle, apply_patches, patch_signature, patches_active
from tests.models.adapters.helpers import (HIDDEN, INNER, assert_unchanged, rand, snapshot, tiny_h3, tiny_inputs,
                                           write_adapter)


@pytest.fixture
def two_adapters(tmp_path):
    """A kohya LoRA on out_proj + fc1 and a LyCORIS LoKr on out_proj (both touch blocks.0.attn.out_proj)."""
    up, down = rand(HIDDEN, 3, seed=1), rand(3, INNER, seed=2)
    fc_up, fc_down = rand(80, 3, seed=3), rand(3, HIDDEN, seed=4)
    w1, w2 = rand(4, 4, seed=5), rand(HIDDEN // 4, INNER // 4, seed=6)
    lora = write_adapter(tmp_path / "lora.safetensors", {
        "lora_unet_blocks_0_attn_out_proj.lora_up.weight": up, "lora_unet_blocks_0_attn_out_proj.lora_down.weight": down,
        "lora_unet_blocks_0_attn_out_proj.alpha": torch.tensor(1.5),
        "lora_unet_blocks_1_mlp_fc1.lora_up.weight": fc_up, "lora_unet_blocks_1_mlp_fc1.lora_down.weight": fc_down,
        "lora_unet_blocks_1_mlp_fc1.alpha": torch.tensor(1.5)})
    lokr = write_adapter(tmp_path / "lokr.safetensors", {
        "lycoris_blocks_0_attn_out_proj.lokr_w1": w1, "lycoris_blocks_0_attn_out_proj.lokr_w2": w2})
    deltas = {"lora_out": 0.5 * up @ down, "lora_fc1": 0.5 * fc_up @ fc_down, "lokr_out": torch.kron(w1, w2)}
    return load_adapter(lora), load_adapter(lokr), deltas


def test_stacking_two_adapters(two_adapters):
    lora, lokr, deltas = two_adapters
    model = tiny_h3()
    before = snapshot(model)
    handle = ModelHandle(model, name="tiny").with_adapter(lora, 0.8).with_adapter(lokr, -0.3)
    assert [s for _, s in handle.adapters] == [0.8, -0.3]
    merged = handle.merged().model
    torch.testing.assert_close(merged.blocks[0].attn.out_proj.weight,
                               model.blocks[0].attn.out_proj.weight + 0.8 * deltas["lora_out"] - 0.3 * deltas["lokr_out"])
    torch.testing.assert_close(merged.blocks[1].mlp.fc1.weight, model.blocks[1].mlp.fc1.weight + 0.8 * deltas["lora_fc1"])
    inputs = tiny_inputs()
    for a, b in zip(handle(*inputs), handle.merged()(*inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Stacking on a merged handle keeps its merged copies and runs the new adapter on the fly on them;
    # merging that handle starts again from the shared base with all three adapters.
    again = handle.merged().with_adapter(lora, 0.2)
    assert again.base is model and [s for _, s in again.adapters] == [0.8, -0.3, 0.2]
    assert again.model is handle.merged().model and again.merged_count == 2
    (fc1_entries,) = [params["weight"] for key, params in again.patch_map.items()
                      if key == id(handle.merged().model.blocks[1].mlp.fc1)]
    assert [strength for _patch, strength in fc1_entries] == [0.2]
    for a, b in zip(again(*inputs), again.merged()(*inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again.merged().model.blocks[1].mlp.fc1.weight,
                               model.blocks[1].mlp.fc1.weight + 1.0 * deltas["lora_fc1"])
    assert_unchanged(model, before)


def test_handles_share_the_base_and_leave_it_alone(two_adapters):
    lora, _lokr, _ = two_adapters
    model = tiny_h3()
    base = ModelHandle(model)
    patched = base.with_adapter(lora, 1.0)
    assert patched is not base and patched.model is model and patched.base is model
    assert base.with_adapter(lora, 0.0) is base  # strength 0 changes nothing
    assert patched.merged() is patched.merged()  # merged once, then reused
    assert patched.merged().merged() is patched.merged()
    assert patched.merge_bytes() == (HIDDEN * INNER + 80 * HIDDEN) * 4
    assert patched.prepared(max_merge_bytes=patched.merge_bytes() - 1) is patched  # does not fit: on the fly
    assert patched.prepared(max_merge_bytes=patched.merge_bytes()) is patched.merged()
    assert base.merged() is base


@pytest.mark.parametrize("mode", [None, "normal", "novram"])
def test_two_workflows_with_and_without_the_adapter_in_either_order(two_adapters, mode):
    """Through the memory manager (resident copies cached per patch set) or without one: base, patched,
    base, patched all give their own results."""
    lora, lokr, _ = two_adapters
    model = tiny_h3()
    before = snapshot(model)
    inputs = tiny_inputs()
    reference_base = model(*inputs)
    patched = ModelHandle(model).with_adapter(lora, 1.0).with_adapter(lokr, 0.5)
    reference_patched = patched.merged()(*inputs)
    if mode is not None:
        memory.configure(mode=mode, device="cpu", dtype=torch.float32)
    try:
        for _ in range(2):
            for a, b in zip(ModelHandle(model)(*inputs), reference_base):
                assert torch.equal(a, b)
            for a, b in zip(patched(*inputs), reference_patched):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(patched(*inputs)[0], reference_base[0])
    finally:
        memory.unconfigure()
    assert_unchanged(model, before)


def test_apply_patches_is_the_identity_outside_an_active_handle(two_adapters):
    lora, _lokr, deltas = two_adapters
    model = tiny_h3()
    layer = model.blocks[0].attn.out_proj
    handle = ModelHandle(model).with_adapter(lora, 2.0)
    assert apply_patches(layer, "weight", layer.weight) is layer.weight
    assert patch_signature(layer, "weight") == ()
    with handle.active() as module:
        assert module is model
        patched = apply_patches(layer, "weight", layer.weight)
        assert patch_signature(layer, "weight") != ()
        assert apply_patches(layer, "bias", torch.ones(3)).tolist() == [1.0, 1.0, 1.0]  # no bias patch
    torch.testing.assert_close(patched, layer.weight + 2.0 * deltas["lora_out"])
    # A merged handle activates an empty patch map: an outer handle's patches do not leak into it.
    with handle.active(), handle.merged().active():
        assert apply_patches(layer, "weight", layer.weight) is layer.weight


def test_a_callable_patch_in_a_hand_made_patch_map():
    layer = torch.nn.Linear(3, 2)
    delta = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with patches_active({id(layer): {"weight": [(lambda shape, dtype, device: delta, 0.5)]}}):
        got = apply_patches(layer, "weight", layer.weight)
    torch.testing.assert_close(got, layer.weight + 0.5 * delta)


def test_a_merged_handle_made_under_inference_mode_runs_outside_it(two_adapters):
    lora, _lokr, _ = two_adapters
    model = tiny_h3()
    handle = ModelHandle(model).with_adapter(lora, 1.0)
    with torch.inference_mode():
        inside = handle.merged()(*tiny_inputs())
    outside = handle.merged()(*tiny_inputs())  # the cached merged copies hold normal tensors
    torch.testing.assert_close(inside[0], outside[0])


def test_options_travel_to_derived_handles(two_adapters):
    lora, lokr, _ = two_adapters
    model = tiny_h3()
    handle = ModelHandle(model, name="tiny", options={"h3_shifts": (12.0, 3.0)}).with_adapter(lora, 1.0)
    merged_before = handle.merged()
    shifted = handle.with_options(h3_shifts=(5.0, 2.0))
    assert handle.options == {"h3_shifts": (12.0, 3.0)}  # the original is not changed
    assert shifted.options == {"h3_shifts": (5.0, 2.0)} and shifted.adapters == handle.adapters
    assert shifted.merged().model is merged_before.model  # merged copies are shared, not remade
    assert shifted.merged().options == {"h3_shifts": (5.0, 2.0)}
    assert shifted.with_adapter(lokr, 1.0).options == {"h3_shifts": (5.0, 2.0)}


def test_apply_patches_in_place_only_on_a_tensor_the_caller_owns(two_adapters):
    lora, _lokr, deltas = two_adapters
    model = tiny_h3()
    layer = model.blocks[0].attn.out_proj
    with ModelHandle(model).with_adapter(lora, 1.0).active():
        owned = layer.weight.detach().clone()
        result = apply_patches(layer, "weight", owned, inplace=True)
        assert result.data_ptr() == owned.data_ptr()  # float32 and owned: no second copy
        torch.testing.assert_close(owned, layer.weight + deltas["lora_out"])
        kept = layer.weight.detach().clone()
        copied = apply_patches(layer, "weight", kept)
        assert copied.data_ptr() != kept.data_ptr() and torch.equal(kept, layer.weight)
