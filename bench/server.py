"""Server benchmark: POST /prompt latency, websocket event delivery, and what the job worker process costs.

    .venv/bin/python bench/server.py

Starts the real server (`python main.py` wiring, built-in nodes, default RAM cache) twice as child
processes on free loopback ports with temporary base folders, plus benchmark nodes: once as shipped
(jobs in a worker process) and once with `--in-process-jobs` (jobs on a thread of the server's
process). Measured side by side in one run:
  - POST /prompt latency (median, p99) for a small cached workflow, 1 client vs 50 concurrent clients
    (each accepted job is fsynced to the SQLite queue before its 200), on the worker server;
  - events per second delivered to 1 vs 100 websocket clients subscribed to all jobs (worker server);
  - per-job time of a cached no-op prompt end to end (POST until the client's websocket says the job
    is over), in-process vs worker: the difference is what the worker process costs per job;
  - GET /queue latency (median, p99) with no job running, and while a CPU-bound node runs, in-process vs
    worker: a pure-Python loop, and a node that holds the interpreter in long native calls (big-integer
    arithmetic).
The last line is one JSON object with the figures.
"""
from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROGRESS_STEPS = 1000  # progress events in the event-delivery job
NOOP_JOBS = 200  # sequential cached jobs per server for the per-job cost
SPIN_SECONDS = 4.0  # how long each CPU-bound job runs while /queue is asked


class BenchProgress:
    """Reports `steps` progress events and nothing else (the event stream under load)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"steps": ("INT", {"default": 100, "min": 1, "max": 1_000_000}),
                             "seed": ("INT", {"default": 0})}}

    RETURN_TYPES = ("INT",)
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "benchmark"

    def run(self, steps, seed):
        from execution.context import current

        ctx = current()
        for step in range(steps):
            ctx.progress(step + 1, steps)
        return {"ui": {"values": [steps]}, "result": (steps,)}


class BenchSpin:
    """Keeps a CPU busy for `seconds`: a pure-Python loop, or long native big-integer products that hold
    the interpreter between check points ("native")."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seconds": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 600.0}),
                             "mode": (["python", "native"],),
                             "seed": ("INT", {"default": 0})}}

    RETURN_TYPES = ("INT",)
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "benchmark"

    def run(self, seconds, mode, seed):
        from execution.context import current

        ctx = current()
        deadline = time.monotonic() + seconds
        count = 0
        big = 3 ** 600_000 + seed
        while time.monotonic() < deadline:
            if mode == "python":
                total = 0
                for i in range(20_000):
                    total += i * i
            else:
                (big * big).bit_length()  # one C call of some tens of ms
            count += 1
            ctx.check_interrupted()
        return {"ui": {"values": [count]}, "result": (count,)}


BENCH_NODES = {"BenchProgress": BenchProgress, "BenchSpin": BenchSpin}


def runtime_with_nodes(args, nodes: dict, module: str):
    """main.Runtime plus benchmark nodes given as classic classes, registered as from `module`."""
    import main as weft_main
    from nodes.classic import specs_from_mappings

    runtime = weft_main.Runtime(args)
    runtime.registry.register_all(specs_from_mappings(nodes, python_module=module), origin=module)
    return runtime


def bench_runtime(args):
    """main.Runtime plus the benchmark nodes (module level: the worker process builds it too)."""
    return runtime_with_nodes(args, BENCH_NODES, "bench.server")


def serve(argv: list[str]) -> int:
    """The child process: Weft's server with the benchmark nodes added."""
    import main as weft_main
    from bench.server import bench_runtime as factory  # by its module name, so the worker can import it
    from web import server

    return server.main(argv, add_common_arguments=weft_main.add_common_arguments, runtime_factory=factory)


# ---------------------------------------------------------------------- measuring (parent process)
SMALL_WORKFLOW = {
    "1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
    "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
}


def percentile(values: list[float], fraction: float) -> float:
    """The value at `fraction` of the sorted values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


async def post_latencies(session, url: str, clients: int, per_client: int) -> tuple[list[float], float]:
    """Seconds per POST /prompt for `clients` concurrent clients, and the wall time."""
    latencies: list[float] = []

    async def one_client():
        for _ in range(per_client):
            started = time.perf_counter()
            async with session.post(url + "/prompt", json={"prompt": SMALL_WORKFLOW}) as response:
                await response.read()
                assert response.status == 200, response.status
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    return latencies, time.perf_counter() - started


async def drain(session, url: str) -> None:
    """Wait until the queue is empty."""
    while True:
        async with session.get(url + "/prompt") as response:
            if (await response.json())["exec_info"]["queue_remaining"] == 0:
                return
        await asyncio.sleep(0.05)


async def event_rate(session, url: str, clients: int, seed: int) -> tuple[int, float]:
    """(events delivered to all clients, seconds) for one BenchProgress job watched by `clients` sockets."""
    import aiohttp

    sockets = [await session.ws_connect(f"{url}/ws?clientId=bench{seed}-{i}&subscribe=all", max_msg_size=0)
               for i in range(clients)]
    for ws in sockets:
        await ws.receive()  # the status greeting
    prompt = {"1": {"class_type": "BenchProgress", "inputs": {"steps": PROGRESS_STEPS, "seed": seed}}}
    counts = [0] * clients

    async def listen(index: int, ws, prompt_id_box: list) -> None:
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if data["type"] == "status":
                continue
            counts[index] += 1
            if data["type"] == "executing" and data["data"]["node"] is None:
                return

    box: list = []
    listeners = [asyncio.ensure_future(listen(i, ws, box)) for i, ws in enumerate(sockets)]
    started = time.perf_counter()
    async with session.post(url + "/prompt", json={"prompt": prompt}) as response:
        assert response.status == 200
    await asyncio.wait_for(asyncio.gather(*listeners), 300)
    elapsed = time.perf_counter() - started
    for ws in sockets:
        await ws.close()
    return sum(counts), elapsed


async def job_times(session, url: str, jobs: int, client_id: str) -> list[float]:
    """Seconds per job, end to end, for `jobs` sequential runs of the cached small workflow."""
    import aiohttp

    times = []
    async with session.ws_connect(f"{url}/ws?clientId={client_id}", max_msg_size=0) as ws:
        await ws.receive()  # the status greeting
        for _ in range(jobs):
            started = time.perf_counter()
            async with session.post(url + "/prompt", json={"prompt": SMALL_WORKFLOW, "client_id": client_id}) as r:
                prompt_id = (await r.json())["prompt_id"]
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(message.data)
                if (data["type"] == "executing" and data["data"].get("node") is None
                        and data["data"].get("prompt_id") == prompt_id):
                    break
            times.append(time.perf_counter() - started)
    return times


async def queue_latencies_during_spin(session, url: str, mode: str, seed: int) -> list[float]:
    """Seconds per GET /queue, asked back to back while one BenchSpin job runs."""
    prompt = {"1": {"class_type": "BenchSpin", "inputs": {"seconds": SPIN_SECONDS, "mode": mode, "seed": seed}}}
    async with session.post(url + "/prompt", json={"prompt": prompt}) as response:
        prompt_id = (await response.json())["prompt_id"]
    while True:  # until it runs
        async with session.get(url + "/queue") as response:
            if [j[1] for j in (await response.json())["queue_running"]] == [prompt_id]:
                break
        await asyncio.sleep(0.01)
    latencies = []
    while True:
        started = time.perf_counter()
        async with session.get(url + "/queue") as response:
            running = (await response.json())["queue_running"]
        latencies.append(time.perf_counter() - started)
        if not running:
            return latencies[:-1] or latencies
        await asyncio.sleep(0.005)


async def measure(url: str, in_process_url: str) -> dict:
    """All figures, measured side by side against the two servers."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for target in (url, in_process_url):  # warm: the workflow's results are cached from here on
            await post_latencies(session, target, 1, 5)
            await drain(session, target)
        single, single_s = await post_latencies(session, url, 1, 200)
        await drain(session, url)
        many, many_s = await post_latencies(session, url, 50, 40)
        await drain(session, url)
        one_events, one_s = await event_rate(session, url, 1, seed=1)
        hundred_events, hundred_s = await event_rate(session, url, 100, seed=2)
        # Alternate rounds so both servers see the same machine load.
        worker_jobs, in_process_jobs = [], []
        for round_index in range(4):
            worker_jobs += await job_times(session, url, NOOP_JOBS // 4, f"noop-w{round_index}")
            in_process_jobs += await job_times(session, in_process_url, NOOP_JOBS // 4, f"noop-i{round_index}")
        queue = {}
        for where, target in (("worker", url), ("in_process", in_process_url)):  # the baseline: no job runs
            idle = []
            for _ in range(200):
                started = time.perf_counter()
                async with session.get(target + "/queue") as response:
                    await response.read()
                idle.append(time.perf_counter() - started)
            queue[(where, "idle")] = idle
        for mode in ("python", "native"):
            queue[("worker", mode)] = await queue_latencies_during_spin(session, url, mode, seed=1)
            queue[("in_process", mode)] = await queue_latencies_during_spin(session, in_process_url, mode, seed=2)
    figures = {
        "post_1_client_median_ms": statistics.median(single) * 1000,
        "post_1_client_p99_ms": percentile(single, 0.99) * 1000,
        "post_1_client_per_s": len(single) / single_s,
        "post_50_clients_median_ms": statistics.median(many) * 1000,
        "post_50_clients_p99_ms": percentile(many, 0.99) * 1000,
        "post_50_clients_per_s": len(many) / many_s,
        "events_1_client_per_s": one_events / one_s,
        "events_100_clients_per_s": hundred_events / hundred_s,
        "events_100_clients_delivered": hundred_events,
        "events_per_job": hundred_events // 100,
        "noop_job_in_process_median_ms": statistics.median(in_process_jobs) * 1000,
        "noop_job_worker_median_ms": statistics.median(worker_jobs) * 1000,
        "noop_job_in_process_mean_ms": statistics.fmean(in_process_jobs) * 1000,
        "noop_job_worker_mean_ms": statistics.fmean(worker_jobs) * 1000,
    }
    figures["worker_overhead_per_job_ms"] = figures["noop_job_worker_median_ms"] - figures["noop_job_in_process_median_ms"]
    for (where, mode), values in queue.items():
        name = "queue_idle" if mode == "idle" else f"queue_during_{mode}_spin"
        figures[f"{name}_{where}_median_ms"] = statistics.median(values) * 1000
        figures[f"{name}_{where}_p99_ms"] = percentile(values, 0.99) * 1000
        figures[f"{name}_{where}_requests"] = len(values)
    return figures


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_child(base: str, extra: list[str], *, script: str = __file__, env: dict | None = None,
                startup_s: float = 180) -> tuple[subprocess.Popen, str, object]:
    """A benchmark server child process (`script --serve ...`); (process, url, log file)."""
    import urllib.request

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(base) / "server.log"
    log = open(log_path, "wb")
    child = subprocess.Popen([sys.executable, script, "--serve", "--port", str(port), "--base-directory", base,
                              *extra], cwd=ROOT, stdout=log, stderr=log, env=env)
    deadline = time.monotonic() + startup_s
    while True:
        try:
            urllib.request.urlopen(url + "/prompt", timeout=2).read()
            return child, url, log
        except OSError:
            if child.poll() is not None or time.monotonic() > deadline:
                log.flush()
                print(log_path.read_text()[-3000:], file=sys.stderr)
                raise SystemExit("the server did not start")
            time.sleep(0.1)


def main() -> int:
    """Start the servers, measure, print the table and the JSON line."""
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve(sys.argv[2:])
    children = []
    with tempfile.TemporaryDirectory(prefix="weft-bench-") as worker_base, \
            tempfile.TemporaryDirectory(prefix="weft-bench-inproc-") as in_process_base:
        try:
            child, url, log = start_child(worker_base, [])
            children.append((child, log))
            child, in_process_url, log = start_child(in_process_base, ["--in-process-jobs"])
            children.append((child, log))
            figures = asyncio.run(measure(url, in_process_url))
        finally:
            for child, log in children:
                child.terminate()
                child.wait(60)
                log.close()
    rows = [
        ("POST /prompt, 1 client", f"{figures['post_1_client_median_ms']:.2f} ms", f"{figures['post_1_client_p99_ms']:.2f} ms",
         f"{figures['post_1_client_per_s']:.0f} /s"),
        ("POST /prompt, 50 clients", f"{figures['post_50_clients_median_ms']:.2f} ms",
         f"{figures['post_50_clients_p99_ms']:.2f} ms", f"{figures['post_50_clients_per_s']:.0f} /s"),
    ]
    print(f"{'measure':<28}{'median':>12}{'p99':>12}{'throughput':>14}")
    for name, median, p99, rate in rows:
        print(f"{name:<28}{median:>12}{p99:>12}{rate:>14}")
    print(f"{'events, 1 ws client':<28}{'':>12}{'':>12}{figures['events_1_client_per_s']:>12.0f}/s")
    print(f"{'events, 100 ws clients':<28}{'':>12}{'':>12}{figures['events_100_clients_per_s']:>12.0f}/s"
          f"   ({figures['events_per_job']} events per client per job)")
    print()
    print(f"{'cached no-op job, end to end':<40}{'in-process':>14}{'worker':>14}{'difference':>14}")
    print(f"{'  median per job':<40}{figures['noop_job_in_process_median_ms']:>11.2f} ms"
          f"{figures['noop_job_worker_median_ms']:>11.2f} ms{figures['worker_overhead_per_job_ms']:>11.2f} ms")
    print(f"{'  mean per job':<40}{figures['noop_job_in_process_mean_ms']:>11.2f} ms"
          f"{figures['noop_job_worker_mean_ms']:>11.2f} ms"
          f"{figures['noop_job_worker_mean_ms'] - figures['noop_job_in_process_mean_ms']:>11.2f} ms")
    print()
    print(f"{'GET /queue while a node computes':<40}{'in-process':>14}{'worker':>14}{'ratio':>14}")
    for mode in ("idle", "python", "native"):
        name = "queue_idle" if mode == "idle" else f"queue_during_{mode}_spin"
        label = "no job running" if mode == "idle" else f"{mode} loop"
        for stat in ("median", "p99"):
            inside = figures[f"{name}_in_process_{stat}_ms"]
            worker = figures[f"{name}_worker_{stat}_ms"]
            print(f"{f'  {label}, {stat}':<40}{inside:>11.2f} ms{worker:>11.2f} ms{inside / max(worker, 1e-9):>13.1f}x")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
