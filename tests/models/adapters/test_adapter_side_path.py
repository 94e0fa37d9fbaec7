"""The low-rank side path: on every quantized format, LoRA, LoKr and LoHa patches run beside the quantized
product and equal dequantize-then-add to float32 rounding, stacked and at any strength, with nothing
rebuilt; the bypass mode does the same on float Linears; DoRA keeps the dequantizing route."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.quantized import WeightFormat
from models import ops
from models.adapters import adapter_from_tensors
from models.patcher import AdapterMode, ModelHandle, patches_active
from models.quant.formats import LayerQuant
from tests.models.adapters.helpers import assert_unchanged, rand, snapshot

# (format, rotation group): int8 plain and convrot, both float8s, nvfp4 (with a pre-quant scale), mxfp8.
FORMATS = [(WeightFormat.INT8, 0), (WeightFormat.INT8, 16), (WeightFormat.FLOAT8_E4M3, 0),
           (WeightFormat.FLOAT8_E5M2, 0), (WeightFormat.NVFP4, 0), (WeightFormat.MXFP8, 0)]
WIDTH, QKV, FFN = 64, 96, 48  # fc1 rows are [gate; value] of FFN each


def _quantized(fmt: WeightFormat, group: int, out_features: int, in_features: int, seed: int) -> ops.QuantizedLinear:
    quant = LayerQuant(fmt, group)
    stored = quant.stored_format.encode(rand(out_features, in_features, seed=seed) * 0.1, quant)
    if fmt is WeightFormat.NVFP4:
        stored["pre_quant_scale"] = torch.linspace(0.5, 2.0, in_features)
    layer = ops.QuantizedLinear(in_features, out_features, quant, bias=True,
                                tensor_shapes={k: (tuple(v.shape), v.dtype) for k, v in stored.items()})
    with torch.no_grad():
        layer.weight.copy_(stored.pop("weight"))
        for name, tensor in stored.items():
            getattr(layer, name).copy_(tensor)
        layer.bias.copy_(rand(out_features, seed=seed + 1) * 0.1)
    return layer


class Block(nn.Module):
    """qkv (rows [q | k | v]), a SwiGLU fc1 [gate; value] and an fc2 with an RMSNorm prologue and a gated residual."""

    def __init__(self, make) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv_proj = make(QKV, WIDTH, 0)
        self.mlp = nn.Module()
        self.mlp.fc1 = make(2 * FFN, WIDTH, 2)
        self.mlp.fc2 = make(WIDTH, FFN, 4)
        self.norm_weight = nn.Parameter(1 + 0.1 * rand(FFN, seed=6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qkv = self.attn.qkv_proj(x)
        hidden = self.mlp.fc1(x)
        gate = torch.linspace(0.5, 1.5, WIDTH)
        out = self.mlp.fc2(hidden[..., :FFN], prologue="rms_norm", prologue_weight=self.norm_weight,
                           residual=x, residual_scale=gate)
        return qkv, out


class Net(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(make)])

    def forward(self, x: torch.Tensor):
        return self.blocks[0](x)


def _float_make(out_features: int, in_features: int, seed: int) -> ops.Linear:
    layer = ops.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        layer.weight.copy_(rand(out_features, in_features, seed=seed) * 0.1)
        layer.bias.copy_(rand(out_features, seed=seed + 1) * 0.1)
    return layer


def _lora(rank=4, seed=0) -> dict:
    """A LoRA on the k third of qkv (diffusers name) and on fc2; alpha 2."""
    tensors = {}
    for i, (key, out_f, in_f) in enumerate([("transformer.transformer_blocks.0.attn.to_k", QKV // 3, WIDTH),
                                            ("transformer.transformer_blocks.0.ff.net.2", WIDTH, FFN)]):
        tensors[f"{key}.lora_A.weight"] = rand(rank, in_f, seed=seed + 10 * i)
        tensors[f"{key}.lora_B.weight"] = rand(out_f, rank, seed=seed + 10 * i + 1) * 0.05
    return tensors


def _lokr(seed=20) -> dict:
    """A LoKr on fc1 under its diffusers name ([value; gate] halves swapped): whole w1, low-rank w2."""
    key = "transformer.transformer_blocks.0.ff.net.0.proj"
    return {f"{key}.lokr_w1": rand(4, 4, seed=seed) * 0.2, f"{key}.lokr_w2_a": rand(2 * FFN // 4, 3, seed=seed + 1) * 0.1,
            f"{key}.lokr_w2_b": rand(3, WIDTH // 4, seed=seed + 2) * 0.1, f"{key}.alpha": torch.tensor(1.5)}


def _loha(seed=30, rank=2) -> dict:
    """A LoHa on all of qkv (kohya name)."""
    key = "lora_unet_blocks_0_attn_qkv_proj"
    parts = {"w1_a": (QKV, rank), "w1_b": (rank, WIDTH), "w2_a": (QKV, rank), "w2_b": (rank, WIDTH)}
    tensors = {f"{key}.hada_{p}": rand(*shape, seed=seed + i) * 0.2 for i, (p, shape) in enumerate(parts.items())}
    tensors[f"{key}.alpha"] = torch.tensor(1.0)
    return tensors


def _reference(handle: ModelHandle, x: torch.Tensor):
    """The same forward with every layer's weight replaced by the handle's patched float32 weight."""
    def dense(name):
        return handle.patched_weight(name), handle.base.get_submodule(name).bias
    qkv_w, qkv_b = dense("blocks.0.attn.qkv_proj")
    fc1_w, fc1_b = dense("blocks.0.mlp.fc1")
    fc2_w, fc2_b = dense("blocks.0.mlp.fc2")
    block = handle.base.blocks[0]

    def pre(layer, h):  # the nvfp4 pre-quant scale multiplies what the weight multiplies
        scale = getattr(layer, "pre_quant_scale", None)
        return h if scale is None else h * scale
    qkv = F.linear(pre(block.attn.qkv_proj, x), qkv_w, qkv_b)
    hidden = F.linear(pre(block.mlp.fc1, x), fc1_w, fc1_b)
    normed = pre(block.mlp.fc2, F.rms_norm(hidden[..., :FFN], (FFN,), block.norm_weight, 1e-6))
    out = x + torch.linspace(0.5, 1.5, WIDTH) * F.linear(normed, fc2_w, fc2_b)
    return qkv, out


def _close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6 * b.abs().max().item())


@pytest.mark.parametrize("fmt,group", FORMATS, ids=[f"{f.value}-{g}" for f, g in FORMATS])
def test_side_path_equals_dequantize_then_add_for_every_format_and_kind(monkeypatch, fmt, group):
    # The reference product (dequantize, then the float Linear) isolates the adapter's arithmetic.
    monkeypatch.setenv("WEFT_KERNEL_BACKEND", "quantized_linear:eager")
    model = Net(lambda o, i, s: _quantized(fmt, group, o, i, s)).eval()
    before = snapshot(model)
    x = rand(5, WIDTH, seed=99)
    lora, lokr, loha = (adapter_from_tensors(t(), source=name) for t, name in
                        ((_lora, "lora"), (_lokr, "lokr"), (_loha, "loha")))
    base = ModelHandle(model, name="quantized")
    for handle in (base.with_adapter(lora, 0.8), base.with_adapter(lokr, 1.0), base.with_adapter(loha, -0.6),
                   base.with_adapter(lora, 0.8).with_adapter(lokr, 0.5).with_adapter(loha, 1.2)):
        assert not handle.patch_map and handle.side_map  # every patch runs beside, none dequantizes
        with torch.no_grad():
            got = handle(x)
        _close(got, _reference(handle, x))
        assert (got[0] - model(x)[0]).abs().max() > 1e-3 or (got[1] - model(x)[1]).abs().max() > 1e-3
    assert_unchanged(model, before)


def test_changing_the_strength_reuses_the_loaded_adapter_and_rebuilds_nothing(monkeypatch):
    monkeypatch.setenv("WEFT_KERNEL_BACKEND", "quantized_linear:eager")
    model = Net(lambda o, i, s: _quantized(WeightFormat.INT8, 16, o, i, s)).eval()
    adapter = adapter_from_tensors(_lora(), source="lora")
    base = ModelHandle(model, name="int8")
    calls = []
    original = ops.QuantizedLayer.requantized
    monkeypatch.setattr(ops.QuantizedLayer, "requantized", lambda self, w: calls.append(1) or original(self, w))
    x = rand(3, WIDTH, seed=5)
    outputs = {}
    for strength in (1.0, 0.25, -1.0):
        handle = base.with_adapter(adapter, strength)
        assert all(patch.source is entry.weight for patch, entry in
                   zip(handle.applied[0].patches, [e for e in adapter.entries]))  # the file's own factors
        with torch.no_grad():
            outputs[strength] = handle(x)
        _close(outputs[strength], _reference(handle, x))
    assert not calls  # nothing was requantized
    with torch.no_grad():
        plain = model(x)
    # The side term is linear in the strength: 1.0 and -1.0 sit on either side of the base.
    torch.testing.assert_close(outputs[1.0][0] + outputs[-1.0][0], 2 * plain[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt,group", [(WeightFormat.INT8, 0), (WeightFormat.INT8, 16)])
def test_side_path_beside_the_int8_product_stays_within_its_rounding(fmt, group):
    model = Net(lambda o, i, s: _quantized(fmt, group, o, i, s)).eval()
    handle = ModelHandle(model, name="int8").with_adapter(adapter_from_tensors(_lora(), source="lora"), 1.0)
    x = rand(6, WIDTH, seed=7)
    with torch.no_grad():
        got = handle(x)
    for a, b in zip(got, _reference(handle, x)):
        # The int8 product quantizes each activation row to 8 bits: about 1% of the row's size.
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2 * b.abs().max().item())


def test_bypass_mode_runs_float_linears_on_the_side_path_and_equals_take_time_patches():
    model = Net(_float_make).eval()
    before = snapshot(model)
    adapters = [adapter_from_tensors(t(), source=n) for t, n in ((_lora, "lora"), (_lokr, "lokr"), (_loha, "loha"))]
    take_time, beside = ModelHandle(model), ModelHandle(model)
    for adapter, strength in zip(adapters, (0.7, 1.3, -0.4)):
        take_time = take_time.with_adapter(adapter, strength)
        beside = beside.with_adapter(adapter, strength, mode=AdapterMode.BYPASS)
    assert take_time.patch_map and not take_time.side_map  # float layers: take-time patches by default
    assert beside.side_map and not beside.patch_map
    x = rand(4, WIDTH, seed=8)
    with torch.no_grad():
        _close(beside(x), take_time(x))
        _close(beside(x), _reference(beside, x))
    assert_unchanged(model, before)


def test_dora_entries_keep_the_dequantizing_route_on_their_layer(monkeypatch):
    monkeypatch.setenv("WEFT_KERNEL_BACKEND", "quantized_linear:eager")
    model = Net(lambda o, i, s: _quantized(WeightFormat.FLOAT8_E4M3, 0, o, i, s)).eval()
    tensors = _lora()
    tensors["transformer.transformer_blocks.0.ff.net.2.dora_scale"] = 1 + 0.1 * rand(WIDTH, seed=3)
    handle = ModelHandle(model).with_adapter(adapter_from_tensors(tensors, source="dora"), 0.9)
    fc2, qkv = model.blocks[0].mlp.fc2, model.blocks[0].attn.qkv_proj
    assert id(fc2) in handle.patch_map and id(fc2) not in handle.side_map
    assert id(qkv) in handle.side_map
    x = rand(3, WIDTH, seed=4)
    with torch.no_grad():
        _close(handle(x), _reference(handle, x))


def _held_tensor_bytes() -> int:
    """Bytes of the CPU tensor storages that objects made since `gc.freeze()` hold, each storage counted once."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():  # the frozen objects (everything older than the test) are not listed
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_the_side_path_holds_no_more_than_the_base_and_the_adapter_file(tmp_path, monkeypatch):
    """Resident bytes after side-path steps stay within 1.05x the base's plus the adapter file's: no copy of the
    factors in the compute dtype, no per-layer buffer outlives a product (bench/adapters.py measures the RSS)."""
    from safetensors.torch import save_file

    from models.adapters import load_adapter

    monkeypatch.setenv("WEFT_KERNEL_BACKEND", "quantized_linear:eager")  # no compiling of the int8 product
    width, rank = 128, 8
    x = rand(16, width, seed=3)
    with torch.no_grad():
        _quantized(WeightFormat.INT8, 16, width, width, seed=0)(x)  # the product's imports, before counting
    gc.freeze()
    try:
        model = nn.Sequential(*[_quantized(WeightFormat.INT8, 16, width, width, seed=10 + i) for i in range(3)]).eval()
        base_bytes = _held_tensor_bytes()
        tensors = {}
        for i in range(3):  # a bf16 LoRA on every layer, as the released turbo LoRAs are stored
            tensors[f"lora_unet_{i}.lora_down.weight"] = rand(rank, width, seed=20 + i).bfloat16()
            tensors[f"lora_unet_{i}.lora_up.weight"] = (0.1 * rand(width, rank, seed=30 + i)).bfloat16()
        path = tmp_path / "lora_bf16.safetensors"
        save_file(tensors, str(path))
        del tensors
        handle = ModelHandle(model, name="int8").with_adapter(load_adapter(path), 1.0)
        assert len(handle.side_map) == 3 and not handle.patch_map
        with torch.no_grad():
            for _ in range(2):
                out = handle(x)
            assert (out - model(x)).abs().max() > 1e-3  # the adapter ran
        del out
        held = _held_tensor_bytes()
    finally:
        gc.unfreeze()
    assert held <= 1.05 * (base_bytes + path.stat().st_size), (held, base_bytes, path.stat().st_size)


ROWS, DIM = 64, 16  # a token table


def _quantized_table(fmt: WeightFormat) -> ops.QuantizedEmbedding:
    quant = LayerQuant(fmt, 0)
    stored = quant.stored_format.encode(rand(ROWS, DIM, seed=40), quant)
    table = ops.QuantizedEmbedding(ROWS, DIM, quant, tensor_shapes={k: (tuple(v.shape), v.dtype)
                                                                    for k, v in stored.items()})
    with torch.no_grad():
        for name, tensor in stored.items():
            getattr(table, name).copy_(tensor)
    return table


@pytest.mark.parametrize("fmt", [WeightFormat.INT8, WeightFormat.FLOAT8_E4M3])
def test_adapters_on_a_quantized_token_table_add_their_rows_without_dequantizing_it(monkeypatch, fmt):
    from kernels.quantized import QuantizedWeight

    net = nn.Module()
    net.embed = _quantized_table(fmt)
    net.forward = lambda ids, dtype=torch.float32: net.embed(ids, dtype=dtype)
    before = snapshot(net)
    lora = adapter_from_tensors({"lora_unet_embed.lora_up.weight": rand(ROWS, 3, seed=41) * 0.2,
                                 "lora_unet_embed.lora_down.weight": rand(3, DIM, seed=42),
                                 "lora_unet_embed.alpha": torch.tensor(1.5)}, source="lora")
    lokr = adapter_from_tensors({"lycoris_embed.lokr_w1": rand(4, 2, seed=43),
                                 "lycoris_embed.lokr_w2_a": rand(ROWS // 4, 2, seed=44) * 0.1,
                                 "lycoris_embed.lokr_w2_b": rand(2, DIM // 2, seed=45)}, source="lokr")
    loha = adapter_from_tensors({f"lycoris_embed.hada_{part}": rand(*shape, seed=46 + i) * 0.3 for i, (part, shape) in
                                 enumerate([("w1_a", (ROWS, 2)), ("w1_b", (2, DIM)), ("w2_a", (ROWS, 2)),
                                            ("w2_b", (2, DIM))])}, source="loha")
    handle = ModelHandle(net).with_adapter(lora, 0.8).with_adapter(lokr, -0.5).with_adapter(loha, 1.2)
    assert set(handle.side_map) == {id(net.embed)} and not handle.patch_map
    ids = torch.tensor([[0, 5, 63, 17], [17, 2, 40, 9]])
    with torch.no_grad():
        # The reference: the same patches added to the dequantized table at take time.
        with patches_active({id(net.embed): {"weight": handle.side_map[id(net.embed)]}}):
            want = net(ids)
        monkeypatch.setattr(QuantizedWeight, "dequantize", lambda *a, **k: pytest.fail("the table was dequantized"))
        got = handle(ids)
        assert handle(ids, torch.bfloat16).dtype == torch.bfloat16
    _close([got], [want])
    assert (got - net(ids)).abs().max() > 1e-2
    assert_unchanged(net, before)


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_side_products_run_in_float32_where_the_cpu_lacks_bfloat16_arithmetic(monkeypatch, native):
    from kernels import linear as linear_module
    from models.adapters.base import WeightPatch
    from models.adapters.lora import LoraDelta
    from models.patcher import side_residual

    monkeypatch.setattr(linear_module, "_native_half_product", lambda dtype: native)
    torch.manual_seed(0)
    deltas = [LoraDelta(up=torch.randn(24, 4).bfloat16(), down=torch.randn(4, 16).bfloat16(),
                        alpha=torch.tensor(2.0)) for _ in range(2)]
    entries = [(WeightPatch(delta, "layer", "weight", "layer"), s) for delta, s in zip(deltas, (0.75, -0.5))]
    h = torch.randn(5, 16).bfloat16()
    out = side_residual(entries, h, 24, None, None)
    assert out.dtype == torch.bfloat16

    def summed(hh):  # the stacked side products, summed in hh's dtype
        return sum(F.linear(F.linear(hh, d.down.to(hh.dtype)) * (s * d.scale), d.up.to(hh.dtype))
                   for d, (_, s) in zip(deltas, entries))

    assert torch.equal(out, (summed(h) if native else summed(h.float())).bfloat16())
