"""VSA block-sparse attention (keep 10%) against dense SDPA: time and peak memory, side by side.

One self-attention call per method at 12,288, 24,576 and 49,152 tokens (head_dim 128, a few heads,
batch 1, float32 on the CPU; bfloat16 on a GPU when one is present). The VSA call has what an H3 call
has: four prefix tiles (text and audio rows) as exact sinks with dense query rows, no pooled tail,
and the gated coarse branch.

Each CPU measurement runs in a fresh child process, so its memory high-water mark is its own: peak
memory is the growth of the process's peak resident set over what it held once the inputs existed
(the output included). A small warm-up call runs first in the same child. Time is wall time and the
child's CPU time. The children keep OpenMP's default wait policy, as Weft's runtime does: idle
threads spin briefly between operations, so CPU time includes that spinning. `--passive` runs them
with OMP_WAIT_POLICY=PASSIVE instead (CPU time then measures the work, but every operation pays a
thread wake-up, which charges VSA's many small operations and not dense SDPA's one). On a GPU the peak is
torch.cuda.max_memory_allocated above the inputs, measured in this process after a warm-up.

Run: .venv/bin/python bench/sparse_attention.py [--heads N] [--tokens 12288,24576,49152] [--threads N] [--passive]
Goal at 49,152 tokens: VSA time <= 0.35x dense, VSA peak memory below dense.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.attention import SPARSE_TILE, block_sparse_attention  # noqa: E402

HEAD_DIM = 128
KEEP = 0.10
PREFIX_TILES = 4
TOKENS = (12288, 24576, 49152)
GOAL_TIME_RATIO = 0.35


def make_inputs(tokens: int, heads: int, device: str, dtype: torch.dtype):
    """Seeded q, k, v and the coarse gate, (1, heads, tokens, 128)."""
    generator = torch.Generator().manual_seed(tokens)
    return [torch.randn(1, heads, tokens, HEAD_DIM, generator=generator).to(device, dtype) for _ in range(4)]


def run_method(method: str, q, k, v, gate):
    if method == "dense":
        return F.scaled_dot_product_attention(q, k, v)
    prefix = (0, PREFIX_TILES)
    return block_sparse_attention(q, k, v, keep_ratio=KEEP, sink_blocks=prefix, sink_rows=prefix,
                                  pooled_tail=False, coarse_gate=gate)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(method: str, tokens: int, heads: int, threads: int) -> None:
    """One CPU measurement; prints one JSON line."""
    torch.set_num_threads(threads)
    run_method(method, *make_inputs(4 * SPARSE_TILE * 4, heads, "cpu", torch.float32))   # warm-up
    inputs = make_inputs(tokens, heads, "cpu", torch.float32)
    before = max(_resident_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    wall, cpu = time.perf_counter(), time.process_time()
    out = run_method(method, *inputs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert torch.isfinite(out).all()
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_bytes": max(0, peak - before)}))


def measure_cpu(method: str, tokens: int, heads: int, threads: int, passive: bool) -> dict:
    command = [sys.executable, __file__, "--child", method, "--tokens", str(tokens), "--heads", str(heads),
               "--threads", str(threads)]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE") if passive else None
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_gpu(method: str, tokens: int, heads: int) -> dict:
    inputs = make_inputs(tokens, heads, "cuda", torch.bfloat16)
    run_method(method, *inputs)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    wall = time.perf_counter()
    out = run_method(method, *inputs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    assert torch.isfinite(out).all()
    return {"wall_s": wall, "cpu_s": None, "peak_bytes": torch.cuda.max_memory_allocated() - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--passive", action="store_true", help="run the children with OMP_WAIT_POLICY=PASSIVE")
    parser.add_argument("--child", choices=("dense", "vsa"))
    args = parser.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    if args.child:
        child(args.child, sizes[0], args.heads, args.threads)
        return

    started = time.perf_counter()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"VSA keep {KEEP:.0%} vs dense SDPA, head_dim {HEAD_DIM}, {args.heads} heads, batch 1; "
          f"cpu: float32, {args.threads} threads, OMP_WAIT_POLICY {'PASSIVE' if args.passive else 'default'}, "
          "one child process per call")
    print(f"{'device':6} {'tokens':>7} {'dense s':>9} {'vsa s':>9} {'time x':>7} {'cpu time x':>10} "
          f"{'dense MiB':>10} {'vsa MiB':>9} {'memory x':>9}")
    rows = []
    for device in devices:
        for tokens in sizes:
            if device == "cpu":
                dense = measure_cpu("dense", tokens, args.heads, args.threads, args.passive)
                vsa = measure_cpu("vsa", tokens, args.heads, args.threads, args.passive)
            else:
                dense, vsa = measure_gpu("dense", tokens, args.heads), measure_gpu("vsa", tokens, args.heads)
            row = {"device": device, "tokens": tokens, "heads": args.heads, "dense": dense, "vsa": vsa,
                   "time_ratio": vsa["wall_s"] / dense["wall_s"],
                   "cpu_time_ratio": vsa["cpu_s"] / dense["cpu_s"] if dense["cpu_s"] else None,
                   "memory_ratio": vsa["peak_bytes"] / max(1, dense["peak_bytes"])}
            rows.append(row)
            cpu_ratio = f"{row['cpu_time_ratio']:.3f}" if row["cpu_time_ratio"] is not None else "-"
            print(f"{device:6} {tokens:7d} {dense['wall_s']:9.2f} {vsa['wall_s']:9.2f} {row['time_ratio']:7.3f} "
                  f"{cpu_ratio:>10} {dense['peak_bytes'] / 2**20:10.1f} {vsa['peak_bytes'] / 2**20:9.1f} "
                  f"{row['memory_ratio']:9.3f}")
    goals = {}
    for row in rows:
        if row["tokens"] == max(sizes):
            goals[row["device"]] = {"time": row["time_ratio"] <= GOAL_TIME_RATIO,
                                    "memory": row["vsa"]["peak_bytes"] < row["dense"]["peak_bytes"]}
            print(f"goal at {row['tokens']} tokens on {row['device']}: time {row['time_ratio']:.3f}x "
                  f"(<= {GOAL_TIME_RATIO}) {'met' if goals[row['device']]['time'] else 'NOT met'}; peak memory "
                  f"{row['memory_ratio']:.3f}x {'met' if goals[row['device']]['memory'] else 'NOT met'}")
    print(f"total {time.perf_counter() - started:.0f} s")
    print(json.dumps({"bench": "sparse_attention", "keep": KEEP, "head_dim": HEAD_DIM, "heads": args.heads,
                      "threads": args.threads, "omp_wait_policy": "PASSIVE" if args.passive else "default",
                      "goal_time_ratio": GOAL_TIME_RATIO, "goals_met": goals, "results": rows}))


if __name__ == "__main__":
    main()
