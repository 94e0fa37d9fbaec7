"""Server benchmark: POST /prompt latency under concurrency, and websocket event delivery to many clients.

    .venv/bin/python bench/server.py

Starts the real server (`python main.py` wiring, built-in nodes, default RAM cache) as a child process on
a free loopback port with a temporary base folder, plus one benchmark node that only reports progress.
Measured side by side in one run:
  - POST /prompt latency (median, p99) for a small cached workflow, 1 client vs 50 concurrent clients
    (each accepted job is fsynced to the SQLite queue before its 200);
  - events per second delivered to 1 vs 100 websocket clients subscribed to all jobs.
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


def serve(argv: list[str]) -> int:
    """The child process: Weft's server with the benchmark node added."""
    import main as weft_main
    from nodes.classic import specs_from_mappings
    from web import server

    def runtime_factory(args):
        runtime = weft_main.Runtime(args)
        runtime.registry.register_all(specs_from_mappings({"BenchProgress": BenchProgress}, python_module="bench.server"),
                                      origin="bench.server")
        return runtime

    return server.main(argv, add_common_arguments=weft_main.add_common_arguments, runtime_factory=runtime_factory)


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


async def measure(url: str) -> dict:
    """All figures, measured side by side against one server."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await post_latencies(session, url, 1, 5)  # warm: the workflow's results are cached from here on
        await drain(session, url)
        single, single_s = await post_latencies(session, url, 1, 200)
        await drain(session, url)
        many, many_s = await post_latencies(session, url, 50, 40)
        await drain(session, url)
        one_events, one_s = await event_rate(session, url, 1, seed=1)
        hundred_events, hundred_s = await event_rate(session, url, 100, seed=2)
    return {
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
    }


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    """Start the server, measure, print the table and the JSON line."""
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve(sys.argv[2:])
    import urllib.request

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="weft-bench-") as base:
        log = open(Path(base) / "server.log", "wb")
        child = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port), "--base-directory", base],
                                 cwd=ROOT, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(url + "/prompt", timeout=2).read()
                    break
                except OSError:
                    if child.poll() is not None or time.monotonic() > deadline:
                        log.flush()
                        print((Path(base) / "server.log").read_text()[-2000:], file=sys.stderr)
                        raise SystemExit("the server did not start")
                    time.sleep(0.1)
            figures = asyncio.run(measure(url))
        finally:
            child.terminate()
            child.wait(30)
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
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
