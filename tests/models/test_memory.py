"""The device-memory manager: budget, eviction order, streaming a model 4x its budget, patches at take time."""
import argparse

import pytest
import torch
from torch import nn

from kernels import registry
from models import memory, ops
from models.patcher import patches_active


@pytest.fixture(autouse=True)
def clean_runtime():
    yield
    memory.unconfigure()
    registry.disable_fused_kernels(False)
    registry.set_fast_options([])


class Block(nn.Module):
    """A transformer-like block built from models/ops.py (attention replaced by a projection)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = ops.RMSNorm(dim)
        self.proj = ops.Linear(dim, dim)
        self.norm2 = ops.LayerNorm(dim)
        self.up = ops.Linear(dim, 2 * hidden)
        self.down = ops.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x, prologue="rms_norm", prologue_weight=self.norm1, residual=x, residual_scale=0.5)
        h = self.up(self.norm2(x))  # (B, T, 2 * hidden)
        return self.down(h, prologue="swiglu", residual=x)


class Stack(nn.Module):
    def __init__(self, depth: int = 6, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.embed = ops.Embedding(50, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))
        self.out = ops.Linear(dim, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids, dtype=torch.float32)
        for block in memory.stream_blocks(self.blocks):
            x = block(x)
        return self.out(x)


def weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def largest_module_bytes(model: nn.Module) -> int:
    return max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())


def make_model():
    torch.manual_seed(0)
    model = Stack().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from exactly 1
    return model, torch.randint(0, 50, (2, 9))


@torch.no_grad()
def test_a_model_four_times_the_budget_gives_the_resident_output():
    model, ids = make_model()
    resident = model(ids)
    total = weight_bytes(model)
    budget = total // 4
    manager = memory.configure(vram_budget_gb=budget / memory.GIB, device="cpu")
    streamed = model(ids)
    torch.testing.assert_close(streamed, resident, atol=0, rtol=0)
    stats = manager.stats()
    assert stats.peak_resident_bytes <= budget + largest_module_bytes(model)
    assert stats.evictions > 0 and stats.bytes_moved >= total
    assert stats.resident_bytes <= budget
    # The second run streams again (the budget cannot hold the model) and still agrees.
    torch.testing.assert_close(model(ids), resident, atol=0, rtol=0)
    assert manager.stats().bytes_moved >= 2 * total


@torch.no_grad()
def test_highvram_keeps_everything_and_the_second_run_moves_nothing():
    model, ids = make_model()
    manager = memory.configure(mode="highvram", device="cpu")
    model(ids)
    moved = manager.stats().bytes_moved
    assert moved == weight_bytes(model) and manager.stats().resident_bytes == weight_bytes(model)
    model(ids)
    assert manager.stats().bytes_moved == moved and manager.stats().evictions == 0


@torch.no_grad()
def test_novram_keeps_nothing_between_ops_and_lowvram_drops_finished_blocks():
    model, ids = make_model()
    expected = model(ids)
    manager = memory.configure(mode="novram", device="cpu")
    torch.testing.assert_close(model(ids), expected, atol=0, rtol=0)
    assert manager.stats().resident_bytes == 0
    assert manager.stats().peak_resident_bytes <= largest_module_bytes(model) + weight_bytes(model.blocks[0].norm1)

    manager = memory.configure(mode="lowvram", device="cpu")
    seen = []
    for block in manager.stream_blocks(model.blocks):
        block(torch.randn(1, 3, 32))
        seen.append(set(manager.resident_modules()))
    assert all(not any(m in seen[-1] for m in model.blocks[i].modules()) for i in range(len(model.blocks) - 1))
    assert not any(m in set(manager.resident_modules()) for m in model.blocks[-1].modules())


def test_eviction_is_least_recently_used_and_never_a_held_module():
    layers = [ops.Linear(8, 8, bias=False) for _ in range(4)]  # 256 bytes each in float32
    manager = memory.MemoryManager(device="cpu", budget_bytes=2 * 256)
    for layer in layers[:3]:
        manager.take(layer)
        manager.release(layer)
    assert manager.resident_modules() == [layers[1], layers[2]]  # layers[0] was least recently used
    manager.take(layers[1])
    manager.release(layers[1])  # now layers[2] is the least recently used
    manager.take(layers[3])
    manager.release(layers[3])
    assert manager.resident_modules() == [layers[1], layers[3]]
    stats = manager.stats()
    assert stats.evictions == 2 and stats.hits == 1 and stats.takes == 5

    manager.take(layers[1])  # held: cannot be evicted
    manager.take(layers[0])
    manager.take(layers[2])  # the two resident copies are both held: over budget rather than evict them
    assert set(manager.resident_modules()) >= {layers[0], layers[1], layers[2]}
    assert manager.stats().peak_resident_bytes == 3 * 256
    for layer in (layers[1], layers[0], layers[2]):
        manager.release(layer)
    with pytest.raises(ValueError, match="not held"):
        manager.release(layers[2])


def test_take_casts_to_the_requested_dtype_and_counts_its_bytes():
    layer = ops.Linear(16, 4)
    manager = memory.MemoryManager(device="cpu", budget_bytes=10_000)
    weight, bias = manager.take(layer, dtype=torch.bfloat16)
    assert weight.dtype == bias.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32
    assert manager.stats().resident_bytes == (16 * 4 + 4) * 2
    assert manager.free_bytes() <= 10_000 - (16 * 4 + 4) * 2
    manager.release(layer)
    assert manager.make_room(10_000) >= 0 and manager.stats().resident_bytes == 0


def test_reloading_weights_in_place_refreshes_the_resident_copy():
    layer = ops.Linear(4, 4)
    memory.configure(device="cpu", mode="highvram")
    x = torch.randn(2, 4)
    with torch.no_grad():
        before = layer(x)
        layer.load_state_dict({"weight": 2 * layer.weight, "bias": layer.bias})
        after = layer(x)
    torch.testing.assert_close(after - layer.bias, 2 * (before - layer.bias))


@torch.no_grad()
def test_patches_apply_at_take_time_and_leave_the_base_weights_unchanged():
    layer = ops.Linear(6, 3)
    base = layer.weight.clone()
    x = torch.randn(2, 6)
    plain = layer(x)
    delta = torch.randn(3, 6)
    patch_map = {id(layer): {"weight": [(lambda shape, dtype, device: delta.to(device, dtype), 0.5)]}}
    for configured in (False, True):
        if configured:
            memory.configure(device="cpu", mode="highvram")
        with patches_active(patch_map):
            patched = layer(x)
        torch.testing.assert_close(patched, plain + 0.5 * x @ delta.T)
        assert torch.equal(layer.weight, base)
        torch.testing.assert_close(layer(x), plain)  # the patched copy is not served without the patch set
    assert len(memory.manager().resident_modules()) == 2  # base and patched copies are kept apart


def test_cli_flags_configure_the_runtime():
    parser = argparse.ArgumentParser()
    memory.add_cli_arguments(parser)
    args = parser.parse_args(["--vram-budget", "0.5", "--lowvram", "--disable-fused-kernels", "--fast"])
    manager = memory.configure_from_args(args)
    assert memory.manager() is manager and manager.mode == "lowvram"
    assert manager.fixed_budget_bytes == memory.GIB // 2
    assert not registry.fused_kernels_enabled() and registry.fast_option("fp16_accumulation")
    snapshot = memory.stats_snapshot()
    assert snapshot["mode"] == "lowvram" and snapshot["budget_bytes"] == memory.GIB // 2
    assert {"resident_bytes", "peak_resident_bytes", "bytes_moved", "evictions"} <= set(snapshot)
    with pytest.raises(SystemExit):
        parser.parse_args(["--lowvram", "--novram"])


def test_unconfigured_take_returns_the_parameters_and_defaults_are_decided_in_one_place():
    layer = ops.Linear(4, 2)
    weight, bias = memory.take(layer, dtype=torch.float32)
    assert weight is layer.weight and bias is layer.bias
    memory.release(layer)
    assert memory.compute_device() == memory.default_device()
    assert memory.stats_snapshot()["configured"] is False
    assert memory.free_bytes() > 0
    memory.configure(device="cpu", dtype=torch.bfloat16)
    assert memory.compute_dtype() == torch.bfloat16 and memory.compute_device() == torch.device("cpu")
    assert memory.take(layer)[0].dtype == torch.bfloat16
    memory.release(layer)


@torch.no_grad()
def test_a_resident_linear_takes_the_fast_path_and_leaves_it_when_anything_changes():
    import copy

    layer = ops.Linear(8, 4)
    x = torch.randn(3, 8)
    expected = layer(x)
    manager = memory.configure(device="cpu", mode="highvram")

    def run_and_count(module=layer, inputs=x):
        before = manager.stats().fast_takes
        out = module(inputs)
        return out, manager.stats().fast_takes - before

    assert run_and_count()[1] == 0  # the first take makes the copy resident
    out, fast = run_and_count()
    assert fast == 1 and torch.equal(out, expected)

    delta = torch.randn(4, 8)
    with patches_active({id(layer): {"weight": [(lambda shape, dtype, device: delta.to(device, dtype), 1.0)]}}):
        out, fast = run_and_count()
    assert fast == 0 and torch.allclose(out, expected + x @ delta.T, atol=1e-6)
    assert run_and_count()[1] == 1  # the patch set is gone: the unpatched copy serves again

    assert run_and_count(inputs=x.bfloat16())[1] == 0  # another dtype is another copy
    manager.evict(layer)
    assert run_and_count()[1] == 0 and run_and_count()[1] == 1  # evicted: taken again, then fast

    layer.weight.mul_(2)  # changed in place: the resident copy is stale
    out, fast = run_and_count()
    assert fast == 0 and torch.allclose(out - layer.bias, 2 * (expected - layer.bias), atol=1e-6)
    layer.bias = nn.Parameter(torch.zeros(4))  # replaced: likewise
    out, fast = run_and_count()
    assert fast == 0 and torch.allclose(out, x @ layer.weight.T, atol=1e-6)

    twin = copy.deepcopy(layer)  # carries the reference to the original's copy in its __dict__
    twin.weight.mul_(3)
    out, fast = run_and_count(module=twin)
    assert fast == 0 and torch.allclose(out, x @ twin.weight.T, atol=1e-6)

    streamed = memory.configure(device="cpu", mode="novram")  # nothing stays resident between ops
    layer(x)
    layer(x)
    assert streamed.stats().fast_takes == 0 and streamed.stats().resident_bytes == 0
