"""Every kernel and bench that matters on CUDA, in one run, as one table (the body of bench/gpu_check.sh).

Measured in this process, each against its reference in the same rounds (bfloat16, CUDA events):
  linear triton     the Triton fused Linear (swiglu and rms_norm prologues, residual) against eager
  int8 _int_mm      an int8 weight through torch._int_mm against the bfloat16 product of the same shape
  fp8 _scaled_mm    a float8-e4m3 weight through torch._scaled_mm against bfloat16 (compute capability >= 8.9)
  nvfp4             an nvfp4 weight through whatever quantized backend serves it, against bfloat16
  h3 step           one H3 transformer forward at the released layer width (2 blocks, ~4k tokens), FLOP/s
                    as a fraction of a bare bfloat16 product of 8192^3
Run as child processes with a time limit each, their own figures read from the JSON line they end with:
  bench/kernels.py --quick, bench/quantized.py --quick, bench/sparse_attention.py (VSA blockwise with
  its GPU budget), bench/memory.py --quick (the memory manager streaming a model larger than its budget).
Without a CUDA device it says so and exits 0.

Run: bash bench/gpu_check.sh   (or .venv/bin/python bench/gpu_check.py [--skip-children])
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILDREN = (  # (name, arguments, time limit in seconds)
    ("kernels.py --quick", ["bench/kernels.py", "--quick", "--rounds", "20"], 150),
    ("quantized.py --quick", ["bench/quantized.py", "--quick"], 150),
    ("sparse_attention.py", ["bench/sparse_attention.py", "--tokens", "12288,24576,49152"], 120),
    ("memory.py --quick", ["bench/memory.py", "--quick"], 90),
)


def cuda_timed(fn, rounds: int = 10) -> float:
    """Median seconds of `fn` on the current CUDA stream (after two warm-up calls)."""
    fn()
    fn()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-12))


def check_triton_linear(rows: list) -> None:
    from kernels.linear import LINEAR, linear_eager

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden = 8192, 4096
    for prologue in ("swiglu", "rms_norm"):
        in_x = 2 * hidden if prologue == "swiglu" else hidden
        x = torch.randn(tokens, in_x, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(hidden, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
        kwargs = {"prologue": prologue, "residual": torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()}
        if prologue == "rms_norm":
            kwargs["prologue_weight"] = torch.ones(hidden, device="cuda").bfloat16()
        reason = LINEAR.backend("triton").decline_reason(x, w, None, **kwargs)
        if reason is not None:
            rows.append((f"linear triton {prologue}", "declined", reason))
            continue
        fused = cuda_timed(lambda: LINEAR(x, w, None, backend="triton", **kwargs))
        eager = cuda_timed(lambda: linear_eager(x, w, None, **kwargs))
        error = relative_error(LINEAR(x, w, None, backend="triton", **kwargs), linear_eager(x, w, None, **kwargs))
        rows.append((f"linear triton {prologue} {tokens}x{hidden}", f"{fused / eager:.3f}x eager",
                     f"{fused * 1e3:.2f} ms vs {eager * 1e3:.2f} ms, rel. error {error:.1e}"))


def check_quantized(rows: list) -> None:
    from kernels.linear import linear
    from kernels.quantized import WeightFormat
    from kernels.quantized_linear import QUANTIZED_LINEAR
    from models.quant.markers import LayerQuant
    from models.quant.writer import encode_weight
    from models.ops import QuantizedLinear

    tokens, in_features, out_features = 8192, 5376, 14336
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, in_features, device="cuda", generator=gen).bfloat16()
    dense = torch.randn(out_features, in_features, device="cuda", generator=gen) / in_features ** 0.5
    bf16_weight = dense.bfloat16()
    bare = cuda_timed(lambda: torch.nn.functional.linear(x, bf16_weight))
    for label, fmt, group in (("int8 _int_mm", "int8_tensorwise", 256), ("fp8 _scaled_mm", "float8_e4m3fn", 0),
                              ("nvfp4", "nvfp4", 0)):
        try:
            quant = LayerQuant(WeightFormat(fmt), group, False)
            stored = encode_weight(dense.float().cpu(), quant)
            layer = QuantizedLinear(in_features, out_features, quant, bias=False,
                                    tensor_shapes={k: (tuple(v.shape), v.dtype) for k, v in stored.items()},
                                    compute_dtype=torch.bfloat16, device="cuda")
            for name, tensor in stored.items():
                getattr(layer, name).data.copy_(tensor.to("cuda"))
            weight = layer.quantized_weight()
            seconds = cuda_timed(lambda: linear(x, weight))
            backend = QUANTIZED_LINEAR.last_backend
            error = relative_error(linear(x, weight), torch.nn.functional.linear(x, bf16_weight))
            rows.append((f"{label} {tokens}x{in_features}x{out_features}", f"{seconds / bare:.3f}x bf16",
                         f"backend {backend}, {seconds * 1e3:.2f} ms vs {bare * 1e3:.2f} ms, rel. error {error:.1e}"))
        except Exception as error:  # one kernel's failure is a row of the table, not the end of the check
            rows.append((label, "FAILED", f"{type(error).__name__}: {str(error)[:200]}"))


def check_h3_step(rows: list) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from models import memory
    from models.h3.transformer import H3Transformer, H3TransformerConfig

    config = H3TransformerConfig(num_layers=2, refiner_layers=1)  # the released widths, fewer blocks
    with torch.device("cuda"):
        model = H3Transformer(config).to(torch.bfloat16).eval().requires_grad_(False)
    gen = torch.Generator(device="cuda").manual_seed(2)
    video = torch.randn(1, 24, 7, 32, 48, device="cuda", generator=gen)       # 2,688 rows
    audio = torch.randn(1, 32, 2, 600, device="cuda", generator=gen)          # 1,200 rows
    text = torch.randn(1, 200, config.text_dim, device="cuda", generator=gen).bfloat16()
    memory.activate(memory.MemoryManager(device="cuda", dtype=torch.bfloat16, mode="highvram"))
    try:
        with torch.no_grad():
            counter = FlopCounterMode(display=False)
            with counter:
                model(video, audio, text, 0.7, 0.6)
            seconds = cuda_timed(lambda: model(video, audio, text, 0.7, 0.6), rounds=5)
    finally:
        memory.activate(None)
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    limit = 2 * 8192 ** 3 / cuda_timed(lambda: a @ a)
    flops = counter.get_total_flops()
    rows.append(("h3 step, released width, 2 blocks, 4,088 rows", f"{flops / seconds / limit:.1%} of bf16 matmul",
                 f"{seconds * 1e3:.1f} ms, {flops / seconds / 1e12:.0f} TFLOP/s useful, limit {limit / 1e12:.0f} TFLOP/s"))


def run_child(name: str, arguments: list[str], limit_s: int, rows: list) -> dict | None:
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *arguments], cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        rows.append((name, "TIMED OUT", f"over {limit_s} s"))
        return None
    elapsed = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        rows.append((name, "FAILED", (done.stderr.strip().splitlines() or ["no output"])[-1][:200]))
        return None
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError:
        rows.append((name, "FAILED", "its last line is not JSON"))
        return None
    rows.append((name, "ran", f"{elapsed:.0f} s; " + summarise(figures)))
    return figures


def summarise(figures: dict) -> str:
    """The headline of a child bench's JSON line, in one line."""
    keys = ("target_met", "headline", "devices", "runs", "results")
    picked = {k: figures[k] for k in keys if k in figures}
    text = json.dumps(picked, default=str)
    return text if len(text) <= 400 else text[:397] + "..."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-children", action="store_true", help="only the checks measured in this process")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to measure (run it where a GPU is present)")
        print(json.dumps({"bench": "gpu_check", "gpu": False}))
        return 0
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    rows: list[tuple[str, str, str]] = []
    for check in (check_triton_linear, check_quantized, check_h3_step):
        try:
            check(rows)
        except Exception as error:
            rows.append((check.__name__.removeprefix("check_"), "FAILED", f"{type(error).__name__}: {str(error)[:200]}"))
        torch.cuda.empty_cache()
    children = {}
    if not args.skip_children:
        for name, arguments, limit_s in CHILDREN:
            children[name] = run_child(name, arguments, limit_s, rows)
    device = torch.cuda.get_device_name()
    print(f"\ngpu_check on {device} (torch {torch.__version__}), {time.perf_counter() - started:.0f} s")
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  {'result':<24}  detail")
    for name, result, detail in rows:
        print(f"{name:<{width}}  {result:<24}  {detail}")
    print(json.dumps({"bench": "gpu_check", "gpu": True, "device": device,
                      "rows": [{"check": n, "result": r, "detail": d} for n, r, d in rows], "children": children},
                     default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
