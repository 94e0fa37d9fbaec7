"""The default workflow (workflows/h3_t2va.json) on the tiny H3 models: cold and warm runs, per stage.

Cold: a fresh executor and model cache in this process (the models are loaded, one-time imports and
compiles happen). Warm: the same executor with a new seed, so the loaders and the text encoding are
served from the cache and only denoising, decoding and writing run again (median of three runs).
Each stage is one node of the workflow; its wall time and its thread CPU time come from the run's
profile (this machine is shared, so CPU time is the steadier figure). Then the transformer alone:
tokens per second of one forward at three packed sequence lengths (median of several forwards).

    .venv/bin/python bench/h3_pipeline.py

The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

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
    executor = Executor(registry, cache=make_cache("classic"), paths=paths, runtime={})

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


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="weft-h3-bench-") as tmp:
        base = Path(tmp)
        figures = pipeline(base)
        throughput = transformer_throughput(base)
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
    print(json.dumps({"workflow": str(WORKFLOW.relative_to(ROOT)), "torch_threads": torch.get_num_threads(),
                      **figures, "transformer": throughput}))


if __name__ == "__main__":
    main()
