"""Quantized H3 files load with their layers kept quantized, and compute what their dequantized weights compute.

The tiny transformer's released layers (qkv, out, fc1, fc2 of every block) are quantized by the
writer; the loaded model's forward is compared with the same model holding the dequantized float
weights. Tolerances:
  reference path (dequantize, then a float product; nvfp4, mxfp8, float8 on CPU,
  full_precision_matrix_mult): the same arithmetic as the float model, 1e-5 of the output's largest
  value (measured: equal).
  int8 path (activations quantized per token to int8, about 1/254 of each token's largest value
  per element): 5e-3 of the output's largest value (measured through the two tiny blocks: 1.7e-3
  without rotation, 8e-4 with it).
"""
import dataclasses
import functools

import pytest
import torch
from safetensors.torch import save_file

from kernels.quantized_linear import QUANTIZED_LINEAR
from models import memory
from models.h3 import transformer
from models.h3.make_tiny import build_tiny
from models.loading import load_model
from models.ops import QuantizedEmbedding, QuantizedLinear
from models.quant.writer import RELEASED_INT8_LAYERS, quantize_state_dict, save_quantized

LAYERS = RELEASED_INT8_LAYERS["h3_transformer"]
CASES = {  # name: (format, rotation group, marker form, tolerance)
    "int8_convrot": ("int8_tensorwise", 256, "tensor", 5e-3),
    "int8": ("int8_tensorwise", 0, "header", 5e-3),
    "nvfp4": ("nvfp4", 0, "tensor", 1e-5),
    "float8_e4m3fn": ("float8_e4m3fn", 0, "tensor", 1e-5),
    "float8_e5m2": ("float8_e5m2", 0, "header", 1e-5),
    "float8_legacy": ("float8_e4m3fn", 0, "legacy", 1e-5),
    "mxfp8": ("mxfp8", 0, "tensor", 1e-5),
}


@functools.lru_cache(maxsize=None)
def _float_state():
    return {k: v.contiguous() for k, v in build_tiny("transformer").state_dict().items()}


def _write(tmp_path, case, **options):
    fmt, group, form, _tol = CASES[case]
    state, metadata = quantize_state_dict(dict(_float_state()), LAYERS, fmt, rotation_group=group, marker_form=form,
                                          **options)
    path = tmp_path / f"{case}.safetensors"
    save_quantized(path, state, metadata)
    return path


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(1, 24, 2, 4, 4, generator=gen), torch.randn(1, 32, 2, 5, generator=gen),
            torch.randn(1, 3, transformer.TINY_CONFIG.text_dim, generator=gen), 0.7, 0.6)


def _dequantized_twin(model):
    """The float H3Transformer holding the loaded model's weights, quantized layers dequantized."""
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            state[f"{name}.weight"] = module.dequantized_weight(torch.float32)
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
    for key, value in model.state_dict().items():
        layer = key.rpartition(".")[0]
        if not isinstance(model.get_submodule(layer) if layer else model, QuantizedLinear):
            state[key] = value
    twin = transformer.H3Transformer(model.config)
    twin.load_state_dict(state)
    return twin.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_forward_matches_its_dequantized_float_forward(tmp_path, case):
    loaded = load_model(_write(tmp_path, case))
    model = loaded.model
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(transformer.TINY_CONFIG)
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert quantized == {f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    layer = model.blocks[0].mlp.fc1
    assert layer.weight.dtype == {"int8_tensorwise": torch.int8, "nvfp4": torch.uint8, "float8_e5m2": torch.float8_e5m2}.get(
        CASES[case][0], torch.float8_e4m3fn)
    with torch.no_grad():
        ours = model(*_inputs())
        backend = QUANTIZED_LINEAR.last_backend
        reference = _dequantized_twin(model)(*_inputs())
    # On the CPU every format decodes into a float32 buffer (kernels/quantized_linear.py).
    assert backend == "dequantized"
    tolerance = CASES[case][3]
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance * b.abs().max().item())


def test_dequantized_weights_are_close_to_the_float_originals(tmp_path):
    model = load_model(_write(tmp_path, "int8_convrot")).model
    original = _float_state()["blocks.1.mlp.fc1.weight"]
    restored = model.blocks[1].mlp.fc1.dequantized_weight()
    assert model.blocks[1].mlp.fc1.quant.rotation_group == 64  # 256 falls back to 64 for 64 input features
    assert (restored - original).abs().max() < original.abs().max() / 100


def test_full_precision_marker_forces_the_reference_path(tmp_path):
    model = load_model(_write(tmp_path, "int8_convrot", full_precision=True)).model
    with torch.no_grad():
        model(*_inputs())
    assert QUANTIZED_LINEAR.last_backend == "eager"


def test_int8_backend_agrees_with_the_reference_backend():
    from kernels.linear import linear
    from kernels.quantized import QuantizedWeight, WeightFormat
    from models.quant.writer import encode_int8
    gen = torch.Generator().manual_seed(5)
    for group in (0, 16, 64):
        w = torch.randn(96, 128, generator=gen) * 0.05
        x = torch.randn(2, 7, 256, generator=gen)
        stored = encode_int8(w, group)
        weight = QuantizedWeight(WeightFormat.INT8, stored["weight"], stored["weight_scale"], torch.Size((96, 128)),
                                 rotation_group=group)
        residual = torch.randn(2, 7, 96, generator=gen)
        options = dict(prologue="swiglu", residual=residual, residual_scale=0.5)
        chosen = linear(x, weight, torch.full((96,), 0.1), **options)
        assert QUANTIZED_LINEAR.last_backend == "dequantized"  # the CPU's choice
        fast = QUANTIZED_LINEAR(x, weight, torch.full((96,), 0.1), backend="int8", **options)
        reference = QUANTIZED_LINEAR(x, weight, torch.full((96,), 0.1), backend="eager", **options)
        dense = linear(x, weight.dequantize(), torch.full((96,), 0.1), **options)
        torch.testing.assert_close(reference, dense, rtol=1e-6, atol=1e-6)
        # The decoded weight in float32: float32 rounding only (the rotation's summation order).
        torch.testing.assert_close(chosen, reference, rtol=0, atol=1e-5 * reference.abs().max().item())
        # Per-token int8 activations: about 1/127 of the token's largest value per product term.
        assert (fast - reference).abs().max() < 2e-2 * reference.abs().max()


def test_memory_manager_holds_the_quantized_bytes(tmp_path):
    model = load_model(_write(tmp_path, "int8_convrot")).model
    layer = model.blocks[0].mlp.fc1
    stored_bytes = sum(t.numel() * t.element_size() for t in (layer.weight, layer.weight_scale))
    manager = memory.MemoryManager(device="cpu", dtype=torch.bfloat16, mode="highvram")
    memory.activate(manager)
    try:
        with torch.no_grad():
            layer(torch.randn(5, 64, dtype=torch.bfloat16))
            stats = manager.stats()
            assert stats.resident_bytes == stored_bytes
            taken = manager.take_named(layer, dtype=torch.bfloat16)
            assert taken["weight"].dtype == torch.int8 and taken["weight_scale"].dtype == torch.float32
            manager.release(layer)
            assert manager.stats().resident_bytes == stored_bytes  # one entry whatever dtype is asked
    finally:
        memory.unconfigure()


def test_a_file_with_an_unknown_format_is_refused_naming_layer_and_format(tmp_path):
    state, _ = quantize_state_dict(dict(_float_state()), LAYERS, "int8_tensorwise")
    state["blocks.1.mlp.fc2.comfy_quant"] = torch.tensor(list(b'{"format": "svdquant_w4a4"}'), dtype=torch.uint8)
    path = tmp_path / "unknown.safetensors"
    save_file(state, path)
    with pytest.raises(ValueError, match=r"unknown\.safetensors: layer 'blocks\.1\.mlp\.fc2' is quantized in format "
                                         r"'svdquant_w4a4', which Weft does not read; supported formats: int8_tensorwise"):
        load_model(path)


def test_stored_tensors_that_do_not_fit_the_layer_are_refused(tmp_path):
    state, _ = quantize_state_dict(dict(_float_state()), LAYERS, "int8_tensorwise")
    state["blocks.0.mlp.fc2.weight_scale"] = torch.ones(7, 1)
    path = tmp_path / "bad.safetensors"
    save_file(state, path)
    with pytest.raises(ValueError, match=r"'blocks\.0\.mlp\.fc2\.weight_scale' has shape \[7, 1\]"):
        load_model(path)
    state, _ = quantize_state_dict(dict(_float_state()), ["condition_proj"], "int8_tensorwise")
    state["patch.comfy_quant"] = state["condition_proj.comfy_quant"].clone()
    state["patch.weight"] = torch.zeros(2, 2, dtype=torch.int8)
    state["patch.weight_scale"] = torch.ones(2, 1)
    save_file(state, path)
    with pytest.raises(ValueError, match=r"quantization marker for 'patch', which this model does not have"):
        load_model(path)


def test_quantized_embedding_table_reads_only_the_looked_up_rows(tmp_path):
    state = {k: v.contiguous() for k, v in build_tiny("text_encoder").state_dict().items()}
    out, _ = quantize_state_dict(state, ["embed_tokens"], "int8_tensorwise")
    path = tmp_path / "te.safetensors"
    save_quantized(path, out)
    model = load_model(path).model
    table = model.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and table.weight.dtype == torch.int8
    ids = torch.tensor([[1, 5, 9]])
    expected = out["embed_tokens.weight"][ids].float() * out["embed_tokens.weight_scale"][ids]
    assert torch.equal(table(ids, dtype=torch.float32), expected)
    assert (expected - state["embed_tokens.weight"][ids]).abs().max() <= out["embed_tokens.weight_scale"].max() / 2 + 1e-7


def test_quantized_adaln_projection_of_the_non_pruned_form(tmp_path):
    # The non-pruned released DiT also quantizes blocks.N.adaln_proj.linear, with group 64 for its 2688 inputs;
    # the tiny one's 32 inputs take group 16.
    pattern = r"blocks\.\d+\.adaln_proj\.linear|" + LAYERS
    state, metadata = quantize_state_dict(dict(_float_state()), pattern, "int8_tensorwise", rotation_group=256)
    path = tmp_path / "non_pruned.safetensors"
    save_quantized(path, state, metadata)
    model = load_model(path).model
    layer = model.blocks[1].adaln_proj.linear
    assert isinstance(layer, QuantizedLinear) and layer.quant.rotation_group == 16 and layer.bias.dtype == torch.float32
    with torch.no_grad():
        ours = model(*_inputs())
        reference = _dequantized_twin(model)(*_inputs())
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-3 * b.abs().max().item())


def test_int8_convrot_video_vae_decoder_decodes_like_its_dequantized_twin(tmp_path, monkeypatch):
    # The released int8 video VAE quantizes only the decoder's transformer-block linears.
    from models import ops
    from models.h3 import video_vae
    state = {k: v.contiguous() for k, v in build_tiny("video_vae").state_dict().items()}
    out, metadata = quantize_state_dict(state, RELEASED_INT8_LAYERS["h3_video_vae"], "int8_tensorwise",
                                        rotation_group=256)
    path = tmp_path / "vae_int8.safetensors"
    save_quantized(path, out, metadata)
    vae = load_model(path).model
    quantized = [n for n, m in vae.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 4 * video_vae.TINY_CONFIG.decoder_layers
    twin = load_model(path).model
    for name in quantized:
        layer = twin.get_submodule(name)
        dense = torch.nn.Linear(layer.in_features, layer.out_features)
        dense.weight.data, dense.bias.data = layer.dequantized_weight(), layer.bias.data
        parent, _, child = name.rpartition(".")
        replacement = ops.Linear(layer.in_features, layer.out_features)
        replacement.load_state_dict(dense.state_dict())
        setattr(twin.get_submodule(parent), child, replacement)
    z = torch.randn(1, 24, 2, 2, 3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = twin.decode(z)
        ours = vae.decode(z)
        monkeypatch.setenv("WEFT_KERNEL_BACKEND", "quantized_linear:eager")
        dequantized = vae.decode(z)
    torch.testing.assert_close(dequantized, reference, rtol=0, atol=1e-5)
    # The int8 product through the decoder's blocks and the convolutions after them (pixels in [-1, 1]):
    # measured 1.1e-2 at most, 1.7e-3 on average.
    assert (ours - reference).abs().max() < 3e-2
    assert (ours - reference).abs().mean() < 5e-3


def test_a_running_int8_model_keeps_about_its_file_size_resident(tmp_path):
    # Every weight taken during a forward stays resident (highvram): their total is the file's tensor
    # bytes, give or take the float32 islands and buffers the model reads directly (RoPE, AdaLN table).
    from safetensors import safe_open
    path = _write(tmp_path, "int8_convrot")
    with safe_open(str(path), framework="pt") as f:
        tensor_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    model = load_model(path).model
    manager = memory.MemoryManager(device="cpu", dtype=torch.float32, mode="highvram")
    memory.activate(manager)
    try:
        with torch.no_grad():
            model(*_inputs())
    finally:
        memory.unconfigure()
    peak = manager.stats().peak_resident_bytes
    quantized_bytes = sum(m.weight.numel() + m.weight_scale.numel() * 4 for m in model.modules()
                          if isinstance(m, QuantizedLinear))
    # Measured: 0.999x. The int8 layers are 14% of the file: held as float32 they would add 43%.
    assert quantized_bytes < peak <= 1.1 * tensor_bytes
