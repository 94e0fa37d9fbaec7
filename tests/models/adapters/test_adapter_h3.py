"""Adapters on the real H3 transformer (tiny config): a LoRA on every linear, kohya and diffusers names."""
from __future__ import annotations

import pytest
import torch

from models import ops
from models.adapters import load_adapter
from models.patcher import ModelHandle
from tests.models.adapters.helpers import assert_unchanged, rand, snapshot, write_adapter

transformer = pytest.importorskip("models.h3.transformer")


def test_lora_on_every_linear_of_the_tiny_h3_transformer(tmp_path):
    torch.manual_seed(0)
    model = transformer.H3Transformer(transformer.TINY_CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    before = snapshot(model)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, ops.Linear)]
    tensors, deltas = {}, {}
    for seed, (name, layer) in enumerate(linears):
        key = "lora_unet_" + name.replace(".", "_")
        up, down = rand(layer.out_features, 4, seed=2 * seed) * 0.1, rand(4, layer.in_features, seed=2 * seed + 1)
        tensors.update({f"{key}.lora_up.weight": up, f"{key}.lora_down.weight": down, f"{key}.alpha": torch.tensor(2.0)})
        deltas[name] = 0.5 * up @ down
    file = write_adapter(tmp_path / "all_linears.safetensors", tensors)
    handle = ModelHandle(model, name="tiny-h3").with_adapter(load_adapter(file), 0.9)
    merged = dict(handle.merged().model.named_modules())
    for name, layer in linears:
        torch.testing.assert_close(merged[name].weight, layer.weight + 0.9 * deltas[name])

    gen = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 24, 2, 4, 4, generator=gen), torch.randn(1, 32, 2, 5, generator=gen),
              torch.randn(1, 3, transformer.TINY_CONFIG.text_dim, generator=gen), 0.7, 0.6)
    base_out = model(*inputs)
    for a, b, c in zip(handle(*inputs), handle.merged()(*inputs), base_out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert (a - c).abs().max() > 1e-4
    assert_unchanged(model, before)


def test_diffusers_names_on_the_tiny_h3_transformer(tmp_path):
    torch.manual_seed(0)
    model = transformer.H3Transformer(transformer.TINY_CONFIG)
    cfg = transformer.TINY_CONFIG
    inner = cfg.num_heads * cfg.head_dim
    up_k, down_k = rand(inner, 2, seed=1), rand(2, cfg.hidden_size, seed=2)
    up_ff, down_ff = rand(2 * cfg.ffn_size, 2, seed=3), rand(2, cfg.hidden_size, seed=4)
    file = write_adapter(tmp_path / "diffusers.safetensors", {
        "transformer.transformer_blocks.1.attn.to_k.lora_A.weight": down_k,
        "transformer.transformer_blocks.1.attn.to_k.lora_B.weight": up_k,
        "transformer.token_refiner.refiner_blocks.0.ff.net.0.proj.lora_A.weight": down_ff,
        "transformer.token_refiner.refiner_blocks.0.ff.net.0.proj.lora_B.weight": up_ff})
    merged = ModelHandle(model).with_adapter(load_adapter(file), 1.0).merged().model
    want = model.blocks[1].attn.qkv_proj.weight.detach().clone()
    want[inner:2 * inner] += up_k @ down_k
    torch.testing.assert_close(merged.blocks[1].attn.qkv_proj.weight, want)
    ff = up_ff @ down_ff
    ff = torch.cat([ff[cfg.ffn_size:], ff[:cfg.ffn_size]])  # diffusers [value; gate] -> ours [gate; value]
    torch.testing.assert_close(merged.token_refiner.blocks[0].mlp.fc1.weight,
                               model.token_refiner.blocks[0].mlp.fc1.weight + ff)
