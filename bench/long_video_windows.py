"""Long H3 clips: each case against a single pass of the same length, side by side in one run.

Cases (a list; each is a function returning its table rows and its figures):
- case_windowed: by default a 107-frame clip (32 latent frames, 4.5 s; `--frames` for longer) sampled in context windows of 17 latent frames
  overlapping by 4 (ContextWindowsManual's defaults otherwise: standard_static, pyramid, causal anchor), against
  one pass over the whole clip; and the peak of the same windows over a clip twice as long. The transformer is an H3-shaped model of random weights, wider than the tiny
  one (width 256, 4 heads of 64, 2 blocks) so that its activations, not Python, set the memory peak.

Figures per variant: wall time (median over alternating rounds in this process), peak memory while sampling
(in a fresh process per variant, after one unmeasured run of the same variant: on a CPU, the resident
size's high point during the run, read every millisecond, above what the process held before it; on a GPU,
torch.cuda.max_memory_allocated above the memory held before), and the largest tensor a transformer block
put out. Ratios are windowed / single pass. Timings on a shared machine are noisy;
the ratios are what to read.

Run: .venv/bin/python bench/long_video_windows.py [--rounds N] [--frames N] [--device cpu|cuda]
The last line is one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.h3 import empty_latent  # noqa: E402
from models.h3.context_windows import CONTEXT_WINDOWS, ContextWindowSettings  # noqa: E402
from models.h3.sampling import sample, sigmas  # noqa: E402
from models.h3.transformer import H3Transformer, H3TransformerConfig, JointLayer  # noqa: E402
from models.patcher import ModelHandle  # noqa: E402

BENCH_CONFIG = H3TransformerConfig(
    hidden_size=256, num_layers=2, refiner_layers=1, num_heads=4, head_dim=64, ffn_size=1024, text_dim=48,
    time_freq_dim=32, time_hidden_size=64, time_embed_dim=32, rope_freqs_per_axis=8)
WINDOW = ContextWindowSettings(context_length=17, context_overlap=4)
SIZE = 256          # pixels (a 16 x 16 latent, 64 patches per latent frame)
STEPS = 2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _setup(device: str):
    torch.manual_seed(0)
    model = H3Transformer(BENCH_CONFIG).eval().to(device)
    handle = ModelHandle(model)
    conditioning = [[torch.randn(1, 8, BENCH_CONFIG.text_dim, generator=torch.Generator().manual_seed(1)), {}]]
    return model, handle, conditioning


def _run(handle: ModelHandle, conditioning: list, frames: int, windowed: bool) -> dict:
    target = handle.with_options(**{CONTEXT_WINDOWS: WINDOW}) if windowed else handle
    return sample(target, empty_latent(SIZE, SIZE, frames), conditioning, sigmas(STEPS), 1)


def _largest_block_output(model, run) -> int:
    largest = [0]

    def record(_module, _inputs, output):
        largest[0] = max(largest[0], output.numel() * output.element_size())

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, JointLayer)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return largest[0]


def _peak_in_child(variant: str, frames: int, device: str) -> int:
    """Peak bytes above the starting point while sampling once, in a fresh process (see the module docstring)."""
    done = subprocess.run([sys.executable, __file__, "--peak", variant, "--frames", str(frames), "--device", device],
                          capture_output=True, text=True, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"])


def _peak_here(variant: str, frames: int, device: str) -> None:
    model, handle, conditioning = _setup(device)
    windowed = variant == "windowed"
    # The same run once first, so what a first call sets up for its shapes (kernel choices, thread pools,
    # caches) is not counted; then the freed heap is handed back before the baseline is read.
    _run(handle, conditioning, frames, windowed)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _run(handle, conditioning, frames, windowed)
        peak = torch.cuda.max_memory_allocated() - before
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _rss_bytes()
        highest = [before]
        done = threading.Event()

        def watch() -> None:  # the resident size's high point during the run, read every millisecond
            while not done.is_set():
                highest[0] = max(highest[0], _rss_bytes())
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _run(handle, conditioning, frames, windowed)
        done.set()
        watcher.join()
        peak = max(0, highest[0] - before)
    print(json.dumps({"peak_bytes": peak}))


def case_windowed(args) -> tuple[list[dict], dict]:
    """A clip in context windows against one pass over the same clip."""
    model, handle, conditioning = _setup(args.device)
    latent = empty_latent(SIZE, SIZE, args.frames)
    latent_t = latent["samples"].shape[2]
    times: dict[str, list[float]] = {"single pass": [], "windowed": []}
    for round_index in range(args.rounds):
        order = ["single pass", "windowed"] if round_index % 2 == 0 else ["windowed", "single pass"]
        for variant in order:
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            _run(handle, conditioning, args.frames, variant == "windowed")
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[variant].append(time.perf_counter() - start)
    rows, figures = [], {}
    for variant in ("single pass", "windowed"):
        windowed = variant == "windowed"
        largest = _largest_block_output(model, lambda: _run(handle, conditioning, args.frames, windowed))
        peak = _peak_in_child("windowed" if windowed else "single", args.frames, args.device)
        rows.append({"case": "windowed", "variant": variant, "time_s": statistics.median(times[variant]),
                     "peak_mb": peak / 2**20, "largest_block_output_mb": largest / 2**20})
    # The same windows over a clip twice as long (17(2n) + 5 frames): the peak should stay where it is.
    longer_frames = 2 * (args.frames - 5) + 5
    longer_peak = _peak_in_child("windowed", longer_frames, args.device) / 2**20
    single, windowed = rows
    for row in rows:
        row["time_ratio"] = row["time_s"] / single["time_s"]
        row["peak_ratio"] = row["peak_mb"] / single["peak_mb"] if single["peak_mb"] else float("nan")
        row["largest_ratio"] = row["largest_block_output_mb"] / single["largest_block_output_mb"]
    figures["windowed"] = {
        "frames": args.frames, "latent_frames": latent_t, "context_length": WINDOW.context_length,
        "context_overlap": WINDOW.context_overlap, "steps": STEPS, "rounds": args.rounds, "device": args.device,
        "single_pass_s": single["time_s"], "windowed_s": windowed["time_s"], "time_ratio": windowed["time_ratio"],
        "single_pass_peak_mb": single["peak_mb"], "windowed_peak_mb": windowed["peak_mb"],
        "peak_ratio": windowed["peak_ratio"], "largest_block_output_ratio": windowed["largest_ratio"],
        "windowed_twice_as_long_peak_mb": longer_peak,
        "windowed_twice_as_long_peak_vs_windowed": longer_peak / windowed["peak_mb"] if windowed["peak_mb"] else None}
    print(f"windowed, clip of {longer_frames} frames: peak {longer_peak:.1f} MB "
          f"({figures['windowed']['windowed_twice_as_long_peak_vs_windowed']:.2f}x the {args.frames}-frame clip's)")
    return rows, figures


CASES = [case_windowed]


def print_table(rows: list[dict]) -> None:
    """One line per (case, variant)."""
    print(f"{'case':<10} {'variant':<12} {'time s':>8} {'x single':>9} {'peak MB':>9} {'x single':>9} "
          f"{'largest block out MB':>21} {'x single':>9}")
    for r in rows:
        print(f"{r['case']:<10} {r['variant']:<12} {r['time_s']:>8.2f} {r['time_ratio']:>9.2f} {r['peak_mb']:>9.1f} "
              f"{r['peak_ratio']:>9.2f} {r['largest_block_output_mb']:>21.2f} {r['largest_ratio']:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating timing rounds per case")
    parser.add_argument("--frames", type=int, default=17 * 6 + 5, help="video frames of the clip (17n + 5)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--peak", choices=("single", "windowed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        _peak_here(args.peak, args.frames, args.device)
        return
    rows, figures = [], {}
    for case in CASES:
        case_rows, case_figures = case(args)
        rows += case_rows
        figures.update(case_figures)
    print_table(rows)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
