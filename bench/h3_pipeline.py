"""The default workflow (workflows/h3_t2va.json) on the tiny H3 models: cold and warm runs, per stage.

Cold: a fresh executor and model cache in this process (the models are loaded, one-time imports and
compiles happen). Warm: the same executor with a new seed, so the loaders and the text encoding are
served from the cache and only denoising, decoding and writing run again (median of three runs).
Each stage is one node of the workflow; its wall time and its thread CPU time come from the run's
profile (this machine is shared, so CPU time is the steadier figure). Then the transformer alone:
tokens per second of one forward at three packed sequence lengths (median of several forwards).

Live previews: the same workflow through the real server (running its jobs in its own process, as
`--in-process-jobs` does) with one websocket client in a process of its own, as a browser is (it
announces `supports_preview_metadata`), alternating jobs with previews off (`extra_data.preview_method: none`)
and at the editor's default method (asked for in `extra_data`, as the editor does), each with a new seed. Sampling time is the sampler node's span in the
engine's event stream, in wall time and in this process's CPU time (every thread: the render thread and
the server's encoding count too; the steadier figure on a shared machine); the ratio default/off is the
goal (<= 1.05); preview frames per second is the number of binary preview frames the client received
over the sampling wall time of the jobs that sent them. From each job's profile (`/jobs/{id}`): the sampler
thread's CPU per step and the render thread's CPU per picture (`preview_cpu_ms` / `preview_pictures`), the
cost of a picture beside that of a step, whatever else the machine runs. A third kind of job in each round asks for `taesd`,
drawn by a tiny taeh3 (models/vae_approx, written for the run): its ratio to off has the goal <= 1.10.
The render thread draws every step it keeps up with (a newer step replaces a picture still waiting, the
last step is always drawn): the frames received are counted per method, out of the steps the jobs ran.
The three kinds run in a rotating order each round. The table also says in how many jobs, and from
which step, the sampler's thread team left the render thread a core (nodes/previews.py, `preview_core` in
the sampler's profile row).

    .venv/bin/python bench/h3_pipeline.py
    .venv/bin/python bench/h3_pipeline.py --only previews --rounds 15   # the preview rounds alone

The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from execution import context as run_context  # noqa: E402
from execution.cache import make_cache  # noqa: E402
from execution.convert import ui_to_api  # noqa: E402
from execution.paths import Paths  # noqa: E402
from execution.scheduler import Executor  # noqa: E402
from execution.validation import validate_prompt  # noqa: E402
from nodes.registry import builtin_registry  # noqa: E402

WORKFLOW = ROOT / "workflows" / "h3_t2va.json"
STAGES = {  # stage -> the node classes it consists of
    "loading": ("UNETLoader", "CLIPLoader", "VAELoader"),
    "text encoding": ("CLIPTextEncode",),
    "denoising": ("SamplerCustomAdvanced",),
    "video decoding": ("VAEDecode",),
    "audio decoding": ("VAEDecodeAudio",),
    "file writing": ("SaveVideo",),
}
WARM_RUNS = 3
PREVIEW_ROUNDS = 7  # side-by-side rounds of jobs (previews off, default method, taesd)
# (frames, width, height) of the three transformer measurements: the workflow's clip, then longer / larger.
SEQUENCES = ((22, 96, 64), (124, 128, 128), (124, 256, 256))


def stage_times(result) -> dict[str, dict[str, float]]:
    """{stage: {"wall_ms", "cpu_ms"}} summed over the stage's executed nodes (cached nodes count 0)."""
    out = {}
    for stage, classes in STAGES.items():
        rows = [r for r in result.profile.values() if r["class_type"] in classes and not r.get("cached")]
        out[stage] = {"wall_ms": sum(r["wall_ms"] for r in rows), "cpu_ms": sum(r["cpu_ms"] for r in rows)}
    known = {c for classes in STAGES.values() for c in classes}
    rest = [r for r in result.profile.values() if r["class_type"] not in known and not r.get("cached")]
    out["other nodes"] = {"wall_ms": sum(r["wall_ms"] for r in rest), "cpu_ms": sum(r["cpu_ms"] for r in rest)}
    return out


def run(executor: Executor, registry, prompt: dict) -> tuple[dict, float]:
    wall0 = time.perf_counter()
    result = executor.run(validate_prompt(prompt, registry), prompt_id=str(uuid.uuid4()))
    wall = time.perf_counter() - wall0
    if result.status != "success":
        raise SystemExit(f"the workflow failed: {json.dumps(result.error, default=repr)[:2000]}")
    return stage_times(result), wall * 1000


def pipeline(base: Path) -> dict:
    from models.h3.make_tiny import write_tiny

    t0 = time.perf_counter()
    write_tiny(base / "models")
    write_ms = (time.perf_counter() - t0) * 1000
    registry = builtin_registry()
    paths = Paths(base).ensure()
    run_context.configure(paths)
    prompt = ui_to_api(json.loads(WORKFLOW.read_text()), registry)
    (noise,) = [n for n, node in prompt.items() if node["class_type"] == "RandomNoise"]
    executor = Executor(registry, cache=make_cache("classic"), paths=paths, runtime=run_context.Services())

    cold, cold_wall = run(executor, registry, prompt)
    warm_runs = []
    for i in range(WARM_RUNS):
        prompt[noise]["inputs"]["noise_seed"] = 1000 + i
        warm_runs.append(run(executor, registry, prompt))
    warm = {stage: {key: statistics.median(r[0][stage][key] for r in warm_runs) for key in ("wall_ms", "cpu_ms")}
            for stage in cold}
    warm_wall = statistics.median(r[1] for r in warm_runs)
    return {"weights_written_ms": write_ms, "cold": cold, "cold_total_wall_ms": cold_wall, "warm": warm,
            "warm_total_wall_ms": warm_wall}


def transformer_throughput(base: Path) -> list[dict]:
    from models.h3 import audio_latent_frames, empty_latent, packing, sigmas
    from models.h3.sampling import make_noise
    from models.loading import load_model
    from models.h3.make_tiny import DEFAULT_NAMES

    model = load_model(str(base / "models" / "diffusion_models" / DEFAULT_NAMES["transformer"])).model
    text = torch.randn(1, 24, model.config.text_dim)
    sigma = float(sigmas(8)[2])
    rows = []
    for frames, width, height in SEQUENCES:
        latent = empty_latent(width, height, frames)
        video, audio = make_noise(latent, 0)
        _, _, lt, lh, lw = video.shape
        seq = packing.build_layout(text.shape[1], lt, lh, lw, audio.shape[-1]).seq_len
        repeats = 5 if seq < 1000 else 3
        times, cpu_times = [], []
        with torch.no_grad():
            model(video, audio, text, sigma, sigma)  # warm-up (first-call allocations, kernel choices)
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                model(video, audio, text, sigma, sigma)
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
        seconds = statistics.median(times)
        rows.append({"frames": frames, "width": width, "height": height, "audio_frames": audio_latent_frames(frames),
                     "tokens": seq, "forward_ms": seconds * 1000, "forward_cpu_ms": statistics.median(cpu_times) * 1000,
                     "tokens_per_s": seq / seconds})
    return rows


def preview_cost(base: Path, rounds: int = PREVIEW_ROUNDS) -> dict:
    """Sampling time with previews off and at the default method, and preview frames per second."""
    return asyncio.run(_preview_rounds(base, rounds))


async def _preview_rounds(base: Path, rounds: int) -> dict:
    import main as weft_main
    from nodes.preview_settings import EDITOR_DEFAULT_METHOD
    from web.server import start_server
    from web.state import ServerConfig

    args = weft_main.server_parser().parse_args(["--base-directory", str(base), "--port", "0", "--cache-classic"])
    runtime = weft_main.Runtime(args)
    prompt = ui_to_api(json.loads(WORKFLOW.read_text()), runtime.registry)
    (noise,) = [n for n, node in prompt.items() if node["class_type"] == "RandomNoise"]
    (sampler,) = [n for n, node in prompt.items() if node["class_type"] == "SamplerCustomAdvanced"]
    (steps,) = [node["inputs"]["steps"] for node in prompt.values() if node["class_type"] == "BasicScheduler"]
    timeline: list[tuple[float, float, str, dict]] = []  # (wall, process CPU, event, data) as the engine emits them
    runtime.events.subscribe(
        lambda event, data: timeline.append((time.perf_counter(), time.process_time(), event, data)))
    server = await start_server(runtime, ServerConfig(port=0))
    from models.h3.tiny_released import TAEH3, taeh3_bytes

    (base / "models" / "vae_approx").mkdir(parents=True, exist_ok=True)
    (base / "models" / "vae_approx" / TAEH3).write_bytes(taeh3_bytes())  # the tiny taeh3 the taesd jobs use
    labels = {"off": {"preview_method": "none"}, "default": {"preview_method": EDITOR_DEFAULT_METHOD},
              "taesd": {"preview_method": "taesd"}}
    # Warm-up first (loading, text encoding, the preview fit, the taeh3 load), then the rounds, each in a
    # rotating order of the three kinds, every job with its own seed.
    jobs = [(1, "warm-up", labels["default"]), (2, "warm-up", labels["taesd"])]
    order = list(labels)
    for i in range(rounds):
        jobs += [(100 + 3 * i + n, label, labels[label]) for n, label in enumerate(order[i % 3:] + order[:i % 3])]
    spec = base / "preview-client.json"
    spec.write_text(json.dumps({"url": f"http://127.0.0.1:{server.port}", "prompt": prompt, "noise": noise,
                                "sampler": sampler, "jobs": jobs}))
    spans: dict[str, list[float]] = {label: [] for label in labels}
    cpu: dict[str, list[float]] = {label: [] for label in labels}
    sampler_cpu: dict[str, list[float]] = {label: [] for label in labels}  # the sampler thread's CPU ms per step
    picture_cpu: dict[str, list[float]] = {label: [] for label in labels}  # the render thread's CPU ms per picture
    core_from_step: dict[str, list[int]] = {label: [] for label in labels}  # the step the render got a core at
    frames_received = 0
    taesd_frames = 0
    try:
        # The client is its own process, as a browser is: receiving and parsing the frames is not the server's
        # work, and in this process it would take Python's lock from the sampler.
        client = await asyncio.create_subprocess_exec(sys.executable, __file__, "--client", str(spec),
                                                      stdout=asyncio.subprocess.PIPE)
        reports, _ = await client.communicate()
        if client.returncode:
            raise SystemExit(f"the preview client failed (exit status {client.returncode})")
    finally:
        await server.stop()
    for line in reports.decode().splitlines():
        job = json.loads(line)
        label = job["label"]
        if label not in labels:
            continue
        span, cpu_span = _sampler_span(timeline, job["prompt_id"], sampler)
        spans[label].append(span)
        cpu[label].append(cpu_span)
        row = job["row"]
        sampler_cpu[label].append(row.get("cpu_ms", 0.0) / steps)
        counts = row.get("counts", {})
        if counts.get("preview_pictures"):
            picture_cpu[label].append(counts["preview_cpu_ms"] / counts["preview_pictures"])
        for given in row.get("notes", {}).get("preview_core", []):
            core_from_step[label].append(given["from_step"])
        if label == "default":
            frames_received += job["previews"]
        elif label == "taesd":
            taesd_frames += job["previews"]
    off, default = statistics.median(spans["off"]), statistics.median(spans["default"])
    cpu_off, cpu_default = statistics.median(cpu["off"]), statistics.median(cpu["default"])
    taesd, cpu_taesd = statistics.median(spans["taesd"]), statistics.median(cpu["taesd"])
    return {"method": EDITOR_DEFAULT_METHOD, "rounds": rounds, "sampling_ms_off": off * 1000,
            "sampling_ms_default": default * 1000, "ratio_default_to_off": default / off,
            "sampling_cpu_ms_off": cpu_off * 1000, "sampling_cpu_ms_default": cpu_default * 1000,
            "cpu_ratio_default_to_off": cpu_default / cpu_off,
            "ratios_per_round": [d / o for o, d in zip(spans["off"], spans["default"])],
            "preview_frames": frames_received,
            "preview_frames_per_s": frames_received / sum(spans["default"]),
            "sampling_ms_taesd": taesd * 1000, "ratio_taesd_to_off": taesd / off,
            "sampling_cpu_ms_taesd": cpu_taesd * 1000, "cpu_ratio_taesd_to_off": cpu_taesd / cpu_off,
            "taesd_ratios_per_round": [t / o for o, t in zip(spans["off"], spans["taesd"])],
            "taesd_preview_frames": taesd_frames, "steps_per_method": steps * rounds,
            "sampler_thread_cpu_ms_per_step": {k: statistics.median(v) for k, v in sampler_cpu.items() if v},
            "render_thread_cpu_ms_per_picture": {k: statistics.median(v) for k, v in picture_cpu.items() if v},
            "jobs_per_method": rounds,
            "render_core_from_step": {k: v for k, v in core_from_step.items() if v}}


async def _client(spec_path: Path) -> None:
    """The preview rounds' websocket client (its own process): runs the jobs in `spec_path` one after another
    and prints one JSON line per job: its label, prompt id, binary preview frames received, profile row."""
    import aiohttp

    spec = json.loads(spec_path.read_text())
    url, prompt = spec["url"], spec["prompt"]
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/ws?clientId=bench") as ws:
            await ws.send_json({"type": "feature_flags", "data": {"supports_preview_metadata": True}})
            for seed, label, extra in spec["jobs"]:
                prompt[spec["noise"]]["inputs"]["noise_seed"] = seed
                body = {"prompt": prompt, "client_id": "bench", "extra_data": extra}
                async with session.post(f"{url}/prompt", json=body) as reply:
                    prompt_id = (await reply.json())["prompt_id"]
                previews = 0
                while True:
                    message = await ws.receive(timeout=600)
                    if message.type == aiohttp.WSMsgType.BINARY and message.data[:4] == b"\x00\x00\x00\x04":
                        previews += 1
                    elif message.type == aiohttp.WSMsgType.TEXT:
                        event = json.loads(message.data)
                        if event["type"] in ("execution_success", "execution_error") and \
                                event["data"].get("prompt_id") == prompt_id:
                            if event["type"] == "execution_error":
                                raise SystemExit(f"the workflow failed: {message.data[:2000]}")
                            break
                async with session.get(f"{url}/jobs/{prompt_id}") as reply:
                    row = ((await reply.json()).get("profile") or {}).get("nodes", {}).get(spec["sampler"], {})
                print(json.dumps({"label": label, "prompt_id": prompt_id, "previews": previews, "row": row}),
                      flush=True)


def _sampler_span(timeline: list, prompt_id: str, sampler: str) -> tuple[float, float]:
    """(wall, process CPU) seconds from the sampler's `executing` to the next `executing` of the same job."""
    start = None
    for moment, cpu_moment, event, data in list(timeline):
        if event != "executing" or data.get("prompt_id") != prompt_id:
            continue
        if data.get("node") == sampler:
            start = (moment, cpu_moment)
        elif start is not None:
            return moment - start[0], cpu_moment - start[1]
    raise SystemExit(f"no sampler span for job {prompt_id}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("previews",), default=None,
                        help="run one section alone (previews: the live-preview rounds through the server)")
    parser.add_argument("--rounds", type=int, default=PREVIEW_ROUNDS,
                        help=f"side-by-side rounds of preview jobs (default {PREVIEW_ROUNDS})")
    parser.add_argument("--client", type=Path, default=None, help=argparse.SUPPRESS)  # the preview rounds' client
    options = parser.parse_args()
    if options.client is not None:
        asyncio.run(_client(options.client))
        return
    with tempfile.TemporaryDirectory(prefix="weft-h3-bench-") as tmp:
        base = Path(tmp)
        if options.only == "previews":
            from models.h3.make_tiny import write_tiny

            write_tiny(base / "models")
            previews = preview_cost(base, options.rounds)
            print_previews(previews)
            print(json.dumps({"workflow": str(WORKFLOW.relative_to(ROOT)), "torch_threads": torch.get_num_threads(),
                              "previews": previews}))
            return
        figures = pipeline(base)
        throughput = transformer_throughput(base)
        previews = preview_cost(base, options.rounds)
    print(f"workflow: {WORKFLOW.relative_to(ROOT)} (tiny random H3 weights; torch threads: {torch.get_num_threads()})")
    print(f"tiny weights written in {figures['weights_written_ms']:.0f} ms")
    print(f"{'stage':<16} {'cold wall ms':>12} {'cold cpu ms':>12} {'warm wall ms':>12} {'warm cpu ms':>12}")
    for stage in figures["cold"]:
        c, w = figures["cold"][stage], figures["warm"][stage]
        print(f"{stage:<16} {c['wall_ms']:>12.1f} {c['cpu_ms']:>12.1f} {w['wall_ms']:>12.1f} {w['cpu_ms']:>12.1f}")
    print(f"{'whole run':<16} {figures['cold_total_wall_ms']:>12.1f} {'':>12} {figures['warm_total_wall_ms']:>12.1f}")
    print(f"warm runs use a new seed (median of {WARM_RUNS}); loading and text encoding come from the cache")
    print()
    print(f"{'transformer input':<28} {'tokens':>7} {'forward ms':>11} {'cpu ms':>9} {'tokens/s':>10}")
    for row in throughput:
        label = f"{row['frames']} frames {row['width']}x{row['height']}"
        print(f"{label:<28} {row['tokens']:>7} {row['forward_ms']:>11.1f} {row['forward_cpu_ms']:>9.1f} "
              f"{row['tokens_per_s']:>10.0f}")
    print()
    print_previews(previews)
    print(json.dumps({"workflow": str(WORKFLOW.relative_to(ROOT)), "torch_threads": torch.get_num_threads(),
                      **figures, "transformer": throughput, "previews": previews}))


def print_previews(previews: dict) -> None:
    print(f"live previews ({previews['method']}), median of {previews['rounds']} side-by-side jobs:")
    print(f"{'sampling ms, previews off':<34} {previews['sampling_ms_off']:>10.1f}")
    print(f"{'sampling ms, default method':<34} {previews['sampling_ms_default']:>10.1f}")
    print(f"{'ratio default / off (goal <= 1.05)':<34} {previews['ratio_default_to_off']:>10.3f}")
    print(f"{'CPU ms, previews off':<34} {previews['sampling_cpu_ms_off']:>10.1f}")
    print(f"{'CPU ms, default method':<34} {previews['sampling_cpu_ms_default']:>10.1f}")
    print(f"{'CPU ratio default / off':<34} {previews['cpu_ratio_default_to_off']:>10.3f}")
    print(f"{'preview frames/s to one client':<34} {previews['preview_frames_per_s']:>10.1f}")
    print(f"{'default preview frames received':<34} {previews['preview_frames']:>10d} "
          f"of {previews['steps_per_method']} steps")
    print(f"{'sampling ms, taesd (taeh3)':<34} {previews['sampling_ms_taesd']:>10.1f}")
    print(f"{'ratio taesd / off (goal <= 1.10)':<34} {previews['ratio_taesd_to_off']:>10.3f}")
    print(f"{'CPU ratio taesd / off':<34} {previews['cpu_ratio_taesd_to_off']:>10.3f}")
    print(f"{'taesd preview frames received':<34} {previews['taesd_preview_frames']:>10d} "
          f"of {previews['steps_per_method']} steps")
    for label, steps in previews["render_core_from_step"].items():
        print(f"{label} jobs whose sampler left the render thread a core: {len(steps)} of "
              f"{previews['jobs_per_method']} (from step {min(steps)} to {max(steps)})")
    print("CPU ms of the sampler's thread per step, and of the render thread per picture (profile counts):")
    for label, per_step in previews["sampler_thread_cpu_ms_per_step"].items():
        picture = previews["render_thread_cpu_ms_per_picture"].get(label)
        print(f"  {label:<8} {per_step:>8.2f} per step" + (f" {picture:>8.2f} per picture" if picture else ""))


if __name__ == "__main__":
    main()
