"""Loops: 100, 1,000 and 5,000 iterations of a 5-node body, side by side.

The body (built-in nodes): a 64x64 image colored by the iteration index -> scaled to 96x96 ->
scaled to 48x48 -> its size -> the carried sum plus its width (the carried value and the loop's
output). Every iteration makes and drops about 170 KB of image tensors, so a loop that kept its
iterations would grow by that much per iteration. The cache is off (`--cache-none`) and `cache_iterations` false:
what is measured is the loop, not what a cache chooses to keep.

Each count runs in a fresh process (peak RSS is a process high-water mark), after a 20-iteration
warm-up. Figures per count:
  - time per iteration: process CPU time of the run (the machine is shared) divided by the count;
    wall time beside it; torch runs on one thread (the tensors are tiny);
  - peak RSS: the process high-water mark (ru_maxrss) after the run, and its growth during the run
    over the RSS before it;
  - Python heap peak: tracemalloc's peak during a second run of the same prompt (tensor storage is
    allocated outside Python's allocator and is not in this figure; RSS has it), and the same less
    the engine's record of the run (JobResult.executed: one id string per node run, which grows
    with the count by design). The rest rises until about 585 iterations (4,096 node runs) and then
    stays flat: the cyclic collector is paused during a run and the engine collects its young
    generation every 4,096 node runs, so a shorter run never collects.
The targets: at 5,000 iterations, time per iteration and peak RSS within 1.5x of 100 iterations.
The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COUNTS = (100, 1000, 5000)
WARMUP = 20


def loop_prompt(count: int) -> dict:
    """A loop of `count` iterations over a 5-node body, its final carried sum previewed."""
    return {
        "init": {"class_type": "PrimitiveInt", "inputs": {"value": 0}},
        "start": {"class_type": "StartLoop", "inputs": {"mode": "simple", "mode.num_iterations": count,
                                                        "cache_iterations": False,
                                                        "initial_iteration_value": ["init", 0]}},
        "image": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1,
                                                         "color": ["start", 0]}},
        "scaled": {"class_type": "ImageScale", "inputs": {"image": ["image", 0], "upscale_method": "bilinear",
                                                          "width": 96, "height": 96, "crop": "disabled"}},
        "small": {"class_type": "ImageScale", "inputs": {"image": ["scaled", 0], "upscale_method": "bilinear",
                                                         "width": 48, "height": 48, "crop": "disabled"}},
        "size": {"class_type": "GetImageSize", "inputs": {"image": ["small", 0]}},
        "sum": {"class_type": "ComfyMathExpression",
                "inputs": {"expression": "a + b", "values.a": ["start", 4], "values.b": ["size", 0]}},
        "end": {"class_type": "EndLoop", "inputs": {"output_value": ["sum", 1], "next_iteration_value": ["sum", 1],
                                                    "accumulate": False}},
        "show": {"class_type": "PreviewAny", "inputs": {"source": ["end", 0]}},
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_one(count: int) -> dict:
    """Run the loop of `count` iterations in this process; returns its figures."""
    from execution.cache import make_cache
    from execution.paths import Paths
    from execution.scheduler import Executor
    from execution.validation import validate_prompt
    from nodes.registry import builtin_registry

    import torch

    torch.set_num_threads(1)  # tiny tensors: extra threads only add spinning to the CPU time measured
    registry = builtin_registry()
    executor = Executor(registry, cache=make_cache("none"), paths=Paths(tempfile.mkdtemp()).ensure())

    def run() -> tuple:
        validated = validate_prompt(loop_prompt(count), registry)
        result = executor.run(validated, prompt_id=str(uuid.uuid4()))
        if result.status != "success":
            raise RuntimeError(f"loop of {count} failed: {result.error}")
        return result, validated

    warm = validate_prompt(loop_prompt(WARMUP), registry)
    executor.run(warm, prompt_id="warm-up")
    del warm
    rss_before = _rss_bytes()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    result, validated = run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    expected = 48 * count
    shown = result.outputs["show"]["text"][0]
    if shown != str(expected):
        raise RuntimeError(f"loop of {count} gave {shown}, expected {expected}")
    executed = len(result.executed)
    graph_after = len(validated.prompt.nodes)
    del result, validated
    tracemalloc.start()
    result, _ = run()
    _, heap_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # The engine's record of the run: one id string per node run (JobResult.executed).
    record = sys.getsizeof(result.executed) + sum(sys.getsizeof(node_id) for node_id in result.executed)
    return {
        "iterations": count, "nodes_run": executed, "graph_nodes_after": graph_after,
        "cpu_us_per_iteration": cpu / count * 1e6, "wall_us_per_iteration": wall / count * 1e6,
        "peak_rss_mb": peak_rss / 2**20, "rss_growth_mb": max(0, peak_rss - rss_before) / 2**20,
        "python_heap_peak_mb": heap_peak / 2**20, "run_record_mb": record / 2**20,
        "python_heap_peak_without_record_mb": (heap_peak - record) / 2**20,
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure_one(int(sys.argv[2]))))
        return
    rows = []
    for count in COUNTS:
        done = subprocess.run([sys.executable, __file__, "--one", str(count)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"the {count}-iteration run failed")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'iterations':>10} {'nodes run':>10} {'cpu us/iter':>12} {'wall us/iter':>13} {'peak RSS MB':>12} "
          f"{'RSS growth MB':>14} {'py heap peak MB':>16} {'run record MB':>14} {'heap - record MB':>17}")
    for row in rows:
        print(f"{row['iterations']:>10} {row['nodes_run']:>10} {row['cpu_us_per_iteration']:>12.0f} "
              f"{row['wall_us_per_iteration']:>13.0f} {row['peak_rss_mb']:>12.1f} {row['rss_growth_mb']:>14.1f} "
              f"{row['python_heap_peak_mb']:>16.2f} {row['run_record_mb']:>14.2f} "
              f"{row['python_heap_peak_without_record_mb']:>17.2f}")
    small, large = rows[0], rows[-1]
    ratios = {
        "time_per_iteration_5000_vs_100": large["cpu_us_per_iteration"] / small["cpu_us_per_iteration"],
        "peak_rss_5000_vs_100": large["peak_rss_mb"] / small["peak_rss_mb"],
        "python_heap_peak_5000_vs_100": large["python_heap_peak_mb"] / small["python_heap_peak_mb"],
        "python_heap_peak_without_record_5000_vs_100":
            large["python_heap_peak_without_record_mb"] / small["python_heap_peak_without_record_mb"],
    }
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    print(f"live graph after each run: {[row['graph_nodes_after'] for row in rows]} nodes (the prompt's 9)")
    targets = {"time_per_iteration_within_1.5x": ratios["time_per_iteration_5000_vs_100"] <= 1.5,
               "peak_rss_within_1.5x": ratios["peak_rss_5000_vs_100"] <= 1.5}
    print(json.dumps({"rows": rows, "ratios": ratios, "targets_met": targets}))


if __name__ == "__main__":
    main()
