"""The tiny Qwen3-VL in the released encoder's format: nvfp4 linears (AWQ pre_quant_scale on o_proj and
down_proj), an int8 token table, a bfloat16 vision tower, no final norm. It loads with its layers kept
quantized and encodes as the float model of its dequantized weights does."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from models.h3.tiny_released import qwen3vl_bytes
from models.loading import load_model, read_header
from models.ops import QuantizedEmbedding, QuantizedLinear
from models.text.qwen3vl import (DEEPSTACK_METADATA, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, Qwen3VL,
                                 VisualInput)


def tiny_file(tmp_path):
    path = tmp_path / "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
    path.write_bytes(qwen3vl_bytes())
    return path


def test_tiny_file_stores_the_released_formats(tmp_path):
    header = read_header(str(tiny_file(tmp_path)))
    tensors = header.tensors
    assert tensors["model.embed_tokens.weight"].dtype == "I8"
    assert tensors["model.embed_tokens.weight_scale"].shape == (151936, 1)
    assert tensors["model.embed_tokens.comfy_quant"].shape == (29,)          # {"format": "int8_tensorwise"}
    q = "model.layers.0.self_attn.q_proj"
    assert (tensors[q + ".weight"].dtype, tensors[q + ".weight_scale"].dtype) == ("U8", "F8_E4M3")
    assert tensors[q + ".weight_scale_2"].shape == () and tensors[q + ".comfy_quant"].shape == (55,)
    for layer in ("self_attn.o_proj", "mlp.down_proj"):
        assert tensors[f"model.layers.0.{layer}.pre_quant_scale"].dtype == "BF16"
    assert "model.layers.0.self_attn.q_proj.pre_quant_scale" not in tensors
    assert "model.norm.weight" not in tensors and "lm_head.weight" not in tensors
    assert {tensors[k].dtype for k in tensors if k.startswith("visual.")} == {"BF16"}


def dequantized_state(model: Qwen3VL) -> dict[str, torch.Tensor]:
    """The float32 weights a quantized model computes with (pre_quant_scale folded into its columns)."""
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            weight = module.dequantized_weight(torch.float32)
            scale = getattr(module, "pre_quant_scale", None)
            state[name + ".weight"] = weight * scale.float() if scale is not None else weight
    for key, value in model.state_dict().items():
        layer = key.rpartition(".")[0]
        if not isinstance(model.get_submodule(layer), (QuantizedLinear, QuantizedEmbedding)):
            state[key] = value.float()
    return {k: v.contiguous() for k, v in state.items()}


def test_quantized_file_encodes_as_its_dequantized_weights(tmp_path):
    loaded = load_model(str(tiny_file(tmp_path)))
    model = loaded.model
    assert loaded.kind == "qwen3vl" and model.config.num_layers == 3
    layer = model.model.layers[0]
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and layer.self_attn.q_proj.quant.full_precision
    assert layer.mlp.down_proj.pre_quant_scale.dtype == torch.bfloat16
    assert model.visual.blocks[0].attn.qkv.weight.dtype == torch.bfloat16

    reference_path = tmp_path / "dequantized.safetensors"
    save_file(dequantized_state(model), str(reference_path),
              metadata={DEEPSTACK_METADATA: json.dumps(list(model.config.vision.deepstack_layers))})
    reference = load_model(str(reference_path)).model

    gen = torch.Generator().manual_seed(5)
    ids = [17, 900, 3] + [VISION_START_ID] + [IMAGE_PAD_ID] * 4 + [VISION_END_ID] + [44, 151643]
    visuals = [VisualInput(torch.randn(16, 1536, generator=gen), (1, 4, 4))]
    got, expected = model.encode(ids, visuals).hidden, reference.encode(ids, visuals).hidden
    assert got.dtype == torch.float32 and got.shape == (len(ids), 48)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
