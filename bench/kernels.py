"""The unified Linear per backend as a ratio to a bare matrix product of the same shape, measured side by side.

Backends: eager, compiled, and triton when a CUDA device is present (with bfloat16 there).

Shapes are H3-like: tokens 1024 and 4096, hidden 1024 and 2048 (in = out = hidden), each prologue with
a residual epilogue. Built to give a stable figure on a shared, loaded machine:
  - every backend is compiled (and checked against eager) in a warm-up before any timing;
  - torch uses a fixed thread count (all the cores this process may run on, unless --threads), and
    OpenMP threads sleep rather than spin at barriers (OMP_WAIT_POLICY=PASSIVE unless set or --spin);
  - the bare product and the variants of one shape are timed round-robin, many rounds, with the
    order rotated each round so no variant always runs straight after the same neighbour;
  - each variant's figure is the median over rounds of (its time / the bare product's time in the
    same round), for wall time (perf_counter) and for this process's CPU time (process_time, which
    other processes on the machine disturb much less: time spent descheduled is not counted);
  - the spread (25th..75th percentile of the per-round ratios) is printed to show how noisy it was.
First the target comparison alone (4096 x 1024 x 1024: bare, and the fused backends with the rms_norm
and swiglu prologues; three calls a round, 50 rounds), then every prologue and backend per shape with
fewer rounds, then the cost of being managed: a resident `models.ops.Linear` (weights taken through a
configured memory manager, backend chosen as in production) against a bare `torch.nn.functional.linear`
of the same shape, and against the same backend called directly, at the Linear shapes of the H3 step
bench/dit_step.py measures (goal: managed <= 1.03x bare), plus the fixed cost per call in microseconds.

Run: .venv/bin/python bench/kernels.py [--quick] [--threads N] [--rounds N] [--spin]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--spin" not in sys.argv[1:]:
    # Must be set before torch (and its OpenMP runtime) loads. By default OpenMP threads spin at
    # every barrier; on a machine shared with other busy processes a spinning thread burns the time
    # slice its partner needs and its spin is counted as this process's CPU time. Sleeping instead
    # makes CPU time measure the work. It applies to the bare product and the backends alike.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.linear import LINEAR, linear_eager  # noqa: E402
from kernels.prologues import Prologue  # noqa: E402

PROLOGUES = (None, *Prologue)
MANAGED_TARGET = 1.03  # resident managed Linear / bare F.linear at the H3 step's shapes
# (tokens, in, out) of the H3 step's Linears at the quarter-width config of bench/dit_step.py (1,060 rows):
# the fused q/k/v projection, the attention output, the SwiGLU's first and second products.
H3_STEP_SHAPES = ((1060, 1344, 5376), (1060, 1792, 1344), (1060, 1344, 7168), (1060, 3584, 1344))
TARGET = 1.10  # compiled / bare, rms_norm and swiglu prologues with a residual, 4096 x 1024 x 1024 float32 (CPU)
HEADLINE_SHAPE = (4096, 1024)
HEADLINE_ROUNDS = 50


def make_case(tokens: int, hidden: int, prologue: str | None, device: torch.device, dtype: torch.dtype):
    """x, weight, keyword arguments of one fused call (residual epilogue), all seeded."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    in_features = hidden
    x = randn(tokens, 2 * in_features if prologue == "swiglu" else in_features)
    weight = randn(hidden, in_features) / in_features ** 0.5
    kwargs = dict(prologue=prologue, residual=randn(tokens, hidden))
    if prologue == "rms_norm":
        kwargs["prologue_weight"] = 1 + 0.1 * randn(in_features)
    return x, weight, kwargs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    synchronize(device)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    fn()
    synchronize(device)
    wall1, cpu1 = time.perf_counter(), time.process_time()
    return wall1 - wall0, cpu1 - cpu0


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """25th, 50th and 75th percentiles."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def build_runs(tokens: int, hidden: int, variants: list[tuple[str | None, str]], device: torch.device,
               dtype: torch.dtype) -> dict:
    """The bare product and each (prologue, backend) call of one shape, each warmed up and parity-checked."""
    generator = torch.Generator().manual_seed(1)
    bare_x = torch.randn(tokens, hidden, generator=generator).to(device, dtype)
    bare_w = (torch.randn(hidden, hidden, generator=generator) / hidden ** 0.5).to(device, dtype)
    runs = {"bare": lambda: bare_x @ bare_w.t()}
    cases = {}
    for prologue, name in variants:
        if prologue not in cases:
            x, weight, kwargs = make_case(tokens, hidden, prologue, device, dtype)
            cases[prologue] = (x, weight, kwargs, linear_eager(x, weight, None, **kwargs))
        x, weight, kwargs, reference = cases[prologue]
        run = (lambda x=x, weight=weight, kwargs=kwargs, name=name:
               LINEAR(x, weight, None, backend=name, **kwargs))
        out = run()  # warm-up: compiles, and checks parity before anything is timed
        error = (out.float() - reference.float()).abs().max().item()
        if error > 1e-2 * max(1.0, reference.abs().max().item()):
            raise SystemExit(f"{name} disagrees with eager by {error} at {tokens}x{hidden} {prologue}")
        runs[(prologue, name)] = run
    for run in runs.values():  # a second warm-up call each: allocator and caches settle
        run()
    return runs


def measure(runs: dict, rounds: int, device: torch.device) -> dict:
    """Time `runs` round-robin (order rotated each round); per variant, its ratios to "bare" per round."""
    order = list(runs)
    wall = {key: [] for key in order}
    cpu = {key: [] for key in order}
    gc.disable()  # a collection inside one timed call would land on one variant only
    try:
        for index in range(rounds):
            shift = index % len(order)
            for key in order[shift:] + order[:shift]:
                w, c = timed(runs[key], device)
                wall[key].append(w)
                cpu[key].append(c)
    finally:
        gc.enable()
    stats = {}
    for key in order[1:]:
        wall_ratios = [t / b for t, b in zip(wall[key], wall["bare"])]
        cpu_ratios = [t / b for t, b in zip(cpu[key], cpu["bare"])]
        stats[key] = {"rounds": rounds,
                      "bare_wall_ms": round(statistics.median(wall["bare"]) * 1e3, 3),
                      "bare_cpu_ms": round(statistics.median(cpu["bare"]) * 1e3, 3),
                      "wall_ratio": round(statistics.median(wall_ratios), 4),
                      "wall_ratio_iqr": [round(v, 4) for v in quartiles(wall_ratios)[::2]],
                      "cpu_ratio": round(statistics.median(cpu_ratios), 4),
                      "cpu_ratio_iqr": [round(v, 4) for v in quartiles(cpu_ratios)[::2]],
                      "best_wall_ratio": round(min(wall[key]) / min(wall["bare"]), 4),
                      "_cpu_all": cpu[key]}
    return stats


def managed_overhead(shapes, rounds: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Per shape: a resident managed ops.Linear over bare F.linear, and over its own backend called directly."""
    from models import memory
    from models.ops import Linear

    manager = memory.MemoryManager(device=device, dtype=dtype, mode="highvram")
    rows = []
    for tokens, in_features, out_features in shapes:
        generator = torch.Generator().manual_seed(3)
        layer = Linear(in_features, out_features, bias=True).to(device, dtype).requires_grad_(False)
        x = torch.randn(tokens, in_features, generator=generator).to(device, dtype)
        weight, bias = layer.weight.detach(), layer.bias.detach()
        memory.activate(manager)
        try:
            layer(x)  # warm-up: makes the copy resident, compiles where the backend compiles
            chosen = LINEAR.last_backend
            direct = LINEAR.backend(chosen).fn
            runs = {"bare": lambda: torch.nn.functional.linear(x, weight, bias),
                    "managed": lambda: layer(x),
                    "direct": lambda: direct(x, weight, bias)}
            for run in runs.values():
                run()
            stats = measure(runs, rounds, device)
        finally:
            memory.activate(None)
        managed_vs_direct = [m / d for m, d in zip(stats["managed"]["_cpu_all"], stats["direct"]["_cpu_all"])]
        counters = manager.stats()
        rows.append({"tokens": tokens, "in": in_features, "out": out_features, "backend": chosen,
                     "fast_takes_share": round(counters.fast_takes / max(1, counters.takes), 3),
                     "managed_over_bare_cpu": stats["managed"]["cpu_ratio"],
                     "managed_over_bare_wall": stats["managed"]["wall_ratio"],
                     "managed_over_direct_cpu": round(statistics.median(managed_vs_direct), 4),
                     "bare_cpu_ms": stats["managed"]["bare_cpu_ms"]})
    return rows


def fixed_cost_per_call(device: torch.device, dtype: torch.dtype, calls: int = 3000) -> dict[str, float]:
    """CPU microseconds per call of a 1-row, 64-feature product: bare F.linear and a resident managed Linear."""
    from models import memory
    from models.ops import Linear

    layer = Linear(64, 64).to(device, dtype).requires_grad_(False)
    one = torch.randn(1, 64).to(device, dtype)
    weight, bias = layer.weight.detach(), layer.bias.detach()
    memory.activate(memory.MemoryManager(device=device, dtype=dtype, mode="highvram"))
    try:
        fixed = {}
        for name, run in (("bare", lambda: torch.nn.functional.linear(one, weight, bias)), ("managed", lambda: layer(one))):
            run()
            start = time.process_time()
            for _ in range(calls):
                run()
            fixed[name] = round((time.process_time() - start) / calls * 1e6, 1)
        return fixed
    finally:
        memory.activate(None)


def print_row(tokens: int, hidden: int, prologue: str | None, backend: str, row: dict) -> None:
    wq, cq = row["wall_ratio_iqr"], row["cpu_ratio_iqr"]
    print(f"{tokens:>6} {hidden:>6} {str(prologue):>9} {backend:>9} {row['rounds']:>6} "
          f"{row['bare_wall_ms']:>8.1f} {row['wall_ratio']:>9.3f}x {f'[{wq[0]:.3f}..{wq[1]:.3f}]':>15} "
          f"{row['cpu_ratio']:>9.3f}x {f'[{cq[0]:.3f}..{cq[1]:.3f}]':>15}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only 4096 tokens x 1024 hidden")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the cores this process may use)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"timing rounds of the target comparison (default {HEADLINE_ROUNDS})")
    parser.add_argument("--managed-only", action="store_true",
                        help="only the resident managed Linear against bare F.linear (section 3)")
    parser.add_argument("--spin", action="store_true",
                        help="keep OpenMP's default of spinning at barriers (default here: OMP_WAIT_POLICY=PASSIVE)")
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    headline_rounds = args.rounds or HEADLINE_ROUNDS
    # (shape, rounds) of the full table; larger shapes take longer per round, so get fewer rounds.
    table = [(HEADLINE_SHAPE, 5)] if args.quick else [((1024, 1024), 7), (HEADLINE_SHAPE, 5), ((1024, 2048), 4),
                                                      ((4096, 2048), 3)]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "default (spin)")
    triton_note = LINEAR.backend("triton").unavailable_reason() if device.type == "cuda" else None
    gpu_note = "GPU" if triton_note is None else f"GPU, triton not measured: {triton_note}"
    print(f"device: {device} ({gpu_note if device.type == 'cuda' else 'CPU only: no GPU on this machine, triton not measured'}), "
          f"dtype {str(dtype).removeprefix('torch.')}, torch threads {threads}, OMP_WAIT_POLICY {wait_policy}, "
          f"load average {load:.1f}")
    # triton is measured on a GPU only: on the CPU it exists solely as Triton's interpreter (a test tool).
    backends = ["eager"] + [name for name in LINEAR.names()
                            if name != "eager" and LINEAR.backend(name).unavailable_reason() is None
                            and (name != "triton" or device.type == "cuda")]
    fused = [name for name in backends if name != "eager"]
    print(f"backends measured: {backends}; ratio = backend time / bare product time in the same round, "
          "median over rounds [25th..75th percentile]")
    header = (f"{'tokens':>6} {'hidden':>6} {'prologue':>9} {'backend':>9} {'rounds':>6} {'bare ms':>8} "
              f"{'wall ratio':>10} {'[spread]':>15} {'cpu ratio':>10} {'[spread]':>15}")
    started = time.perf_counter()

    headline, results = {}, []
    if args.managed_only:
        headline_rounds, table = 0, []
    # 1. The target comparison alone (bare, and each fused backend with the rms_norm and swiglu
    #    prologues): three calls a round, so many rounds fit and the medians settle.
    tokens, hidden = HEADLINE_SHAPE
    headline_variants = [(prologue, name) for prologue in ("rms_norm", "swiglu") for name in fused]
    headline_stats = (measure(build_runs(tokens, hidden, headline_variants, device, dtype), headline_rounds, device)
                      if headline_rounds else {})
    if headline_stats:
        print(f"target comparison: {tokens} tokens x {hidden} in x {hidden} out, residual epilogue")
        print(header)
    for (prologue, name), row in headline_stats.items():
        print_row(tokens, hidden, prologue, name, row)
        stem = f"{prologue}_{tokens}x{hidden}x{hidden}_{name}"
        headline[f"{stem}_wall"] = row["wall_ratio"]
        headline[f"{stem}_cpu"] = row["cpu_ratio"]

    # 2. Every prologue and backend per shape, fewer rounds each.
    if table:
        print("all prologues and backends, residual epilogue")
        print(header)
    for (tokens, hidden), rounds in table:
        variants = [(prologue, name) for prologue in PROLOGUES for name in backends]
        stats = measure(build_runs(tokens, hidden, variants, device, dtype), rounds, device)
        for (prologue, name), row in stats.items():
            print_row(tokens, hidden, prologue, name, row)
            results.append({"tokens": tokens, "hidden": hidden, "prologue": prologue, "epilogue": "residual",
                            "backend": name, **{k: v for k, v in row.items() if not k.startswith("_")}})

    # 3. The cost of being managed, at the H3 step's shapes.
    managed_rounds = 5 if args.quick else 15
    managed = managed_overhead(H3_STEP_SHAPES[:1] if args.quick else H3_STEP_SHAPES, managed_rounds, device, dtype)
    print(f"resident managed Linear (models.ops.Linear under a memory manager) at the H3 step's shapes, "
          f"{managed_rounds} rounds; ratios of CPU time, median over rounds")
    print(f"{'tokens':>6} {'in':>5} {'out':>5} {'backend':>9} {'bare ms':>8} {'managed/bare':>13} {'managed/direct':>15} "
          f"{'fast takes':>11}")
    for row in managed:
        print(f"{row['tokens']:>6} {row['in']:>5} {row['out']:>5} {row['backend']:>9} {row['bare_cpu_ms']:>8.1f} "
              f"{row['managed_over_bare_cpu']:>12.3f}x {row['managed_over_direct_cpu']:>14.3f}x "
              f"{row['fast_takes_share']:>10.1%}")
    fixed = fixed_cost_per_call(device, dtype)
    print(f"fixed cost per call (1 row x 64 features, CPU time): bare F.linear {fixed['bare']:.1f} us, "
          f"managed Linear {fixed['managed']:.1f} us")
    managed_met = all(row["managed_over_bare_cpu"] <= MANAGED_TARGET for row in managed)
    print(f"target managed <= {MANAGED_TARGET:.2f}x bare F.linear at every H3 step shape: "
          f"{'met' if managed_met else 'NOT met'}")

    met = {"managed_linear": managed_met}
    if device.type == "cpu" and "compiled" in backends and headline:
        for prologue in ("rms_norm", "swiglu"):
            stem = f"{prologue}_{HEADLINE_SHAPE[0]}x{HEADLINE_SHAPE[1]}x{HEADLINE_SHAPE[1]}_compiled"
            wall_ok = headline[f"{stem}_wall"] <= TARGET
            cpu_ok = headline[f"{stem}_cpu"] <= TARGET
            met[prologue] = {"wall": wall_ok, "cpu": cpu_ok}
            print(f"target compiled <= {TARGET:.2f}x bare, {prologue}+residual 4096x1024x1024 float32: "
                  f"wall {headline[f'{stem}_wall']:.3f}x {'met' if wall_ok else 'NOT met'}, "
                  f"cpu {headline[f'{stem}_cpu']:.3f}x {'met' if cpu_ok else 'NOT met'}")
    print(f"total {time.perf_counter() - started:.0f} s")
    print(json.dumps({"bench": "kernels", "device": str(device), "gpu": device.type == "cuda",
                      "dtype": str(dtype).removeprefix("torch."), "threads": threads, "omp_wait_policy": wait_policy,
                      "load_average": round(load, 2), "target": TARGET, "target_met": met,
                      "headline_rounds": headline_rounds, "headline": headline, "results": results,
                      "managed_target": MANAGED_TARGET, "managed": managed, "fixed_us_per_call": fixed}))


if __name__ == "__main__":
    main()
