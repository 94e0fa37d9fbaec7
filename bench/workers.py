"""Worker-pool benchmark: throughput of short CPU-bound jobs on 1 and 2 Ray workers against the
single-process server, and what the Ray dispatch path adds to each job.

    .venv/bin/python bench/workers.py [--jobs 40] [--rounds 2]

Starts three servers as child processes (`python main.py` wiring, built-in nodes plus a benchmark
node, temporary base folders, loopback ports), every compute thread count set to one
(OMP_NUM_THREADS=1 and --worker-threads 1, so each worker uses one core):
  - "single": as shipped, jobs in one local worker process;
  - "ray-1":  --workers 1, a local Ray instance with one worker actor;
  - "ray-2":  --workers 2, two worker actors.
Measured side by side in one run, the servers taking turns (`--rounds` times, the best round kept):
  - throughput: 40 jobs (200 torch products of 320x320 matrices, ~0.3 s each on one thread, each
    with its own seed so none is cached) posted at once, from the first POST to the last job's record;
    and the mean number of jobs running at once (their summed run times over the wall time), which
    shows whether the workers ran side by side however busy the machine is, and each job's CPU
    time over its wall time (below 100%: other processes took the cores);
  - dispatch latency: per-job time, end to end (POST until the client's websocket says the job is
    over), of a cached no-op prompt run one after the other; ray-1 minus single is what the Ray path
    adds per job.
The last line is one JSON object with the figures. The goals on a 2-core machine: >= 1.7x jobs/s from
ray-1 to ray-2, and <= 20 ms added per job.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.server import drain, job_times, percentile, runtime_with_nodes  # noqa: E402
from bench.server import start_child as start_server_child  # noqa: E402

NOOP_JOBS = 60  # sequential cached jobs per server per round
SETUPS = {"single": [], "ray-1": ["--workers", "1", "--worker-threads", "1"],
          "ray-2": ["--workers", "2", "--worker-threads", "1"]}


class BenchMatmul:
    """A CPU-bound job: `repeats` products of a `size`x`size` matrix with torch (one thread per worker)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"size": ("INT", {"default": 320, "min": 8, "max": 4096}),
                             "repeats": ("INT", {"default": 40, "min": 1, "max": 10_000}),
                             "seed": ("INT", {"default": 0})}}

    RETURN_TYPES = ("FLOAT",)
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "benchmark"

    def run(self, size, repeats, seed):
        import torch

        from execution.context import current

        ctx = current()
        generator = torch.Generator().manual_seed(seed)
        a = torch.rand(size, size, generator=generator)
        b = torch.rand(size, size, generator=generator)
        for _ in range(repeats):
            a = torch.tanh(a @ b)
            ctx.check_interrupted()
        total = float(a.sum())
        return {"ui": {"values": [total]}, "result": (total,)}


def bench_runtime(args):
    """main.Runtime plus the benchmark node (module level: the workers build it too)."""
    return runtime_with_nodes(args, {"BenchMatmul": BenchMatmul}, "bench.workers")


def serve(argv: list[str]) -> int:
    """The child process: Weft's server with the benchmark node, with the pool its flags ask for."""
    import main as weft_main
    from bench.workers import bench_runtime as factory  # by its module name, so workers can import it
    from web import server

    parser = weft_main.server_parser()
    args = parser.parse_args(argv)
    return server.serve(parser, args, factory, worker_pool=weft_main.worker_pool_from_args(parser, args))


# ---------------------------------------------------------------------- measuring (parent process)
def start_child(base: str, extra: list[str]) -> tuple[subprocess.Popen, str, object]:
    """A benchmark server child process of this script, with one compute thread; (process, url, log file)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return start_server_child(base, ["--preview-method", "none", *extra], script=__file__, env=env, startup_s=300)


REPEATS = 200  # ~0.3 s per job on one core of this machine: the dispatch path is a few percent of it


def matmul_prompt(seed: int) -> dict:
    return {"1": {"class_type": "BenchMatmul", "inputs": {"size": 320, "repeats": REPEATS, "seed": seed}}}


async def throughput(session, url: str, jobs: int, first_seed: int) -> tuple[float, float, float]:
    """(jobs per second, mean number of jobs running at once, CPU share of a job's node) for `jobs`
    uncached CPU-bound jobs posted at once. The last two do not depend on how busy the machine is
    the same way: jobs at once shows whether the workers ran side by side, the CPU share (node CPU
    time over its wall time) how much of a core each got."""
    started = time.perf_counter()
    ids = []
    for index in range(jobs):
        async with session.post(url + "/prompt", json={"prompt": matmul_prompt(first_seed + index)}) as response:
            assert response.status == 200, await response.text()
            ids.append((await response.json())["prompt_id"])
    await drain(session, url)
    elapsed = time.perf_counter() - started
    async with session.get(url + f"/history?max_items={jobs + 100}") as response:
        history = await response.json()
    failed = [i for i in ids if history.get(i, {}).get("status", {}).get("status_str") != "success"]
    if failed:
        raise SystemExit(f"{url}: {len(failed)} of {jobs} jobs did not succeed, e.g. {history.get(failed[0])}")
    running_ms, cpu_ms, wall_ms = 0, 0.0, 0.0
    for prompt_id in ids:
        async with session.get(url + f"/jobs/{prompt_id}") as response:
            detail = await response.json()
        running_ms += detail["execution_end_time"] - detail["execution_start_time"]
        cpu_ms += detail["profile"]["nodes"]["1"]["cpu_ms"]
        wall_ms += detail["profile"]["nodes"]["1"]["wall_ms"]
    return jobs / elapsed, running_ms / 1000 / elapsed, cpu_ms / max(wall_ms, 1e-9)


async def warm(session, url: str, workers: int, seed: int) -> None:
    """Every worker up with torch loaded and the no-op prompt cached."""
    for index in range(workers * 2):
        async with session.post(url + "/prompt", json={"prompt": matmul_prompt(seed + index)}) as response:
            assert response.status == 200
    await drain(session, url)
    await job_times(session, url, 3, f"warm-{seed}")


async def measure(urls: dict[str, str], jobs: int, rounds: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for index, (name, url) in enumerate(urls.items()):
            await warm(session, url, 2 if name == "ray-2" else 1, seed=10_000 * (index + 1))
        rates: dict[str, list[float]] = {name: [] for name in urls}
        at_once: dict[str, list[float]] = {name: [] for name in urls}
        cpu_share: dict[str, list[float]] = {name: [] for name in urls}
        latencies: dict[str, list[float]] = {name: [] for name in urls}
        for round_index in range(rounds):  # taking turns, so every setup sees the same machine load
            for index, (name, url) in enumerate(urls.items()):
                seed = 1_000_000 * (round_index + 1) + 1000 * index
                rate, concurrency, share = await throughput(session, url, jobs, seed)
                rates[name].append(rate)
                at_once[name].append(concurrency)
                cpu_share[name].append(share)
                latencies[name] += await job_times(session, url, NOOP_JOBS, f"noop-{name}-{round_index}")
    figures: dict = {"jobs": jobs, "rounds": rounds, "cpu_count": os.cpu_count()}
    for name in urls:
        key = name.replace("-", "")
        figures[f"{key}_jobs_per_s"] = max(rates[name])
        figures[f"{key}_jobs_per_s_rounds"] = [round(r, 3) for r in rates[name]]
        figures[f"{key}_jobs_at_once"] = max(at_once[name])
        figures[f"{key}_job_cpu_share"] = statistics.fmean(cpu_share[name])
        figures[f"{key}_noop_median_ms"] = statistics.median(latencies[name]) * 1000
        figures[f"{key}_noop_p90_ms"] = percentile(latencies[name], 0.9) * 1000
    figures["speedup_ray1_to_ray2"] = figures["ray2_jobs_per_s"] / figures["ray1_jobs_per_s"]
    figures["speedup_single_to_ray2"] = figures["ray2_jobs_per_s"] / figures["single_jobs_per_s"]
    figures["ray_dispatch_added_ms_per_job"] = figures["ray1_noop_median_ms"] - figures["single_noop_median_ms"]
    return figures


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve(sys.argv[2:])
    parser = argparse.ArgumentParser(description="Worker-pool throughput and dispatch latency.")
    parser.add_argument("--jobs", type=int, default=40, help="CPU-bound jobs per throughput run (default 40)")
    parser.add_argument("--rounds", type=int, default=2, help="turns each setup gets; the best is kept (default 2)")
    options = parser.parse_args()
    children = []
    bases = {name: tempfile.mkdtemp(prefix=f"weft-bench-{name}-") for name in SETUPS}
    try:
        urls = {}
        for name, extra in SETUPS.items():
            child, url, log = start_child(bases[name], extra)
            children.append((child, log))
            urls[name] = url
        figures = asyncio.run(measure(urls, options.jobs, options.rounds))
    finally:
        for child, log in children:
            child.terminate()
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
            log.close()
        import shutil

        for base in bases.values():
            shutil.rmtree(base, ignore_errors=True)
    print(f"{options.jobs} CPU-bound jobs posted at once (one compute thread per worker), best of {options.rounds}")
    print(f"{'setup':<10}{'jobs/s':>10}{'vs single':>12}{'jobs at once':>14}{'CPU per job':>13}"
          f"{'no-op job median':>20}{'p90':>12}")
    for name in SETUPS:
        key = name.replace("-", "")
        rate = figures[f"{key}_jobs_per_s"]
        print(f"{name:<10}{rate:>10.2f}{rate / figures['single_jobs_per_s']:>11.2f}x{figures[f'{key}_jobs_at_once']:>14.2f}"
              f"{figures[f'{key}_job_cpu_share']:>12.0%}"
              f"{figures[f'{key}_noop_median_ms']:>17.2f} ms{figures[f'{key}_noop_p90_ms']:>9.2f} ms")
    print("(CPU per job: a job's CPU time over its wall time; below 100% the machine was busy with other work)")
    print(f"ray-1 -> ray-2 throughput: {figures['speedup_ray1_to_ray2']:.2f}x (goal >= 1.7x)")
    print(f"added by the Ray dispatch path per cached no-op job: {figures['ray_dispatch_added_ms_per_job']:.2f} ms "
          "(goal <= 20 ms)")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
