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
The side path, on the same layout (SIDE_BLOCKS blocks) stored int8-convrot (every Linear int8, Hadamard groups of 256
where they divide the input width, as the released DiT), with a rank-64 LoRA on every Linear stored
bf16 (as the released turbo LoRAs are). One step each, side by side in every round:
  base          no adapter: the int8 product
  side path     the LoRA beside the int8 product (y = Q(W)h + s * B(A h)): what loaders do now
  dequantized   the LoRA added to the dequantized weight at every op, then a float product (the
                route before the side path, kept for DoRA entries)
  merged        the LoRA merged once (dequantize, add, requantize): the base's step, and the
                requantization error it adds, reported
and the resident bytes of the side path (process RSS growth, freed memory handed back first) against
the base's plus the adapter file's (the base's figure includes MKL's GEMM buffers: `warm_float_products`). On float layers, the side path is measured against the take-time
patch held resident by a memory manager (what LoraLoader uses there) and rebuilt per take.
Run: .venv/bin/python bench/adapters.py   (last line: JSON with the figures; --side-only for the int8 part)
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
# The int8 product Weft runs on a CPU (decode into a float32 buffer, then the float32 product; see
# kernels/quantized_linear.py), never its torch.compile'd twin: compiling takes minutes of a shared 2-core
# CPU per shape class, which would swamp a two-minute run. Every route shares that product, so the ratios
# compare what the adapter adds. Set the variable to override (e.g. quantized_linear:int8 for _int_mm).
os.environ.setdefault("WEFT_KERNEL_BACKEND", "quantized_linear:dequantized")

from models import memory, ops  # noqa: E402
from models.adapters import load_adapter  # noqa: E402
from models.patcher import AdapterMode, ModelHandle, patches_active  # noqa: E402
from models.quant.formats.int8 import DEFAULT_ROTATION_GROUP, INT8_TENSORWISE  # noqa: E402

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
    def __init__(self, num_blocks: int = NUM_BLOCKS) -> None:
        super().__init__()
        self.video_patch_proj = ops.Linear(96, HIDDEN)
        self.condition_proj = ops.Linear(HIDDEN, HIDDEN)
        self.time_embedder = nn.Module()
        self.time_embedder.proj_in = ops.Linear(T_EMBED, HIDDEN)
        self.time_embedder.proj_out = ops.Linear(HIDDEN, T_EMBED)
        self.blocks = nn.ModuleList([Block() for _ in range(num_blocks)])
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


SIDE_RANK = 64  # the released turbo LoRAs' rank
SIDE_BLOCKS = 2  # the int8 section's depth: the int8 product is slow on CPUs (a step of 2 blocks takes seconds)
SIDE_TOKENS = 256  # rows per step in the int8 section
SIDE_ROUNDS = 2


def resident_bytes() -> int:
    """This process's resident bytes after a collection, with memory freed by malloc handed back to the system."""
    import ctypes

    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the figure then includes freed memory malloc still holds
        pass
    return int(psutil.Process().memory_info().rss)


def warm_float_products(model: nn.Module, tokens: int, rank: int) -> None:
    """Run, once, float products of the shapes a rank-`rank` side step multiplies (h A^T, then (h A^T) B^T).

    MKL keeps per-thread GEMM buffers from a process's first float products on (about 6 MB here), whatever
    the sizes of the weights. Every H3 job has run float products before its DiT steps (the text encoder,
    the VAEs), so they belong to the base's figure; without this the int8 base step, which runs none,
    would leave them to be counted against the adapter.
    """
    widths = {(layer.in_features, layer.out_features) for layer in model.modules()
              if isinstance(layer, (ops.Linear, ops.QuantizedLinear))}
    with torch.inference_mode():
        for in_features, out_features in sorted(widths):
            middle = F.linear(torch.randn(tokens, in_features), torch.randn(rank, in_features))
            F.linear(middle, torch.randn(out_features, rank))


def quantize_linears(model: nn.Module) -> int:
    """Replace every ops.Linear of `model` by an int8-convrot QuantizedLinear of its weight; returns stored bytes."""
    stored_bytes = 0
    for name, layer in linears(model):
        quant = INT8_TENSORWISE.writer_options(layer.in_features, DEFAULT_ROTATION_GROUP, False)
        stored = INT8_TENSORWISE.encode(layer.weight.detach(), quant)
        twin = ops.QuantizedLinear(layer.in_features, layer.out_features, quant, bias=layer.bias is not None,
                                   tensor_shapes={k: (tuple(v.shape), v.dtype) for k, v in stored.items()})
        with torch.no_grad():
            twin.weight.copy_(stored["weight"])
            twin.weight_scale.copy_(stored["weight_scale"])
            if layer.bias is not None:
                twin.bias.copy_(layer.bias)
        stored_bytes += sum(t.numel() * t.element_size() for t in twin.state_dict().values())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, twin)
    return stored_bytes


def write_lora_bf16(model: nn.Module, path: str, rank: int) -> None:
    """A rank-`rank` LoRA on every Linear (kohya names), stored bf16 like the released turbo LoRAs."""
    gen = torch.Generator().manual_seed(4)
    tensors = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, (ops.Linear, ops.QuantizedLinear)):
            continue
        key = "lora_unet_" + name.replace(".", "_")
        tensors[f"{key}.lora_down.weight"] = (torch.randn(rank, layer.in_features, generator=gen) * 0.01).bfloat16()
        tensors[f"{key}.lora_up.weight"] = (torch.randn(layer.out_features, rank, generator=gen) * 0.01).bfloat16()
        tensors[f"{key}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, path)


def side_path_section(folder: str) -> dict:
    """The int8-convrot model: base, side path, dequantized and merged steps, resident bytes, merge error."""
    before = resident_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = H3Shaped(SIDE_BLOCKS)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    stored_bytes = quantize_linears(model)
    gen = torch.Generator().manual_seed(3)
    inputs = (torch.randn(SIDE_TOKENS - 64, 96, generator=gen), torch.randn(64, HIDDEN, generator=gen),
              torch.randn(1, T_EMBED, generator=gen))
    base = ModelHandle(model, name="h3-shaped-int8")
    step(base, inputs)  # warm-up (and any compiling of the int8 product's stages)
    warm_float_products(model, SIDE_TOKENS, SIDE_RANK)
    base_resident = resident_bytes() - before
    path = os.path.join(folder, "lora_r64_bf16.safetensors")
    write_lora_bf16(model, path, SIDE_RANK)
    file_bytes = os.path.getsize(path)
    adapter = load_adapter(path)
    side = base.with_adapter(adapter, 1.0)
    assert not side.patch_map and len(side.side_map) == len(list(model.modules())) - len(
        [m for m in model.modules() if not isinstance(m, ops.QuantizedLinear)])
    # The route before the side path: the same patches as take-time patches of the quantized layers.
    dequantize_map = {key: {"weight": entries} for key, entries in side.side_map.items()}

    def dequantized(*args):
        with patches_active(dequantize_map):
            return model(*args)

    step(side, inputs)  # warm-up of the side path's shapes
    side_resident = resident_bytes() - before
    step(dequantized, inputs)
    rounds = [(step(base, inputs), step(side, inputs), step(dequantized, inputs)) for _ in range(SIDE_ROUNDS)]
    merge_s, merged = timed(side.merged)
    errors = side.merge_errors().values()
    merged_rounds = [(step(base, inputs), step(merged, inputs)) for _ in range(SIDE_ROUNDS)]
    return {
        "tokens": SIDE_TOKENS, "rank": SIDE_RANK, "file_mb": file_bytes / 1e6, "stored_mb": stored_bytes / 1e6,
        "base_step_s": statistics.median(r[0] for r in rounds),
        "side_step_s": statistics.median(r[1] for r in rounds),
        "dequantized_step_s": statistics.median(r[2] for r in rounds),
        "side_ratio": statistics.median(r[1] / r[0] for r in rounds),
        "dequantized_ratio": statistics.median(r[2] / r[0] for r in rounds),
        "merged_ratio": statistics.median(r[1] / r[0] for r in merged_rounds), "merge_s": merge_s,
        "merge_max_rel_error": max(errors),
        "base_resident_mb": base_resident / 1e6, "side_resident_mb": side_resident / 1e6,
        "resident_ratio": side_resident / (base_resident + file_bytes),
    }


def float_side_section(folder: str, model: nn.Module, inputs) -> dict:
    """A float model: the LoRA on the side path (bypass) against take-time patches, resident and rebuilt per take."""
    path = os.path.join(folder, "lora_r64_float.safetensors")
    write_lora_bf16(model, path, SIDE_RANK)
    adapter = load_adapter(path)
    base = ModelHandle(model, name="h3-shaped")
    take_time = base.with_adapter(adapter, 1.0)
    beside = base.with_adapter(adapter, 1.0, mode=AdapterMode.BYPASS)
    step(beside, inputs)
    manager = memory.configure(mode="normal", device="cpu", dtype=torch.float32)
    try:
        step(take_time, inputs)  # the first take builds the patched copies; later steps reuse them
        rounds = [(step(base, inputs), step(beside, inputs), step(take_time, inputs)) for _ in range(SIDE_ROUNDS)]
        del manager
    finally:
        memory.unconfigure()
        gc.collect()
    rebuilt = [(step(base, inputs), step(take_time, inputs)) for _ in range(2)]
    return {"side_ratio": statistics.median(r[1] / r[0] for r in rounds),
            "take_time_resident_ratio": statistics.median(r[2] / r[0] for r in rounds),
            "take_time_rebuilt_ratio": statistics.median(r[1] / r[0] for r in rebuilt)}


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
    with tempfile.TemporaryDirectory() as folder:
        side = side_path_section(folder)
    print(f"""H3-shaped transformer of {SIDE_BLOCKS} blocks stored int8-convrot, {side['stored_mb']:.0f} MB, \
{side['tokens']} tokens per step; a rank-\
{side['rank']} LoRA on every Linear, {side['file_mb']:.1f} MB bf16
{'route':<26} {'step s':>8} {'vs base':>8}
{'-' * 44}
{'base (no adapter)':<26} {side['base_step_s']:>8.3f} {1.0:>7.2f}x
{'side path':<26} {side['side_step_s']:>8.3f} {side['side_ratio']:>7.2f}x
{'dequantized each op':<26} {side['dequantized_step_s']:>8.3f} {side['dequantized_ratio']:>7.2f}x
{'merged (requantized)':<26} {'':>8} {side['merged_ratio']:>7.2f}x   (merge {side['merge_s']:.1f} s, largest error \
{side['merge_max_rel_error']:.2e} of a layer's largest weight)
resident: base {side['base_resident_mb']:.0f} MB, with the LoRA on the side path {side['side_resident_mb']:.0f} MB = \
{side['resident_ratio']:.3f}x (base + file)
""")
    if "--side-only" in sys.argv:
        print(json.dumps({"int8_side_path": {k: round(v, 4) for k, v in side.items()}}))
        return
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
        float_side = float_side_section(folder, model, inputs)

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
    print(f"float model, rank-{SIDE_RANK} LoRA: side path {float_side['side_ratio']:.2f}x the base step; take-time "
          f"patches held resident {float_side['take_time_resident_ratio']:.2f}x, rebuilt every take "
          f"{float_side['take_time_rebuilt_ratio']:.2f}x")
    summary = {"params_m": round(params / 1e6, 1), "tokens": TOKENS,
               "int8_side_path": {k: round(v, 4) for k, v in side.items()},
               "float_side_path": {k: round(v, 4) for k, v in float_side.items()}}
    for kind in ("lora_r16", "lokr"):
        summary[kind] = {k: round(v, 4) for k, v in results[kind].items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
