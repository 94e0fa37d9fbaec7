"""LoRA, LoKr and LoHa on quantized bases: never refused, the delta added to the dequantized weight at take
time, the stored codes untouched; merging requantizes once within the format's rounding."""
from __future__ import annotations

import functools

import pytest
import torch

from models.adapters import load_adapter
from models.h3 import transformer
from models.h3.make_tiny import build_tiny
from models.loading import load_model
from models.ops import QuantizedLinear
from models.patcher import ModelHandle
from models.quant.writer import RELEASED_INT8_LAYERS, quantize_state_dict, save_quantized
from tests.models.adapters.helpers import assert_unchanged, rand, snapshot, write_adapter


@functools.lru_cache(maxsize=None)
def _float_state():
    return {k: v.contiguous() for k, v in build_tiny("transformer").state_dict().items()}


def _quantized_model(tmp_path, fmt, group=0):
    state, metadata = quantize_state_dict(dict(_float_state()), RELEASED_INT8_LAYERS["h3_transformer"], fmt,
                                          rotation_group=group)
    path = tmp_path / f"{fmt}.safetensors"
    save_quantized(path, state, metadata)
    return load_model(path).model


def _adapter_tensors():
    """A LoRA on blocks.0.attn.qkv_proj and mlp.fc2, a LoKr on blocks.1.mlp.fc1, a LoHa on blocks.1.attn.out_proj."""
    tensors = {}
    for seed, (name, out_f, in_f) in enumerate([("blocks_0_attn_qkv_proj", 288, 64), ("blocks_0_mlp_fc2", 64, 128)]):
        key = f"lora_unet_{name}"
        tensors.update({f"{key}.lora_up.weight": rand(out_f, 4, seed=seed) * 0.05,
                        f"{key}.lora_down.weight": rand(4, in_f, seed=seed + 10),
                        f"{key}.alpha": torch.tensor(2.0)})
    tensors.update({"lora_unet_blocks_1_mlp_fc1.lokr_w1": rand(16, 8, seed=20) * 0.1,
                    "lora_unet_blocks_1_mlp_fc1.lokr_w2": rand(16, 8, seed=21) * 0.1})
    tensors.update({f"lora_unet_blocks_1_attn_out_proj.hada_{part}": rand(*shape, seed=30 + i) * 0.2
                    for i, (part, shape) in enumerate([("w1_a", (64, 2)), ("w1_b", (2, 96)),
                                                       ("w2_a", (64, 2)), ("w2_b", (2, 96))])})
    tensors["lora_unet_blocks_1_attn_out_proj.alpha"] = torch.tensor(2.0)
    return tensors


def _float_twin(model):
    """The float H3Transformer holding `model`'s weights, its quantized layers dequantized."""
    twin = transformer.H3Transformer(model.config)
    state = {}
    for key, value in model.state_dict().items():
        layer, _, leaf = key.rpartition(".")
        module = model.get_submodule(layer)
        if isinstance(module, QuantizedLinear):
            if leaf in ("weight", "bias"):
                state[key] = module.dequantized_weight() if leaf == "weight" else value
        else:
            state[key] = value
    twin.load_state_dict(state)
    return twin.eval()


def _inputs():
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(1, 24, 2, 4, 4, generator=gen), torch.randn(1, 32, 2, 5, generator=gen),
            torch.randn(1, 3, transformer.TINY_CONFIG.text_dim, generator=gen), 0.5, 0.4)


@pytest.mark.parametrize("fmt,group", [("int8_tensorwise", 256), ("nvfp4", 0), ("float8_e4m3fn", 0)])
def test_adapters_on_a_quantized_base_equal_them_on_its_dequantized_weights(tmp_path, monkeypatch, fmt, group):
    # Unpatched int8 layers would take the int8 product; the reference path isolates the adapter's arithmetic.
    monkeypatch.setenv("WEFT_KERNEL_BACKEND", "quantized_linear:eager")
    model = _quantized_model(tmp_path, fmt, group)
    before = snapshot(model)
    adapter = load_adapter(write_adapter(tmp_path / "mixed.safetensors", _adapter_tensors()))
    handle = ModelHandle(model, name="quantized").with_adapter(adapter, 0.8)
    assert len(handle.applied[0].patches) == 4  # nothing refused
    float_handle = ModelHandle(_float_twin(model), name="float").with_adapter(adapter, 0.8)
    with torch.no_grad():
        patched = handle(*_inputs())
        expected = float_handle(*_inputs())
        plain = model(*_inputs())
    for a, b, c in zip(patched, expected, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())
        assert (a - c).abs().max() > 1e-3  # the adapter changed the output
    assert_unchanged(model, before)


@pytest.mark.parametrize("fmt,group", [("int8_tensorwise", 256), ("nvfp4", 0)])
def test_merging_into_a_quantized_base_requantizes_once_within_half_a_step(tmp_path, fmt, group):
    model = _quantized_model(tmp_path, fmt, group)
    before = snapshot(model)
    adapter = load_adapter(write_adapter(tmp_path / "mixed.safetensors", _adapter_tensors()))
    handle = ModelHandle(model, name="quantized").with_adapter(adapter, 0.8)
    merged = handle.merged().model
    for name in ("blocks.0.attn.qkv_proj", "blocks.1.mlp.fc1", "blocks.1.attn.out_proj"):
        layer = merged.get_submodule(name)
        assert isinstance(layer, QuantizedLinear) and layer.weight.dtype == model.get_submodule(name).weight.dtype
        exact = handle.patched_weight(name)
        error = layer.dequantized_weight() - exact
        if fmt == "int8_tensorwise":
            # Half a row step per element in the rotated basis; the rotation keeps each row's norm.
            bound = 0.5 * layer.weight_scale.reshape(-1) * layer.in_features ** 0.5
            assert (error.norm(dim=1) <= bound * (1 + 1e-4)).all()
        else:
            # E2M1 steps are at most 2 (between 4 and 6) times the block's scale: half a step is one scale.
            assert error.abs().max() <= exact.abs().max() / 6 * 1.01
    errors = handle.merge_errors()
    assert set(errors) == {"blocks.0.attn.qkv_proj", "blocks.0.mlp.fc2", "blocks.1.mlp.fc1", "blocks.1.attn.out_proj"}
    assert 0 < max(errors.values()) < (0.2 if fmt == "nvfp4" else 0.02)
    with torch.no_grad():
        on_the_fly = handle(*_inputs())
        merged_out = handle.merged()(*_inputs())
    for a, b in zip(merged_out, on_the_fly):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2 * b.abs().max().item())
    assert_unchanged(model, before)
