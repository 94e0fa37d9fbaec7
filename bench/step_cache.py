"""EasyCache and LazyCache against the plain sampler: time, transformer calls and the decoded output's difference.

One process, the tiny H3 models: the same text-to-video-with-sound graph (the nodes called as the
executor calls them) is sampled for 30 steps without a step-skipping patch, with EasyCache and with
LazyCache at their defaults (reuse_threshold 0.2, start 0.15, end 0.95), the three variants alternating
in a rotating order each round, after one short warm-up run. Per variant: the sampler's wall and thread CPU time (median over the
rounds), the transformer forwards it made, the steps it skipped, and the decoded output against the
uncached run's: PSNR of the video frames (peak 1.0) and SNR of the sound (dB). Ratios are against the
uncached run. Without guidance (cfg 1) the two nodes make the same decisions, one transformer call per
step; they differ with cfg above 1 (docs/usage.md). The tiny models have random weights, so the quality figures measure only how closely a
skipping run follows the full one, not how a real model's pictures and sound would look.

    .venv/bin/python bench/step_cache.py [--steps 30] [--rounds 2] [--width 32 --height 32 --length 5]

The machine is shared: times are noisy; the CPU times and the call counts are the steadier figures.
The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from execution.context import RunContext, Services, activate, deactivate  # noqa: E402
from execution.paths import Paths  # noqa: E402
from models.h3.make_tiny import DEFAULT_NAMES, write_tiny  # noqa: E402
from models.h3.transformer import H3Transformer  # noqa: E402
from nodes.registry import builtin_registry  # noqa: E402

VARIANTS = ("none", "EasyCache", "LazyCache")
DEFAULTS = {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}


def _call(registry, node_id: str, **inputs):
    return registry.get(node_id).execute(**inputs)


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10.0 * math.log10(1.0 / mse)


def _snr(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = float(((reference.float() - other.float()) ** 2).mean())
    signal = float((reference.float() ** 2).mean())
    return math.inf if noise == 0 else 10.0 * math.log10(signal / noise)


def run(args: argparse.Namespace) -> dict:
    calls = [0]
    forward = H3Transformer.forward

    def counted(self, *a, **k):
        calls[0] += 1
        return forward(self, *a, **k)

    H3Transformer.forward = counted
    registry = builtin_registry()
    with tempfile.TemporaryDirectory(prefix="weft-step-cache-") as tmp:
        paths = Paths(Path(tmp)).ensure()
        write_tiny(paths.models)
        events: list[tuple[str, dict]] = []
        ctx = RunContext(prompt_id="bench", node_id="sample", display_node_id="sample", paths=paths,
                         emit=lambda event, data: events.append((event, data)),
                         runtime=Services(preview_method="none"))
        token = activate(ctx)
        try:
            (model,) = _call(registry, "UNETLoader", unet_name=DEFAULT_NAMES["transformer"], weight_dtype="default")
            (clip,) = _call(registry, "CLIPLoader", clip_name=DEFAULT_NAMES["text_encoder"], type="minimax")
            (video_vae,) = _call(registry, "VAELoader", vae_name=DEFAULT_NAMES["video_vae"])
            (audio_vae,) = _call(registry, "VAELoader", vae_name=DEFAULT_NAMES["audio_vae"])
            (positive,) = _call(registry, "CLIPTextEncode", text="a red fox running through snow", clip=clip)
            (latent,) = _call(registry, "EmptyMiniMaxH3LatentAV", width=args.width, height=args.height,
                              length=args.length)
            (noise,) = _call(registry, "RandomNoise", noise_seed=7)
            (sampler,) = _call(registry, "KSamplerSelect", sampler_name="euler")
            models = {"none": model}
            for variant in VARIANTS[1:]:
                (models[variant],) = _call(registry, variant, model=model, **DEFAULTS)
            (sigmas,) = _call(registry, "BasicScheduler", model=model, scheduler="simple", steps=args.steps,
                              denoise=1.0)
            (warm_sigmas,) = _call(registry, "BasicScheduler", model=model, scheduler="simple", steps=2, denoise=1.0)
            (guider,) = _call(registry, "BasicGuider", model=model, conditioning=positive)
            _call(registry, "SamplerCustomAdvanced", noise=noise, guider=guider, sampler=sampler, sigmas=warm_sigmas,
                  latent_image=latent)  # warm-up: first calls and allocations
            figures = {v: {"wall_s": [], "cpu_s": [], "calls": [], "skipped": []} for v in VARIANTS}
            outputs: dict[str, dict] = {}
            for round_index in range(args.rounds):
                order = VARIANTS[round_index % 3:] + VARIANTS[:round_index % 3]
                for variant in order:
                    (guider,) = _call(registry, "BasicGuider", model=models[variant], conditioning=positive)
                    calls[0] = 0
                    events.clear()
                    ctx.counts.clear()
                    wall0, cpu0 = time.perf_counter(), time.thread_time()
                    out, _ = _call(registry, "SamplerCustomAdvanced", noise=noise, guider=guider, sampler=sampler,
                                   sigmas=sigmas, latent_image=latent)
                    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
                    outputs.setdefault(variant, out)
                    figures[variant]["wall_s"].append(wall)
                    figures[variant]["cpu_s"].append(cpu)
                    figures[variant]["calls"].append(calls[0])
                    figures[variant]["skipped"].append(ctx.counts.get("steps_skipped", 0))
            decoded = {}
            for variant, out in outputs.items():
                (frames,) = _call(registry, "VAEDecode", samples=out, vae=video_vae)
                (audio,) = _call(registry, "VAEDecodeAudio", samples=out, vae=audio_vae)
                decoded[variant] = (frames, audio["waveform"])
        finally:
            deactivate(token)
            H3Transformer.forward = forward
    base = statistics.median(figures["none"]["wall_s"])
    base_cpu = statistics.median(figures["none"]["cpu_s"])
    rows = {}
    for variant in VARIANTS:
        wall, cpu = statistics.median(figures[variant]["wall_s"]), statistics.median(figures[variant]["cpu_s"])
        frames, sound = decoded[variant]
        rows[variant] = {
            "sampling_ms": wall * 1000, "sampling_cpu_ms": cpu * 1000, "ratio_to_none": wall / base,
            "cpu_ratio_to_none": cpu / base_cpu, "transformer_calls": figures[variant]["calls"][-1],
            "steps_skipped": figures[variant]["skipped"][-1],
            "frames_psnr_db": _psnr(decoded["none"][0], frames), "sound_snr_db": _snr(decoded["none"][1], sound)}
    return {"steps": args.steps, "rounds": args.rounds, "size": [args.width, args.height, args.length],
            "torch_threads": torch.get_num_threads(), "variants": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds of the three variants (after a warm-up)")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--length", type=int, default=5, help="frames (17n + 5)")
    args = parser.parse_args()
    figures = run(args)
    print(f"tiny H3, {args.width}x{args.height}, {args.length} frames, {args.steps} euler steps, median of "
          f"{args.rounds} rounds (variants alternating); torch threads: {figures['torch_threads']}")
    print(f"{'variant':<10} {'sampling ms':>11} {'cpu ms':>9} {'x none':>7} {'cpu x':>6} {'calls':>6} {'skipped':>8} "
          f"{'frames PSNR dB':>15} {'sound SNR dB':>13}")
    for variant, row in figures["variants"].items():
        print(f"{variant:<10} {row['sampling_ms']:>11.1f} {row['sampling_cpu_ms']:>9.1f} {row['ratio_to_none']:>7.3f} "
              f"{row['cpu_ratio_to_none']:>6.3f} {row['transformer_calls']:>6d} {row['steps_skipped']:>8d} "
              f"{row['frames_psnr_db']:>15.2f} {row['sound_snr_db']:>13.2f}")
    print("random tiny weights: PSNR / SNR say how closely a skipping run follows the full one, not its quality")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
