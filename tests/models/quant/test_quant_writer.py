"""The writer: encodings equal comfy-kitchen's quantizers; markers in all three forms read back as written."""
import json

import comfy_kitchen as ck
import pytest
import torch
from comfy_kitchen.backends.eager import quantization as kitchen
from safetensors import safe_open

from kernels.quantized import WeightFormat
from models.quant.markers import LayerQuant, marker_bytes, parse_marker, read_plan
from models.quant.writer import (RELEASED_INT8_LAYERS, encode_float8, encode_int8, encode_mxfp8, encode_nvfp4,
                                 quantize_state_dict, rotation_group_for, save_quantized)


def _weight(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.05
    w[0, :32] = 0.0
    return w


@pytest.mark.parametrize("group", [0, 16, 64])
def test_int8_encoding_equals_kitchens(group):
    w = _weight((96, 128))
    with ck.use_backend("eager"):
        q, s = (kitchen.quantize_int8_convrot_weight(w, group) if group else kitchen.quantize_int8_rowwise(w))
    ours = encode_int8(w, group)
    assert torch.equal(ours["weight"], q) and torch.equal(ours["weight_scale"], s)


@pytest.mark.parametrize("shape", [(64, 64), (40, 48)])
def test_nvfp4_encoding_equals_kitchens(shape):
    w = _weight(shape)
    ours = encode_nvfp4(w)
    with ck.use_backend("eager"):
        q, blocks = ck.quantize_nvfp4(w, ours["weight_scale_2"], pad_16x=shape[0] % 16 != 0 or shape[1] % 16 != 0)
    assert torch.equal(ours["weight_scale_2"], (w.abs().amax() / (448 * 6)).float())
    assert torch.equal(ours["weight"], q)
    assert torch.equal(ours["weight_scale"].view(torch.uint8), blocks.view(torch.uint8))


def test_mxfp8_and_float8_encodings_equal_kitchens():
    w = _weight((64, 96))
    with ck.use_backend("eager"):
        q, blocks = ck.quantize_mxfp8(w)
        scale = w.abs().amax() / 448.0
        q8 = ck.quantize_per_tensor_fp8(w, scale, torch.float8_e4m3fn)
    ours = encode_mxfp8(w)
    assert torch.equal(ours["weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(ours["weight_scale"], blocks.view(torch.uint8))
    ours = encode_float8(w)
    assert torch.equal(ours["weight"].view(torch.uint8), q8.view(torch.uint8))
    assert torch.equal(ours["weight_scale"], scale)


def test_rotation_group_falls_back_to_a_power_of_4_dividing_the_width():
    assert rotation_group_for(5376, 256) == 256
    assert rotation_group_for(2688, 256) == 64
    assert rotation_group_for(96, 256) == 16
    assert rotation_group_for(64, 256) == 64
    assert rotation_group_for(6, 256) == 0


def test_released_marker_is_the_measured_72_bytes():
    marker = marker_bytes(LayerQuant(WeightFormat.INT8, 256).marker())
    assert marker.dtype == torch.uint8 and marker.shape == (72,)
    assert marker.numpy().tobytes() == b'{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}'
    assert marker_bytes(LayerQuant(WeightFormat.NVFP4, full_precision=True).marker()).shape == (55,)
    assert marker_bytes(LayerQuant(WeightFormat.INT8).marker()).shape == (29,)


def _state():
    gen = torch.Generator().manual_seed(3)
    return {"blocks.0.attn.qkv_proj.weight": torch.randn(48, 64, generator=gen),
            "blocks.0.mlp.fc2.weight": torch.randn(64, 32, generator=gen),
            "blocks.0.norm1.weight": torch.ones(64),
            "condition_proj.weight": torch.randn(64, 16, generator=gen),
            "condition_proj.bias": torch.zeros(64)}


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
        metadata = f.metadata() or {}
    return keys, tensors, metadata


@pytest.mark.parametrize("form", ["tensor", "header"])
def test_int8_convrot_file_round_trips_through_read_plan(tmp_path, form):
    prefix = "model.diffusion_model."
    state = {prefix + k: v for k, v in _state().items()}
    out, metadata = quantize_state_dict(state, RELEASED_INT8_LAYERS["h3_transformer"], "int8_tensorwise",
                                        rotation_group=256, marker_form=form, prefix=prefix)
    path = tmp_path / "q.safetensors"
    save_quantized(path, out, metadata)
    keys, tensors, metadata = _read(path)
    assert tensors[prefix + "blocks.0.attn.qkv_proj.weight"].dtype == torch.int8
    assert tensors[prefix + "blocks.0.attn.qkv_proj.weight_scale"].shape == (48, 1)
    assert tensors[prefix + "condition_proj.weight"].dtype == torch.float32
    plan = read_plan(keys, prefix, metadata, tensors.__getitem__, "q.safetensors")
    assert plan.layers == {"blocks.0.attn.qkv_proj": LayerQuant(WeightFormat.INT8, 64),
                           "blocks.0.mlp.fc2": LayerQuant(WeightFormat.INT8, 16)}
    assert plan.sources["blocks.0.mlp.fc2"] == {"weight": prefix + "blocks.0.mlp.fc2.weight",
                                                "weight_scale": prefix + "blocks.0.mlp.fc2.weight_scale"}
    if form == "header":
        assert not any(k.endswith(".comfy_quant") for k in keys)
        assert set(json.loads(metadata["_quantization_metadata"])["layers"]) == {
            prefix + "blocks.0.attn.qkv_proj", prefix + "blocks.0.mlp.fc2"}


def test_header_form_wins_over_marker_tensors(tmp_path):
    out, _ = quantize_state_dict(_state(), ["blocks.0.mlp.fc2"], "int8_tensorwise")
    header = {"_quantization_metadata": json.dumps(
        {"layers": {"blocks.0.mlp.fc2": {"format": "int8_tensorwise", "full_precision_matrix_mult": True}}})}
    plan = read_plan(list(out), "", header, out.__getitem__, "f")
    assert plan.layers["blocks.0.mlp.fc2"] == LayerQuant(WeightFormat.INT8, 0, True)


def test_legacy_scaled_fp8_form_is_read(tmp_path):
    out, _ = quantize_state_dict(_state(), ["blocks.0.mlp.fc2", "condition_proj"], "float8_e4m3fn",
                                 marker_form="legacy", full_precision=True)
    out["condition_proj.scale_input"] = torch.tensor(1.0)
    out["blocks.0.mlp.fc2.scale_input"] = torch.tensor(0.5)
    assert "scaled_fp8" in out and "blocks.0.mlp.fc2.scale_weight" in out
    plan = read_plan(list(out), "", {}, out.__getitem__, "f")
    assert plan.layers["condition_proj"] == LayerQuant(WeightFormat.FLOAT8_E4M3, 0, True)
    assert plan.sources["condition_proj"] == {"weight": "condition_proj.weight",
                                              "weight_scale": "condition_proj.scale_weight"}
    assert plan.sources["blocks.0.mlp.fc2"]["input_scale"] == "blocks.0.mlp.fc2.scale_input"
    assert "condition_proj.scale_input" in plan.marker_keys


@pytest.mark.parametrize("conf,message", [
    ({"format": "int4_awq"}, r"layer 'blocks\.3\.mlp\.fc1' is quantized in format 'int4_awq'.*supported formats: "
                             r"int8_tensorwise, float8_e4m3fn, float8_e5m2, nvfp4, mxfp8"),
    ({"fmt": "int8_tensorwise"}, r"layer 'blocks\.3\.mlp\.fc1' has a quantization marker without a \"format\""),
    ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 128}, r"convrot_groupsize 128"),
    ({"format": "nvfp4", "convrot": True}, r"only int8_tensorwise weights are rotated"),
])
def test_unknown_or_malformed_markers_are_refused_naming_layer_and_format(conf, message):
    with pytest.raises(ValueError, match=message):
        parse_marker("blocks.3.mlp.fc1", conf, "model.safetensors")


def test_params_fallback_of_the_marker():
    quant = parse_marker("x", {"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": 64}}, "f")
    assert quant == LayerQuant(WeightFormat.INT8, 64)


def test_a_marked_layer_without_its_scale_is_refused():
    out, _ = quantize_state_dict(_state(), ["blocks.0.mlp.fc2"], "nvfp4")
    del out["blocks.0.mlp.fc2.weight_scale_2"]
    with pytest.raises(ValueError, match=r"marked nvfp4 but the file lacks blocks\.0\.mlp\.fc2\.weight_scale_2"):
        read_plan(list(out), "", {}, out.__getitem__, "f")


def test_writer_refusals():
    with pytest.raises(ValueError, match="no layer of the state dict was selected"):
        quantize_state_dict(_state(), ["nothing"], "int8_tensorwise")
    with pytest.raises(ValueError, match="'int3'"):
        quantize_state_dict(_state(), ["blocks.0.mlp.fc2"], "int3")
    with pytest.raises(ValueError, match="legacy scaled_fp8 form exists for float8_e4m3fn only"):
        quantize_state_dict(_state(), ["blocks.0.mlp.fc2"], "nvfp4", marker_form="legacy")
