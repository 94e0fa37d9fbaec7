"""The Qwen3-VL encoder's weights go through the memory manager: quantized layers move as stored, a
low-memory run holds one layer at a time, and after encoding the whole encoder can be evicted."""
from __future__ import annotations

import torch

from models import memory
from models.h3.tiny_released import qwen3vl_bytes
from models.loading import load_model
from models.ops import QuantizedLinear


def stored_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def test_encoding_streams_layers_and_leaves_an_evictable_encoder(tmp_path):
    path = tmp_path / "qwen.safetensors"
    path.write_bytes(qwen3vl_bytes())
    model = load_model(str(path)).model
    ids = list(range(100, 120))
    expected = model.encode(ids).hidden
    manager = memory.MemoryManager(device="cpu", dtype=torch.float32, mode="lowvram")
    memory.activate(manager)
    try:
        got = model.encode(ids).hidden
        stats = manager.stats()
        layers = model.model.layers
        # Each language-model layer's copy is dropped once the next one runs: beside the (int8) token
        # table, the peak holds about one layer (its bf16 norms widened to float32), not all of them.
        one_layer = stored_bytes(layers[0])
        assert stats.peak_resident_bytes - stored_bytes(model.model.embed_tokens) < 2 * one_layer
        assert stats.peak_resident_bytes < stored_bytes(model)
        # An nvfp4 layer is held as stored (packed codes and scales), not widened to float32.
        q_proj = layers[0].self_attn.q_proj
        assert isinstance(q_proj, QuantizedLinear)
        manager.take_named(q_proj)
        assert manager.stats().resident_bytes - stats.resident_bytes == stored_bytes(q_proj)
        manager.release(q_proj)
        assert manager.evict(model) > 0 and manager.stats().resident_bytes == 0
    finally:
        memory.activate(None)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
