"""Adapters on a 300M-parameter H3-shaped transformer: time to apply, and per-step cost on the fly vs merged.

A random-weight transformer with the H3 layout (fused qkv with inner width != hidden, SwiGLU fc1,
per-block adaln projection, patch projections, final layer) built from models/ops modules. Two
adapter files cover every linear: a rank-16 LoRA (kohya names) and a LoKr (LyCORIS names, whole w1,
low-rank w2). For each, the run measures loading the file, resolving it onto the model
(`with_adapter`), merging it into private copies, and the forward step time:
  base          no adapter
  merged        patched modules are private merged copies (the deltas cost nothing per step)
  on the fly    no memory manager: every take rebuilds base + delta (what streaming pays per op)
  manager       on the fly through a memory manager with room: the patched copy is made at the
                first take and stays resident, so later steps cost what merged costs
Run: .venv/bin/python bench/adapters.py   (last line: JSON with the figures)
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import memory, ops  # noqa: E402
from models.adapters import load_adapter  # noqa: E402
from models.patcher import ModelHandle  # noqa: E402

HIDDEN = 1024  # residual width
HEADS, HEAD_DIM = 10, 128  # inner attention width 1280, wider than hidden, as in H3
FFN = 2816  # SwiGLU width: fc1 has 2 * FFN rows [gate; value]
T_EMBED = 256  # input width of every adaln projection
NUM_BLOCKS = 20
TOKENS = 128  # rows per forward step
LORA_RANK = 16
LOKR_FACTOR = 8  # w1 is (8, 8); w2 is (out / 8, in / 8) stored as a rank-16 product
ROUNDS = 3  # rounds of (base, merged, on-the-fly) steps per adapter


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inner = HEADS * HEAD_DIM
        self.norm1 = ops.RMSNorm(HIDDEN)
        self.norm2 = ops.RMSNorm(HIDDEN)
        self.attn = nn.Module()
        self.attn.qkv_proj = ops.Linear(HIDDEN, 3 * inner, bias=False)
        self.attn.out_proj = ops.Linear(inner, HIDDEN, bias=False)
        self.mlp = nn.Module()
        self.mlp.fc1 = ops.Linear(HIDDEN, 2 * FFN, bias=False)
        self.mlp.fc2 = ops.Linear(FFN, HIDDEN, bias=False)
        self.adaln_proj = nn.Module()
        self.adaln_proj.linear = ops.Linear(T_EMBED, 4 * HIDDEN, bias=True)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        shift1, scale1, shift2, scale2 = self.adaln_proj.linear(t_emb).chunk(4, dim=-1)
        s = x.shape[0]
        qkv = self.attn.qkv_proj(self.norm1(x) * (1 + scale1) + shift1).view(s, 3, HEADS, HEAD_DIM)
        q, k, v = qkv.transpose(0, 2).unbind(1)  # each (H, S, D)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(s, HEADS * HEAD_DIM)
        x = self.attn.out_proj(attn, residual=x)
        return self.mlp.fc2(self.mlp.fc1(self.norm2(x) * (1 + scale2) + shift2), prologue="swiglu", residual=x)


class H3Shaped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.video_patch_proj = ops.Linear(96, HIDDEN)
        self.condition_proj = ops.Linear(HIDDEN, HIDDEN)
        self.time_embedder = nn.Module()
        self.time_embedder.proj_in = ops.Linear(T_EMBED, HIDDEN)
        self.time_embedder.proj_out = ops.Linear(HIDDEN, T_EMBED)
        self.blocks = nn.ModuleList([Block() for _ in range(NUM_BLOCKS)])
        self.final_layer = nn.Module()
        self.final_layer.video_out = ops.Linear(HIDDEN, 96)

    def forward(self, video: torch.Tensor, text: torch.Tensor, t_freq: torch.Tensor) -> torch.Tensor:
        t_emb = self.time_embedder.proj_out(F.silu(self.time_embedder.proj_in(t_freq)))
        x = torch.cat([self.condition_proj(text), self.video_patch_proj(video)])
        for block in self.blocks:
            x = block(x, t_emb)
        return self.final_layer.video_out(x[text.shape[0]:])


def linears(model: nn.Module) -> list[tuple[str, ops.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ops.Linear)]


def write_lora(model: nn.Module, path: str) -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, layer in linears(model):
        key = "lora_unet_" + name.replace(".", "_")
        tensors[f"{key}.lora_down.weight"] = torch.randn(LORA_RANK, layer.in_features, generator=gen) * 0.01
        tensors[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, LORA_RANK, generator=gen) * 0.01
        tensors[f"{key}.alpha"] = torch.tensor(float(LORA_RANK))
    save_file(tensors, path)


def write_lokr(model: nn.Module, path: str) -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = {}
    for name, layer in linears(model):
        key = "lycoris_" + name.replace(".", "_")
        a = LOKR_FACTOR if layer.out_features % LOKR_FACTOR == 0 else 1
        c = LOKR_FACTOR if layer.in_features % LOKR_FACTOR == 0 else 1
        tensors[f"{key}.lokr_w1"] = torch.randn(a, c, generator=gen) * 0.1
        tensors[f"{key}.lokr_w2_a"] = torch.randn(layer.out_features // a, LORA_RANK, generator=gen) * 0.01
        tensors[f"{key}.lokr_w2_b"] = torch.randn(LORA_RANK, layer.in_features // c, generator=gen) * 0.01
        tensors[f"{key}.alpha"] = torch.tensor(float(LORA_RANK))
    save_file(tensors, path)


def timed(fn) -> tuple[float, object]:
    """(CPU seconds of this process, result) of `fn()` (see `step` for why CPU time)."""
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def step(run, inputs) -> float:
    """CPU seconds this process spent on one forward step.

    Process CPU time rather than wall time: this machine is shared, and other jobs' load stretches
    wall time without changing the work a step does (both threads' time is counted).
    """
    with torch.inference_mode():
        start = time.process_time()
        run(*inputs)
        return time.process_time() - start


def main() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = H3Shaped()
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(3)
    inputs = (torch.randn(TOKENS - 64, 96, generator=gen), torch.randn(64, HIDDEN, generator=gen),
              torch.randn(1, T_EMBED, generator=gen))
    print(f"H3-shaped transformer: {params / 1e6:.0f}M parameters (float32), {len(linears(model))} linears, "
          f"{TOKENS} tokens per step, torch threads {torch.get_num_threads()}")

    base = ModelHandle(model, name="h3-shaped")
    step(base, inputs)  # warm-up
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        for kind, writer in (("lora_r16", write_lora), ("lokr", write_lokr)):
            path = os.path.join(folder, f"{kind}.safetensors")
            writer(model, path)
            load_s, adapter = timed(lambda: load_adapter(path))
            resolve_s, handle = timed(lambda: base.with_adapter(adapter, 1.0))
            merge_s, merged = timed(handle.merged)
            # Base, merged and on-the-fly steps side by side in each round, so a neighbour's load on
            # this shared machine hits all three alike; ratios are taken per round, then the median.
            rounds = [(step(base, inputs), step(merged, inputs), step(handle, inputs)) for _ in range(ROUNDS)]
            row = {"file_mb": os.path.getsize(path) / 1e6, "load_s": load_s, "resolve_s": resolve_s,
                   "merge_s": merge_s, "merge_extra_mb": handle.merge_bytes() / 1e6,
                   "base_step_s": statistics.median(r[0] for r in rounds),
                   "merged_step_s": statistics.median(r[1] for r in rounds),
                   "on_the_fly_step_s": statistics.median(r[2] for r in rounds),
                   "merged_ratio": statistics.median(r[1] / r[0] for r in rounds),
                   "on_the_fly_ratio": statistics.median(r[2] / r[0] for r in rounds),
                   "on_the_fly_extra_s": statistics.median(r[2] - r[0] for r in rounds)}
            # Free the merged copies before the manager run (keeps the peak near 2x the weights).
            handle._merged = None
            del merged
            gc.collect()
            manager = memory.configure(mode="normal", device="cpu", dtype=torch.float32)
            try:
                row["manager_first_step_s"] = step(handle, inputs)
                row["manager_step_s"] = step(handle, inputs)
                row["manager_evictions"] = manager.stats().evictions
            finally:
                memory.unconfigure()
                gc.collect()
            results[kind] = row

    header = (f"{'adapter':<9} {'file MB':>8} {'load s':>7} {'resolve s':>9} {'merge s':>8} {'base step':>10} "
              f"{'merged':>8} {'on the fly':>11} {'extra/step':>11} {'manager 1st':>12} {'then':>7}")
    print(header)
    print("-" * len(header))
    for kind in ("lora_r16", "lokr"):
        r = results[kind]
        print(f"{kind:<9} {r['file_mb']:>8.1f} {r['load_s']:>7.2f} {r['resolve_s']:>9.3f} {r['merge_s']:>8.2f} "
              f"{r['base_step_s']:>8.2f} s {r['merged_ratio']:>7.2f}x {r['on_the_fly_ratio']:>10.2f}x "
              f"{r['on_the_fly_extra_s']:>9.2f} s {r['manager_first_step_s']:>10.2f} s "
              f"{r['manager_step_s']:>5.2f} s")
    print(f"""
All times are CPU seconds of this process (both threads), so other jobs on this shared machine do not
inflate them. merged, on the fly: step time as a ratio to the base step of the same round (median of
{ROUNDS} rounds). on the fly = no memory manager, so every take rebuilds base + delta (what streamed
weights pay); its extra seconds per step do not depend on the token count, so the ratio shrinks as
steps grow. manager = on the fly through a memory manager with room: the patched copy is made at the
first take and then stays resident, so later steps cost what merged costs.""")
    summary = {"params_m": round(params / 1e6, 1), "tokens": TOKENS}
    for kind in ("lora_r16", "lokr"):
        summary[kind] = {k: round(v, 4) for k, v in results[kind].items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
