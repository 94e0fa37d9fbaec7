"""H3 models from GGUF files: written by the `gguf` package's own writer in the released conversions' layout,
read by Weft's reader with their layers kept in block form, computing what the float model computes.

Layout (as the released stable-diffusion.cpp-style conversions: original key names, no required
metadata): every 2-D `.weight` whose rows are whole blocks is stored in the block type, every other
tensor in float32 (norm weights of one case in bfloat16, a Conv3d weight with ComfyUI-GGUF's
`comfy.gguf.orig_shape`).

Stated errors against the float model (largest difference over the output's largest value): Q8_0
3e-2 for the DiT's velocities and the encoder's conditioning (measured 1.0e-2 / 1.1e-2 for video /
audio and 1.5e-2 for the conditioning), the Q4_0 / Q4_1 / Q5_0 / Q5_1 mix 2.5e-1 (measured 1.5e-1 /
8e-2: 4-bit codes through random tiny weights, which amplify more than trained ones). Against the
float model of its own dequantized weights the GGUF model is exact (the same arithmetic; 1e-5). The K
types, which the gguf package cannot write in numpy, load from random valid blocks on a DiT widened to
256 and are checked against that exact reference and the package's decoded weights; Q6_K and Q4_K are
also written from the float weights by Weft's own encoder and checked against the float model.
"""
import dataclasses
import functools
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # pinned in requirements-test.txt; never skipped there

from kernels.gguf_blocks import BLOCK_SIZES  # noqa: E402
from models import memory  # noqa: E402
from models.adapters import load_adapter  # noqa: E402
from models.h3 import transformer  # noqa: E402
from models.h3.tiny_released import PRUNED_TINY_CONFIG, build_pruned_transformer  # noqa: E402
from models.loading import load_model, load_state_dict, read_header  # noqa: E402
from models.ops import QuantizedEmbedding, QuantizedLinear  # noqa: E402
from models.quant.formats.gguf import K_WRITABLE_TYPES, encode_blocks  # noqa: E402
from models.patcher import ModelHandle  # noqa: E402
from tests.models.adapters.helpers import assert_unchanged, rand, snapshot, write_adapter  # noqa: E402

MIXED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")


def _type_for(key: str, value: torch.Tensor, block_type: str | tuple[str, ...], index: int) -> str:
    kind = block_type if isinstance(block_type, str) else block_type[index % len(block_type)]
    if key.endswith(".weight") and value.dim() == 2 and value.shape[1] % BLOCK_SIZES[kind][0] == 0:
        return kind
    return "F32"


def write_with_gguf_package(path, state, block_type, *, arch="wan", bf16_norms=False, strings=None, floats="F32"):
    """`state` as a GGUF file written by gguf.GGUFWriter (its float tensors in `floats`, F32 or F16); returns
    {key: ggml type name}."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, text in (strings or {}).items():
        writer.add_string(key, text)
    types = {}
    for index, (key, value) in enumerate(state.items()):
        value = value.detach().float().contiguous()
        kind = _type_for(key, value, block_type, index)
        if bf16_norms and kind == "F32" and key.endswith("norm.weight"):
            kind = "BF16"
        array = value.numpy()
        if value.dim() > 4:  # ggml keeps four dimensions; the true shape travels in the metadata
            writer.add_array(f"comfy.gguf.orig_shape.{key}", list(value.shape))
            array = array.reshape(-1, *value.shape[2:])
        if kind == "F32" and floats == "F16":
            writer.add_tensor(key, array.astype(np.float16))
            kind = "F16"
        elif kind == "F32":
            writer.add_tensor(key, array)
        elif kind in K_WRITABLE_TYPES:  # the gguf package quantizes no K type: Weft's own encoder
            writer.add_tensor(key, encode_blocks(kind, value).numpy(), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(key, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        types[key] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


@functools.lru_cache(maxsize=None)
def _dit_state():
    return {k: v.contiguous() for k, v in build_pruned_transformer(2001).state_dict().items()}


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(1, 24, 2, 4, 4, generator=gen), torch.randn(1, 32, 2, 5, generator=gen),
            torch.randn(1, 3, transformer.TINY_CONFIG.text_dim, generator=gen), 0.7, 0.6)


def _float_model(config, state, cls=transformer.H3Transformer):
    model = cls(config)
    model.load_state_dict(state)
    return model.eval()


def _dequantized_state(model):
    state = {}
    for key, value in model.state_dict().items():
        layer, _, leaf = key.rpartition(".")
        module = model.get_submodule(layer) if layer else model
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            if leaf == "weight":
                state[key] = module.dequantized_weight(torch.float32)
            elif leaf == "bias":
                state[key] = value
        else:
            state[key] = value
    return state


@pytest.mark.parametrize("block_type,tolerance", [("Q8_0", 3e-2), (MIXED, 2.5e-1)])
def test_gguf_dit_gives_the_float_dits_velocities(tmp_path, block_type, tolerance):
    path = tmp_path / "minimax_h3_fl2va_pruned-Q8_0.gguf"
    types = write_with_gguf_package(path, _dit_state(), block_type)
    loaded = load_model(str(path))
    model = loaded.model
    assert loaded.kind == "h3_transformer"
    for name in ("hidden_size", "num_layers", "num_heads", "text_dim", "adaln_curve_points"):
        assert getattr(loaded.config, name) == getattr(PRUNED_TINY_CONFIG, name)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(quantized) == {k[:-len(".weight")] for k, t in types.items() if t != "F32"}
    assert {m.stored_format.type_name for m in quantized.values()} == set(
        [block_type] if isinstance(block_type, str) else block_type)
    assert all(m.weight.dtype == torch.uint8 for m in quantized.values())
    with torch.no_grad():
        ours = model(*_inputs())
        same_weights = _float_model(model.config, _dequantized_state(model))(*_inputs())
        original = _float_model(model.config, _dit_state())(*_inputs())
    for a, b, c in zip(ours, same_weights, original):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())
        assert (a - c).abs().max() <= tolerance * c.abs().max()


def test_full_gguf_dit_with_its_time_embedder_reads_like_its_float_file(tmp_path):
    from models.h3.make_tiny import build_tiny
    state = {k: v.contiguous() for k, v in build_tiny("transformer").state_dict().items()}
    path = tmp_path / "full-Q8_0.gguf"
    write_with_gguf_package(path, state, "Q8_0")
    loaded = load_model(str(path))
    assert loaded.config.adaln_curve_points is None
    assert isinstance(loaded.model.blocks[0].mlp.fc1, QuantizedLinear)
    with torch.no_grad():
        ours = loaded.model(*_inputs())
        original = _float_model(loaded.config, state)(*_inputs())
    for a, c in zip(ours, original):
        assert (a - c).abs().max() <= 3e-2 * c.abs().max()
    decoded = load_state_dict(str(path))
    assert decoded["blocks.0.mlp.fc1.weight"].dtype == torch.float32
    assert decoded["blocks.0.mlp.fc1.weight"].shape == state["blocks.0.mlp.fc1.weight"].shape


def test_gguf_dit_under_the_comfyui_prefix_with_bfloat16_norms_reads_the_same(tmp_path):
    state = {"model.diffusion_model." + k: v for k, v in _dit_state().items()}
    path = tmp_path / "prefixed.gguf"
    types = write_with_gguf_package(path, state, "Q8_0", bf16_norms=True)
    assert "BF16" in types.values()
    header = read_header(str(path))
    key = "model.diffusion_model.blocks.0.mlp.fc1.weight"
    fc1 = _dit_state()["blocks.0.mlp.fc1.weight"]
    assert header.tensors[key].dtype == "U8" and header.tensors[key].shape == (fc1.shape[0], fc1.shape[1] // 32 * 34)
    norm = next(k for k, t in types.items() if t == "BF16")
    assert header.tensors[norm].dtype == "BF16"
    model = load_model(str(path)).model
    plain = tmp_path / "plain.gguf"
    write_with_gguf_package(plain, _dit_state(), "Q8_0")
    with torch.no_grad():
        for a, b in zip(model(*_inputs()), load_model(str(plain)).model(*_inputs())):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * b.abs().max().item())


def test_a_gguf_model_computes_in_the_compute_devices_dtype_not_its_float_tensors(tmp_path):
    # Its float tensors in float16 (a file's small tensors decide nothing): on the CPU it computes in float32.
    path = tmp_path / "f16_floats.gguf"
    types = write_with_gguf_package(path, _dit_state(), "Q8_0", floats="F16")
    assert set(types.values()) == {"Q8_0", "F16"}
    previous = memory.manager()
    try:
        memory.activate(memory.MemoryManager(device="cpu"))  # the CPU's dtype: float32
        on_cpu = load_model(str(path)).model
        # A runtime whose device computes in bfloat16 (a CUDA card that supports it), stood in for on the CPU.
        memory.activate(memory.MemoryManager(device="cpu", dtype=torch.bfloat16))
        on_bf16 = load_model(str(path)).model
        with torch.no_grad():
            reference, low = on_cpu(*_inputs()), on_bf16(*_inputs())
    finally:
        memory.activate(previous)
    assert on_cpu.compute_dtype == torch.float32 and on_bf16.compute_dtype == torch.bfloat16
    fc1 = on_bf16.blocks[0].mlp.fc1
    assert isinstance(fc1, QuantizedLinear) and fc1.compute_dtype == torch.bfloat16
    assert on_bf16.blocks[0].norm1.weight.dtype == torch.bfloat16 and on_cpu.blocks[0].norm1.weight.dtype == torch.float32
    # The float32 islands stay float32 (the patch projections' biases, the pruned model's AdaLN projections).
    assert on_bf16.video_patch_proj.bias.dtype == on_bf16.blocks[0].adaln_proj.linear.weight.dtype == torch.float32
    for a, b in zip(low, reference):
        assert a.dtype == torch.float32 and (a - b).abs().max() <= 5e-2 * b.abs().max()


def test_resident_bytes_of_a_gguf_model_stay_within_its_file_size(tmp_path):
    path = tmp_path / "dit.gguf"
    write_with_gguf_package(path, _dit_state(), "Q8_0")
    model = load_model(str(path)).model
    manager = memory.MemoryManager(device="cpu", dtype=torch.float32, mode="highvram")
    memory.activate(manager)
    try:
        with torch.no_grad():
            model(*_inputs())
        resident = manager.stats().resident_bytes
    finally:
        memory.unconfigure()
    size = os.path.getsize(path)
    assert 0.5 * size < resident <= 1.05 * size


def _wide_tiny_qwen3vl():
    """The tiny Qwen3-VL 64 wide instead of 48, so that every language-model row is whole Q8_0 blocks."""
    from models.h3.make_tiny import _init_weights
    from models.text.qwen3vl import TINY_CONFIG, Qwen3VL
    config = dataclasses.replace(TINY_CONFIG, hidden_size=64,
                                 vision=dataclasses.replace(TINY_CONFIG.vision, out_hidden_size=64))
    model = Qwen3VL(config)
    _init_weights(model, 77)
    return model.eval().requires_grad_(False)


def test_gguf_qwen3vl_gives_the_float_encoders_conditioning(tmp_path):
    from models.text.qwen3vl import DEEPSTACK_METADATA
    float_model = _wide_tiny_qwen3vl()
    state = {k: v.contiguous() for k, v in float_model.state_dict().items()}
    path = tmp_path / "qwen3vl_32b_minimax_h3-Q8_0.gguf"
    deepstack = "[" + ", ".join(map(str, float_model.config.vision.deepstack_layers)) + "]"
    write_with_gguf_package(path, state, "Q8_0", arch="qwen3vl", strings={DEEPSTACK_METADATA: deepstack})
    loaded = load_model(str(path))
    model = loaded.model
    assert loaded.kind == "qwen3vl"
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    ids = torch.tensor([[1, 5, 9, 14, 2, 7]])
    with torch.no_grad():
        ours = model.encode(ids).hidden
        original = float_model.encode(ids).hidden
    assert ours.shape == original.shape
    assert (ours - original).abs().max() <= 3e-2 * original.abs().max()


def test_lora_on_a_gguf_base_equals_it_on_the_dequantized_weights(tmp_path, monkeypatch):
    path = tmp_path / "dit.gguf"
    write_with_gguf_package(path, _dit_state(), MIXED)
    model = load_model(str(path)).model
    before = snapshot(model)
    fc1 = model.blocks[0].mlp.fc1
    tensors = {"lora_unet_blocks_0_mlp_fc1.lora_up.weight": rand(fc1.out_features, 4, seed=1) * 0.05,
               "lora_unet_blocks_0_mlp_fc1.lora_down.weight": rand(4, fc1.in_features, seed=2),
               "lora_unet_blocks_0_mlp_fc1.alpha": torch.tensor(2.0),
               "lora_unet_blocks_1_attn_out_proj.lokr_w1": rand(8, 8, seed=3) * 0.1,
               "lora_unet_blocks_1_attn_out_proj.lokr_w2": rand(
                   model.blocks[1].attn.out_proj.out_features // 8, model.blocks[1].attn.out_proj.in_features // 8,
                   seed=4) * 0.1}
    adapter = load_adapter(write_adapter(tmp_path / "lora.safetensors", tensors))
    handle = ModelHandle(model, name="gguf").with_adapter(adapter, 0.8)
    assert len(handle.applied[0].patches) == 2
    float_handle = ModelHandle(_float_model(model.config, _dequantized_state(model)), name="float").with_adapter(
        adapter, 0.8)
    with torch.no_grad():
        patched, expected, plain = handle(*_inputs()), float_handle(*_inputs()), model(*_inputs())
    for a, b, c in zip(patched, expected, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())
        assert (a - c).abs().max() > 1e-4 * c.abs().max()
    assert_unchanged(model, before)


def test_weft_writer_and_the_gguf_reader_agree(tmp_path):
    from models.gguf import read_gguf, write_gguf
    gen = torch.Generator().manual_seed(9)
    values = {"a.weight": ("Q8_0", torch.randn(4, 64, generator=gen)), "b.weight": ("Q5_1", torch.randn(3, 32, generator=gen)),
              "c": ("F16", torch.randn(5, generator=gen)), "d": ("BF16", torch.randn(2, 3, generator=gen)),
              "e": ("F32", torch.randn(2, 2, 2, generator=gen))}
    path = tmp_path / "weft.gguf"
    write_gguf(path, values, {"general.architecture": "minimax_h3", "count": 3})
    theirs = gguf.GGUFReader(str(path))
    assert str(theirs.get_field("general.architecture").parts[-1], "utf-8") == "minimax_h3"
    ours = read_gguf(path)
    for tensor in theirs.tensors:
        type_name, original = values[tensor.name]
        assert tensor.tensor_type.name == type_name
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        got = ours.dequantized(tensor.name)
        assert tuple(got.shape) == tuple(original.shape)
        assert np.array_equal(got.float().numpy().reshape(expected.shape), expected.astype(np.float32))


@pytest.mark.parametrize("damage,message", [
    (lambda raw: raw[:-40], "runs past the end of the file"),
    (lambda raw: raw[:4] + (9).to_bytes(4, "little") + raw[8:], "version 9"),
    (lambda raw: raw[:30], "runs past the end of the file"),
])
def test_malformed_gguf_files_are_refused_naming_the_file(tmp_path, damage, message):
    from models.gguf import write_gguf
    path = tmp_path / "bad.gguf"
    write_gguf(path, {"a.weight": ("Q8_0", torch.randn(4, 64))})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message) as error:
        read_header(str(path))
    assert "bad.gguf" in str(error.value)


def test_an_unread_ggml_type_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "wan")
    writer.add_tensor("blocks.0.mlp.fc1.weight", np.zeros((2, 66), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"iq\.gguf: tensor 'blocks\.0\.mlp\.fc1\.weight' has ggml type 16"):
        read_header(str(path))


K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
K_HALF_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_k_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 rows of random valid `type_name` blocks with small float16 super-block scales."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    for offset in K_HALF_FIELDS[type_name]:
        halves = (np.abs(rng.standard_normal(blocks.shape[0])) * 2e-4).astype(np.float16)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_every_k_type_loads_as_a_layer_that_computes_with_the_gguf_packages_decoded_weights(tmp_path):
    # The tiny DiT widened to 256, so that its rows are whole 256-value K blocks; the K-typed weights are
    # random valid blocks (the gguf package writes no K type in numpy).
    config = dataclasses.replace(transformer.TINY_CONFIG, hidden_size=256, head_dim=128, ffn_size=256, text_dim=256,
                                 time_hidden_size=256)
    from models.h3.make_tiny import _init_weights
    float_model = transformer.H3Transformer(config)
    _init_weights(float_model, 5)
    rng = np.random.default_rng(5)
    path = tmp_path / "k_types.gguf"
    writer = gguf.GGUFWriter(str(path), "minimax_h3")
    expected, index = {}, 0
    for key, value in float_model.state_dict().items():
        value = value.detach().float().contiguous()
        if key.endswith(".weight") and value.dim() == 2 and value.shape[1] % 256 == 0 and key.startswith("blocks."):
            type_name = K_TYPES[index % len(K_TYPES)]
            index += 1
            qtype = gguf.GGMLQuantizationType[type_name]
            packed = _random_k_blocks(type_name, *value.shape, rng)
            writer.add_tensor(key, packed, raw_dtype=qtype)
            expected[key] = (type_name, torch.from_numpy(gguf.quants.dequantize(packed, qtype)))
        else:
            writer.add_tensor(key, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert {t for t, _ in expected.values()} == set(K_TYPES)
    model = load_model(str(path)).model
    for key, (type_name, values) in expected.items():
        layer = model.get_submodule(key[:-len(".weight")])
        assert isinstance(layer, QuantizedLinear) and layer.stored_format.type_name == type_name
        assert torch.equal(layer.dequantized_weight(torch.float32), values)
    with torch.no_grad():
        inputs = (torch.randn(1, 24, 2, 4, 4), torch.randn(1, 32, 2, 5), torch.randn(1, 3, 256), 0.7, 0.6)
        ours = model(*inputs)
        reference = _float_model(model.config, _dequantized_state(model))(*inputs)
    for a, b in zip(ours, reference):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())


def _wide_dit():
    """The tiny DiT widened to 256, so that its block rows are whole 256-value K blocks, and its float state."""
    config = dataclasses.replace(transformer.TINY_CONFIG, hidden_size=256, head_dim=128, ffn_size=256, text_dim=256,
                                 time_hidden_size=256)
    from models.h3.make_tiny import _init_weights
    model = transformer.H3Transformer(config)
    _init_weights(model, 5)
    return model.eval(), {k: v.contiguous() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("block_type,tolerance", [("Q6_K", 5e-2), ("Q4_K", 1.5e-1)])
def test_a_k_typed_gguf_dit_written_by_weft_gives_the_float_dits_velocities(tmp_path, block_type, tolerance):
    # Every weight whose rows are whole 256-value blocks in the K type (Weft's encoder, models/quant/formats/
    # gguf.py), the rest F32. Stated error, largest difference over the output's largest value: Q6_K 5e-2,
    # Q4_K 1.5e-1 (measured 1.5e-2 / 2.5e-2 and 6.1e-2 / 9.2e-2 for video / audio; Q8_0 6e-3 / 9e-3 and
    # Q4_1 8.6e-2 / 1.2e-1 on the same model).
    float_model, state = _wide_dit()
    path = tmp_path / f"wide-{block_type}.gguf"
    types = write_with_gguf_package(path, state, block_type, arch="minimax_h3")
    assert sum(t == block_type for t in types.values()) >= 8
    model = load_model(str(path)).model
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(quantized) == {k[:-len(".weight")] for k, t in types.items() if t == block_type}
    assert {m.stored_format.type_name for m in quantized.values()} == {block_type}
    gen = torch.Generator().manual_seed(2)
    inputs = (torch.randn(1, 24, 2, 4, 4, generator=gen), torch.randn(1, 32, 2, 5, generator=gen),
              torch.randn(1, 3, 256, generator=gen), 0.7, 0.6)
    with torch.no_grad():
        ours, original = model(*inputs), float_model(*inputs)
    for a, c in zip(ours, original):
        assert torch.isfinite(a).all() and (a - c).abs().max() <= tolerance * c.abs().max()


def test_a_llama_cpp_named_encoder_is_refused_saying_which_names_are_read(tmp_path):
    from models.gguf import write_gguf
    path = tmp_path / "llama_names.gguf"
    write_gguf(path, {"token_embd.weight": ("Q8_0", torch.randn(8, 64)), "blk.0.attn_q.weight": ("F16", torch.randn(4, 4))})
    with pytest.raises(ValueError, match=r"llama_names\.gguf is a GGUF file with llama\.cpp's tensor names"):
        load_model(str(path))
