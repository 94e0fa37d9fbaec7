"""An H3-shaped transformer under the memory manager at budgets of 100%, 50% and 25% of its weights.

Reports each run's time as a ratio to the fully resident run (all weights already on the device, measured
in the same rounds), peak resident bytes against the budget plus the largest module, and bytes moved
per forward. On a CPU-only machine host copies stand in for device copies: the accounting is real, the
transfer is a memcpy rather than a PCIe copy, and prefetch is a no-op.

Run: .venv/bin/python bench/memory.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import registry  # noqa: E402
from kernels.attention import attention  # noqa: E402
from models import memory, ops  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block with the H3 layer names: attention (qkv_proj, out_proj) and a SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = ops.RMSNorm(dim)
        self.qkv_proj = ops.Linear(dim, 3 * dim)
        self.out_proj = ops.Linear(dim, dim)
        self.norm2 = ops.RMSNorm(dim)
        self.up_proj = ops.Linear(dim, 2 * hidden)
        self.down_proj = ops.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv_proj(x, prologue="rms_norm", prologue_weight=self.norm1)  # (B, T, 3D)
        q, k, v = qkv.view(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, T, Dh)
        a = attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)
        x = self.out_proj(a, residual=x, residual_scale=gate)
        h = self.up_proj(x, prologue="rms_norm", prologue_weight=self.norm2)  # (B, T, 2 * hidden)
        return self.down_proj(h, prologue="swiglu", residual=x, residual_scale=gate)


class Transformer(nn.Module):
    """A stack of blocks iterated through memory.stream_blocks, as model code does."""

    def __init__(self, depth: int, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden, heads) for _ in range(depth))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        for block in memory.stream_blocks(self.blocks):
            x = block(x, gate)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and rounds")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    device = memory.default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # The same kernels in every run, compiled nowhere, so the comparison is about weight movement only.
    registry.disable_fused_kernels()
    depth, dim, hidden, heads = (4 if args.quick else 6), 1024, 2816, 16
    tokens = 256 if args.quick else 512
    torch.manual_seed(0)
    model = Transformer(depth, dim, hidden, heads).eval()
    x = torch.randn(1, tokens, dim).to(device, dtype)
    gate = (0.1 * torch.randn(dim)).to(device, dtype)
    total = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) * dtype.itemsize
    print(f"device: {device} ({'GPU' if device.type == 'cuda' else 'CPU only: no GPU on this machine; host copies stand in'}), "
          f"dtype {str(dtype).removeprefix('torch.')}; {depth} blocks, dim {dim}, mlp {hidden}, {tokens} tokens; "
          f"weights {total / 2**20:.1f} MiB, largest module {largest / 2**20:.1f} MiB")

    managers = {"resident": memory.MemoryManager(device=device, dtype=dtype, mode="highvram")}
    for percent in (100, 50, 25):
        managers[f"{percent}%"] = memory.MemoryManager(device=device, dtype=dtype, budget_bytes=total * percent // 100)
    reference = None
    for name, manager in managers.items():  # warm-up: fills the resident run, checks every run agrees
        memory.activate(manager)
        out = model(x, gate)
        reference = out if reference is None else reference
        if not torch.equal(out, reference):
            raise SystemExit(f"the {name} run disagrees with the resident run")
        manager.reset_peak()
    moved_before = {name: m.stats().bytes_moved for name, m in managers.items()}
    rounds = 2 if args.quick else 3
    times = {name: [] for name in managers}
    for _ in range(rounds):
        for name, manager in managers.items():
            memory.activate(manager)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(x, gate)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    memory.unconfigure()
    results = {}
    print(f"{'run':>9} {'budget MiB':>10} {'time ratio':>10} {'peak MiB':>9} {'limit MiB':>9} {'moved MiB/fwd':>13} {'evictions':>9}")
    for name, manager in managers.items():
        stats = manager.stats()
        budget = manager.fixed_budget_bytes
        ratio = statistics.median(t / r for t, r in zip(times[name], times["resident"]))
        moved = (stats.bytes_moved - moved_before[name]) / rounds
        limit = None if budget is None else budget + largest
        print(f"{name:>9} {('all' if budget is None else f'{budget / 2**20:.1f}'):>10} {ratio:>9.3f}x "
              f"{stats.peak_resident_bytes / 2**20:>9.1f} {('-' if limit is None else f'{limit / 2**20:.1f}'):>9} "
              f"{moved / 2**20:>13.1f} {stats.evictions:>9}")
        results[name] = {"budget_bytes": budget, "time_ratio": round(ratio, 4),
                         "median_s": round(statistics.median(times[name]), 4),
                         "peak_resident_bytes": stats.peak_resident_bytes, "peak_limit_bytes": limit,
                         "within_limit": limit is None or stats.peak_resident_bytes <= limit,
                         "bytes_moved_per_forward": int(moved), "evictions": stats.evictions}
    registry.disable_fused_kernels(False)
    print("target: 25% run within 1.5x of the resident run, peak <= 25% of the weights + the largest module")
    print(json.dumps({"bench": "memory", "device": str(device), "gpu": device.type == "cuda",
                      "weights_bytes": total, "largest_module_bytes": largest, "runs": results}))


if __name__ == "__main__":
    main()
