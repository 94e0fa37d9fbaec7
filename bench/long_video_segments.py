"""Long video on the tiny H3 models: each case is one way of making a clip longer than one pass.

    python bench/long_video_segments.py [--cases segments] [--reps N] [--steps N] [--width W --height H]

Cases (`CASES`, run in the order given; each returns its figures and its table rows):

  segments   workflows/h3_chained_segments.json: a 4-segment clip (segment 1, then a cached List loop
             making segments 2-4, each continuing from the previous one's last 5 frames and 0.21 s of
             sound). Side by side, alternating, in one process with one runtime (models stay loaded):
               full      the output cache (and the MP4 pieces SaveVideo keeps) emptied first, so every
                         node of the clip runs and the whole joined clip is encoded;
               last      right after a full run, segment 4's prompt edited (a new text each time), so
                         the loop serves segments 2 and 3 from the cache and re-makes segment 4 only.
             Ratio last / full (goal <= 0.35), on wall time and on process CPU time (the machine is
             shared: CPU time is the steadier figure). Seams: the mean absolute difference between the
             two frames on each side of a segment boundary of the joined clip, against the mean of
             the differences between neighbouring frames inside the segments (a ratio near 1: the cut
             changes the picture no more than a frame step inside a segment does). The tiny weights are
             random, so the pictures are noise-like and this is a check on the joining, not on content.
             The CPU time of the re-made segment is also broken down by node class: on the tiny models
             the guide's VAE encode and the MP4 writing weigh as much as the sampler, which real weights
             turn around.
             Peak memory of three runs, each in a fresh process after one unmeasured run of the same kind:
               full      the 4-segment clip from an empty output cache;
               last      re-making segment 4 (segments 1-3 held by the cache, counted in the baseline);
               single    one pass making a clip of the same length (73 frames) with segment 1's nodes.
             A peak is the resident size's high point during the run, read every millisecond, above what
             the process held just before it (the freed heap handed back first). The tiny models are
             small, so these figures are the working memory of the nodes around the models as much as of
             the models themselves.

A warm-up run (models loaded, first calls made) comes first and is not counted. The table is printed as
it is measured; the last line printed is one JSON object with every figure.
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
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEGMENTS_WORKFLOW = ROOT / "workflows" / "h3_chained_segments.json"
PROMPTS_TITLE = "Segments 2-4: prompts (one line each)"
FIRST_SEGMENT_FRAMES, NEW_FRAMES_PER_SEGMENT = 22, 17


class Bench:
    """One runtime over a scratch folder holding the tiny models: an executor with an output cache."""

    def __init__(self, base: Path) -> None:
        from execution.cache import make_cache
        from execution.context import Services, configure
        from execution.events import EventBus
        from execution.paths import Paths
        from execution.scheduler import Executor
        from models.h3.make_tiny import write_tiny
        from tests.conftest import testing_registry  # the built-in nodes and TestOutput, a probe

        write_tiny(base / "models")
        self.registry = testing_registry()
        self.paths = Paths(base).ensure()
        configure(self.paths)
        # An LRU cache: the RAM cache would empty itself on a machine with little memory free.
        self.runtime = Services()
        self.executor = Executor(self.registry, cache=make_cache("lru", lru_size=1000), events=EventBus(),
                                 paths=self.paths, runtime=self.runtime)

    def forget_outputs(self) -> None:
        """Empty the output cache and the MP4 pieces SaveVideo keeps, as before a first run (models stay)."""
        from media.video import EncodedPieces
        from nodes.media import ENCODED_PIECES_KEY

        self.executor.cache.clear()
        self.runtime.shared(ENCODED_PIECES_KEY, EncodedPieces).clear()

    def run(self, prompt: dict) -> tuple[object, float, float]:
        """(result, wall seconds, process CPU seconds) of one run."""
        from execution.validation import validate_prompt

        validated = validate_prompt(prompt, self.registry)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        result = self.executor.run(validated, prompt_id=str(uuid.uuid4()))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if result.status != "success":
            raise SystemExit(f"the workflow failed: {json.dumps(result.error, default=repr)[:2000]}")
        return result, wall, cpu


def segments_prompt(bench: Bench, *, width: int, height: int, steps: int, last_prompt: str | None) -> dict:
    """The chained-segments workflow as an API prompt, at the size and steps asked for, with segment 4's
    prompt replaced by `last_prompt` when given, and a probe on the joined video."""
    from execution.convert import ui_to_api

    workflow = json.loads(SEGMENTS_WORKFLOW.read_text(encoding="utf-8"))
    for node in workflow["nodes"]:
        if node["type"] == "EmptyMiniMaxH3LatentAV":
            node["widgets_values"][:2] = [width, height]
        elif node["type"] == "BasicScheduler":
            node["widgets_values"][1] = steps
        elif node.get("title") == PROMPTS_TITLE and last_prompt is not None:
            lines = node["widgets_values"][0].split("\n")
            lines[-1] = last_prompt
            node["widgets_values"][0] = "\n".join(lines)
    prompt = ui_to_api(workflow, bench.registry)
    joined = next(i for i, n in prompt.items() if n["class_type"] == "ConcatenateVideo")
    prompt["probe_joined"] = {"class_type": "TestOutput", "inputs": {"value": [joined, 0]}}
    return prompt


def single_pass_prompt(bench: Bench, *, width: int, height: int, steps: int) -> dict:
    """Segment 1's nodes making one clip as long as the joined 4 segments, saved like the joined clip."""
    prompt = segments_prompt(bench, width=width, height=height, steps=steps, last_prompt=None)
    empty = next(i for i, n in prompt.items() if n["class_type"] == "EmptyMiniMaxH3LatentAV")
    joined = next(n for n in prompt.values() if n["class_type"] == "ConcatenateVideo")
    first_video = joined["inputs"]["videos.video0"][0]  # segment 1's clip
    save = next(i for i, n in prompt.items() if n["class_type"] == "SaveVideo")
    keep = _ancestors(prompt, first_video) | {first_video}
    single = {i: json.loads(json.dumps(prompt[i])) for i in keep}
    single[empty]["inputs"]["length"] = FIRST_SEGMENT_FRAMES + 3 * NEW_FRAMES_PER_SEGMENT
    single[save] = {**prompt[save], "inputs": {**prompt[save]["inputs"], "video": [first_video, 0]}}
    return single


def _ancestors(prompt: dict, node_id: str) -> set[str]:
    """Every node `node_id` reads from, directly or not, itself included."""
    seen, todo = set(), [node_id]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += [v[0] for v in prompt[current]["inputs"].values() if isinstance(v, list) and len(v) == 2
                 and isinstance(v[0], str) and v[0] in prompt]
    return seen


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_here(variant: str, args: argparse.Namespace) -> None:
    """Print the peak bytes of one measured run of `variant` (full, last, single) above the baseline."""
    size = {"width": args.width, "height": args.height, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="weft-long-video-peak-") as scratch:
        bench = Bench(Path(scratch))
        if variant == "single":
            make = lambda take: single_pass_prompt(bench, **size)  # noqa: E731
        else:
            bench.run(segments_prompt(bench, **size, last_prompt=None))
            make = (lambda take: segments_prompt(bench, **size, last_prompt=None)) if variant == "full" else \
                (lambda take: segments_prompt(bench, **size, last_prompt=f"the boat drifts away, take {take}"))
        if variant != "last":
            bench.forget_outputs()
        bench.run(make(0))  # unmeasured: first calls of this kind made
        if variant != "last":
            bench.forget_outputs()
        prompt = make(1)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _rss_bytes()
        highest, done = [before], threading.Event()

        def watch() -> None:
            while not done.is_set():
                highest[0] = max(highest[0], _rss_bytes())
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        bench.run(prompt)
        done.set()
        watcher.join()
    print(json.dumps({"peak_bytes": max(0, highest[0] - before)}))


def peak_in_child(variant: str, args: argparse.Namespace) -> float:
    """MB of one variant's peak, measured in a fresh process."""
    done = subprocess.run([sys.executable, __file__, "--peak", variant, "--steps", str(args.steps),
                           "--width", str(args.width), "--height", str(args.height)],
                          capture_output=True, text=True, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]) / 2**20


def seam_figures(frames) -> dict:
    """Boundary frame differences of a joined clip against the differences inside its segments."""
    steps = (frames[1:] - frames[:-1]).abs().flatten(1).mean(1)  # steps[i]: frame i -> frame i + 1
    count = frames.shape[0]
    boundaries = list(range(FIRST_SEGMENT_FRAMES, count, NEW_FRAMES_PER_SEGMENT))  # first frame of each new part
    at_seams = [float(steps[b - 1]) for b in boundaries]
    inside = [float(s) for i, s in enumerate(steps) if i + 1 not in boundaries]
    mean_inside = statistics.fmean(inside)
    return {"boundary_frames": boundaries, "boundary_diff": at_seams, "mean_boundary_diff": statistics.fmean(at_seams),
            "mean_inside_diff": mean_inside, "max_inside_diff": max(inside),
            "boundary_over_inside": statistics.fmean(at_seams) / mean_inside}


def case_segments(bench: Bench, args: argparse.Namespace) -> dict:
    """Full 4-segment run against re-making the last segment only (see the module docstring)."""
    size = {"width": args.width, "height": args.height, "steps": args.steps}
    bench.run(segments_prompt(bench, **size, last_prompt=None))  # warm-up: models loaded, first calls made
    full, last, seams, by_class = [], [], None, {}
    print(f"segments: {args.width}x{args.height}, {args.steps} steps, 4 segments = "
          f"{FIRST_SEGMENT_FRAMES + 3 * NEW_FRAMES_PER_SEGMENT} frames")
    print(f"{'rep':>4}  {'run':<6} {'wall s':>8} {'cpu s':>8}  segment samplers run")
    for rep in range(args.reps):
        bench.forget_outputs()
        result, wall, cpu = bench.run(segments_prompt(bench, **size, last_prompt=None))
        full.append((wall, cpu))
        print(f"{rep:>4}  {'full':<6} {wall:>8.2f} {cpu:>8.2f}  {samplers_run(result)}")
        if seams is None:
            seams = seam_figures(joined_frames(result))
        result, wall, cpu = bench.run(segments_prompt(bench, **size, last_prompt=f"the boat drifts away, take {rep}"))
        last.append((wall, cpu))
        print(f"{rep:>4}  {'last':<6} {wall:>8.2f} {cpu:>8.2f}  {samplers_run(result)}")
        for row in result.profile.values():
            by_class.setdefault(row["class_type"], []).append(row["cpu_ms"] / args.reps)
    full_wall, full_cpu = (statistics.median(x[i] for x in full) for i in (0, 1))
    last_wall, last_cpu = (statistics.median(x[i] for x in last) for i in (0, 1))
    figures = {"full_wall_s": full_wall, "full_cpu_s": full_cpu, "last_wall_s": last_wall, "last_cpu_s": last_cpu,
               "last_over_full_wall": last_wall / full_wall, "last_over_full_cpu": last_cpu / full_cpu,
               "goal_last_over_full": 0.35, "seams": seams, **size, "reps": args.reps,
               "last_cpu_ms_by_class": {k: round(sum(v), 1) for k, v in
                                        sorted(by_class.items(), key=lambda kv: -sum(kv[1])) if sum(v) >= 1}}
    figures["goal_met"] = figures["last_over_full_cpu"] <= 0.35
    peaks = {variant: peak_in_child(variant, args) for variant in ("full", "last", "single")}
    figures["peak_mb"] = peaks
    figures["peak_last_over_full"] = peaks["last"] / peaks["full"] if peaks["full"] else None
    figures["peak_full_over_single"] = peaks["full"] / peaks["single"] if peaks["single"] else None
    print(f"re-making segment 4 / full run: {figures['last_over_full_wall']:.3f}x wall, "
          f"{figures['last_over_full_cpu']:.3f}x CPU (goal <= 0.35)")
    print("re-making segment 4, CPU ms by node class: " + ", ".join(
        f"{k} {v:.0f}" for k, v in list(figures["last_cpu_ms_by_class"].items())[:6]))
    print(f"{'peak':<8} {'MB':>8} {'x full':>8}")
    for variant, mb in peaks.items():
        print(f"{variant:<8} {mb:>8.1f} {mb / peaks['full'] if peaks['full'] else float('nan'):>8.2f}")
    print(f"seams: mean boundary step {seams['mean_boundary_diff']:.4f} vs mean step inside a segment "
          f"{seams['mean_inside_diff']:.4f} (ratio {seams['boundary_over_inside']:.3f}; largest inside "
          f"{seams['max_inside_diff']:.4f})")
    return figures


def samplers_run(result) -> str:
    """Which segments' samplers ran: 1 for segment 1, loop passes as 2-4."""
    made = []
    for node_id in result.executed:
        if "." in node_id and node_id.rsplit(".", 1)[1] == "22":  # the loop's sampler (SamplerCustomAdvanced)
            made.append(int(node_id.split(".")[1]) + 2)
        elif node_id == "11":
            made.append(1)
    return ",".join(map(str, sorted(made))) or "none"


def joined_frames(result):
    """The joined clip's frames (T, H, W, 3), as the probe on ConcatenateVideo received them."""
    return result.outputs["probe_joined"]["values"][0].get_components().images


CASES = {"segments": case_segments}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--reps", type=int, default=2, help="alternating full / last-segment pairs (default 2)")
    parser.add_argument("--steps", type=int, default=4, help="sampling steps per segment (the workflow's 4)")
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--peak", choices=("full", "last", "single"), help=argparse.SUPPRESS)  # a child's one run
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # the machine is shared; one thread keeps the figures comparable
    if args.peak:
        peak_here(args.peak, args)
        return
    figures = {}
    with tempfile.TemporaryDirectory(prefix="weft-long-video-") as scratch:
        bench = Bench(Path(scratch))
        for name in args.cases:
            figures[name] = CASES[name](bench, args)
    print(json.dumps({"cases": figures, "torch_threads": 1}))


if __name__ == "__main__":
    main()
