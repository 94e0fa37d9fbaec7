"""The unified Linear per backend as a ratio to a bare matrix product of the same shape, measured side by side.

Shapes are H3-like: tokens 1024 and 4096, hidden 1024 and 2048 (in = out = hidden), each prologue with
a residual epilogue. Every timing round runs the bare product and each backend back to back, and the
reported ratio is the median over rounds of (backend time / bare time in the same round), which
cancels most of the drift a shared machine adds; in brackets, best backend time / best bare time (the
figure least disturbed by other processes). Compilation happens in warm-up, outside the timings.

Run: .venv/bin/python bench/kernels.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.linear import LINEAR, linear_eager  # noqa: E402

PROLOGUES = (None, "rms_norm", "swiglu", "gelu_tanh")


def make_case(tokens: int, hidden: int, prologue: str | None, device: torch.device, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    in_features = hidden
    x = randn(tokens, 2 * in_features if prologue == "swiglu" else in_features)
    weight = randn(hidden, in_features) / in_features ** 0.5
    kwargs = dict(prologue=prologue, residual=randn(tokens, hidden))
    if prologue == "rms_norm":
        kwargs["prologue_weight"] = 1 + 0.1 * randn(in_features)
    bare_input = randn(tokens, in_features)  # the product's own shape: (tokens, in) @ (in, out)
    return x, weight, kwargs, bare_input


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only 4096 tokens x 1024 hidden, fewer rounds")
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_grad_enabled(False)
    shapes = [(4096, 1024)] if args.quick else [(1024, 1024), (4096, 1024), (1024, 2048), (4096, 2048)]
    print(f"device: {device} ({'GPU' if device.type == 'cuda' else 'CPU only: no GPU on this machine, triton not measured'}), "
          f"dtype {str(dtype).removeprefix('torch.')}, threads {torch.get_num_threads()}")
    backends = ["eager"] + [name for name in LINEAR.names()
                            if name != "eager" and LINEAR.backend(name).unavailable_reason() is None]
    print(f"backends measured: {backends}")
    print(f"{'tokens':>6} {'hidden':>6} {'prologue':>9} {'bare ms':>8} " + " ".join(f"{b + ' (best)':>18}" for b in backends))
    results = []
    for tokens, hidden in shapes:
        for prologue in PROLOGUES:
            x, weight, kwargs, bare_input = make_case(tokens, hidden, prologue, device, dtype)
            runs = {"bare": lambda: bare_input @ weight.t()}
            for name in backends:
                runs[name] = (lambda name=name: LINEAR(x, weight, None, backend=name, **kwargs))
            reference = linear_eager(x, weight, None, **kwargs)
            for name in backends:  # warm-up (compiles) and a parity check
                out = runs[name]()
                error = (out.float() - reference.float()).abs().max().item()
                if error > 1e-2 * max(1.0, reference.abs().max().item()):
                    raise SystemExit(f"{name} disagrees with eager by {error} at {tokens}x{hidden} {prologue}")
            runs["bare"]()
            flops = 2 * tokens * hidden * hidden
            rounds = 5 if args.quick else max(5, min(9, int(2e10 / flops)))
            times = {name: [] for name in runs}
            for _ in range(rounds):
                for name, fn in runs.items():
                    times[name].append(timed(fn, device))
            ratios = {name: statistics.median(t / b for t, b in zip(times[name], times["bare"])) for name in backends}
            best = {name: min(times[name]) / min(times["bare"]) for name in backends}
            bare_ms = statistics.median(times["bare"]) * 1e3
            print(f"{tokens:>6} {hidden:>6} {str(prologue):>9} {bare_ms:>8.1f} "
                  + " ".join(f"{ratios[name]:>7.3f}x ({best[name]:.3f}x)" for name in backends))
            results.append({"tokens": tokens, "hidden": hidden, "prologue": prologue, "epilogue": "residual",
                            "bare_ms": round(bare_ms, 3), "ratios": {k: round(v, 4) for k, v in ratios.items()},
                            "best_ratios": {k: round(v, 4) for k, v in best.items()}})
    key = {(r["tokens"], r["hidden"], r["prologue"]): r["ratios"] for r in results}
    headline = {f"{p}_4096x1024x1024_{b}": key[(4096, 1024, p)].get(b) for p in ("rms_norm", "swiglu")
                for b in backends if (4096, 1024, p) in key}
    print("target: compiled <= 1.10x bare for rms_norm+residual and swiglu+residual at 4096x1024x1024 float32 (CPU)")
    print(json.dumps({"bench": "kernels", "device": str(device), "gpu": device.type == "cuda",
                      "dtype": str(dtype).removeprefix("torch."), "headline": headline, "results": results}))


if __name__ == "__main__":
    main()
