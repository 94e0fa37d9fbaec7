"""Quantized Linear products on the CPU per format, and an int8-convrot H3 transformer against it in bfloat16.

(d) Decoding, per stored format (int8 convrot, float8 e4m3, nvfp4 with a pre-quant scale, mxfp8, GGUF
    Q8_0; the GGUF K types need rows of whole 256-value blocks, which 1344 is not) at the Linear shapes
    of the H3 step (1,060 tokens; 1344 -> 5376 with the rms_norm prologue, 3584 -> 1344 with swiglu;
    bfloat16 activations and residual), side by side in the same rounds, the order rotated each round,
    this process's CPU time (min and median):
      eager         the reference: the weight dequantized to bfloat16, the bfloat16 product
      dequantized   the CPU's choice: decoded into the thread's float32 buffer, the float32 product
      decode        the decode into the buffer alone
      f32 product   a bare float32 product of the same shape on an already decoded weight (the floor)
    Ratios: eager / dequantized (the gain), decode / dequantized (the decode's share), dequantized /
    f32 product (what decoding and the prologue add to the bare product).
(a) Memory: peak resident weight bytes under the memory manager while the int8 model runs, against
    the int8 file's size (goal: at most 1.1x) and against the bfloat16 model's peak.
(b) Time per denoising step (one transformer forward), side by side in the same rounds:
      int8          the int8 model, its backend chosen as in production (on the CPU the decoded float32
                    product; on CUDA torch._int_mm, its elementwise stages compiled where large enough)
      dequantize    the same int8 model forced onto the reference (dequantize the weight, eager float product)
      bf16          the bfloat16 model, its Linear choosing its backend as in production (compiled or eager)
    The backend each path ended on is printed. Compilation happens in the warm-up, outside the timed
    rounds. On a machine with CUDA the whole table is measured on the GPU too.

Everything runs on one torch thread unless --threads says otherwise (the figures of a shared machine
are steadier so). The default run takes about three minutes on a 2-core machine: a minute for (d), two
for (a) and (b); --sections picks one.

Both files are written by Weft's own writer (models/quant/writer.py) from one random model, with the
layers the released files quantize (qkv, out, fc1, fc2 of every block; group 256).

Run: .venv/bin/python bench/quantized.py [--quick] [--sections decode,step] [--decode-rounds N] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.linear import LINEAR  # noqa: E402
from kernels.quantized import WeightFormat  # noqa: E402
from kernels.quantized_linear import QUANTIZED_LINEAR, decode_into_buffer  # noqa: E402
from models import memory  # noqa: E402
from models.h3.transformer import FLOAT32_PREFIXES, H3Transformer, H3TransformerConfig  # noqa: E402
from models.loading import load_model  # noqa: E402
from models.ops import QuantizedLinear  # noqa: E402
from models.quant.formats import LayerQuant  # noqa: E402
from models.quant.writer import RELEASED_INT8_LAYERS, quantize_state_dict, save_quantized  # noqa: E402

PATHS = {"int8": "", "dequantize": "quantized_linear:eager", "bf16": ""}  # WEFT_KERNEL_BACKEND per path


# (tokens, in, out, prologue) of two H3 step Linears at the quarter width bench/dit_step.py runs.
DECODE_SHAPES = ((1060, 1344, 5376, "rms_norm"), (1060, 3584, 1344, "swiglu"))
DECODE_FORMATS = (WeightFormat.INT8, WeightFormat.FLOAT8_E4M3, WeightFormat.NVFP4, WeightFormat.MXFP8,
                  WeightFormat.GGUF_Q8_0)
DECODE_VARIANTS = ("eager", "dequantized", "decode", "f32 product")


def rotation_group(in_features: int) -> int:
    """The largest power-of-4 rotation group, up to 256, that divides `in_features`."""
    group = 256
    while in_features % group:
        group //= 4
    return group


def decode_case(fmt: WeightFormat, tokens: int, in_features: int, out_features: int, prologue: str):
    """One layer in `fmt` and the calls of each variant on it."""
    gen = torch.Generator().manual_seed(2)
    quant = LayerQuant(fmt, rotation_group(in_features) if fmt is WeightFormat.INT8 else 0)
    dense = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    tensors = quant.stored_format.encode(dense, quant)
    if fmt is WeightFormat.NVFP4:  # as the released AWQ text encoder's layers carry
        tensors["pre_quant_scale"] = (torch.rand(in_features, generator=gen) + 0.5).to(torch.bfloat16)
    weight = quant.stored_format.weight(tensors, (out_features, in_features), quant)
    width = 2 * in_features if prologue == "swiglu" else in_features
    x = torch.randn(tokens, width, generator=gen).to(torch.bfloat16)
    residual = torch.randn(tokens, out_features, generator=gen).to(torch.bfloat16)
    options = {"prologue": prologue, "residual": residual}
    if prologue == "rms_norm":
        options["prologue_weight"] = torch.ones(in_features, dtype=torch.bfloat16)
    h32 = torch.randn(tokens, in_features, generator=gen)
    w32 = weight.dequantize(torch.float32)
    return {"eager": lambda: QUANTIZED_LINEAR(x, weight, backend="eager", **options),
            "dequantized": lambda: QUANTIZED_LINEAR(x, weight, backend="dequantized", **options),
            "decode": lambda: decode_into_buffer(weight),
            "f32 product": lambda: torch.matmul(h32, w32.t())}


def measure_decode(rounds: int, quick: bool) -> list[dict]:
    """Per format and shape: min and median CPU seconds of each variant, the variants alternated each round."""
    shapes = [(256, 512, 1024, "rms_norm")] if quick else DECODE_SHAPES
    results = []
    for tokens, in_features, out_features, prologue in shapes:
        for fmt in DECODE_FORMATS:
            calls = decode_case(fmt, tokens, in_features, out_features, prologue)
            outputs = {name: calls[name]() for name in ("eager", "dequantized")}  # warm-up (compiles)
            scale = float((outputs["eager"].float()).abs().max())
            drift = float((outputs["dequantized"].float() - outputs["eager"].float()).abs().max()) / scale
            times = {name: [] for name in DECODE_VARIANTS}
            for index in range(rounds):
                order = DECODE_VARIANTS[index % 4:] + DECODE_VARIANTS[:index % 4]
                for name in order:
                    start = time.process_time()
                    calls[name]()
                    times[name].append(time.process_time() - start)
            results.append({"format": fmt.value, "shape": [tokens, in_features, out_features], "prologue": prologue,
                            "min_s": {k: min(v) for k, v in times.items()},
                            "median_s": {k: statistics.median(v) for k, v in times.items()},
                            "drift_vs_eager": drift})
    return results


def print_decode(results: list[dict], rounds: int) -> dict:
    """The decode table; returns its figures for the JSON line."""
    print(f"\n[cpu] (d) quantized Linear products, {torch.get_num_threads()} thread(s), CPU ms "
          f"(median of {rounds}, min in brackets), bfloat16 activations and residual")
    print(f"  {'format':<16} {'shape':<17} {'eager':>14} {'dequantized':>14} {'decode':>12} {'f32 product':>14} "
          f"{'eager/deq':>9} {'decode/deq':>10} {'deq/f32':>8} {'drift':>8}")
    summary = []
    for row in results:
        med, low = row["median_s"], row["min_s"]
        cells = " ".join(f"{med[k] * 1e3:>{w - 7}.1f} ({low[k] * 1e3:>5.0f})"
                         for k, w in zip(DECODE_VARIANTS, (14, 14, 12, 14)))
        ratios = {"eager_over_dequantized": med["eager"] / med["dequantized"],
                  "decode_over_dequantized": med["decode"] / med["dequantized"],
                  "dequantized_over_f32_product": med["dequantized"] / med["f32 product"]}
        shape = "x".join(str(v) for v in row["shape"])
        print(f"  {row['format']:<16} {shape:<17} {cells} {ratios['eager_over_dequantized']:>8.2f}x "
              f"{ratios['decode_over_dequantized']:>9.3f}x {ratios['dequantized_over_f32_product']:>7.2f}x "
              f"{row['drift_vs_eager']:>8.1e}")
        summary.append({"format": row["format"], "shape": row["shape"],
                        "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
                        **{k: round(v, 3) for k, v in ratios.items()}})
    return {"threads": torch.get_num_threads(), "rounds": rounds, "rows": summary}


def small_config(quick: bool) -> H3TransformerConfig:
    """A small H3 transformer in the released pruned form: widths divisible by the 256-column rotation group."""
    return H3TransformerConfig(hidden_size=1024, num_layers=2 if quick else 4, refiner_layers=1, num_heads=8,
                               head_dim=128, ffn_size=2816, text_dim=512, time_embed_dim=8,
                               adaln_curve_points=1025, rope_freqs_per_axis=16)


def write_files(directory: Path, config: H3TransformerConfig) -> dict[str, Path]:
    """The bf16 file and the int8 convrot file of one seeded random model."""
    torch.manual_seed(0)
    model = H3Transformer(config)
    state = {}
    for key, value in model.state_dict().items():
        if value.dim() >= 2 and key != "adaln_t_table":
            value = torch.randn(value.shape) / value.shape[1] ** 0.5
        elif key.endswith("norm.weight") or ".norm" in key:
            value = torch.ones(value.shape)
        elif key == "adaln_t_table":
            value = 0.1 * torch.randn(value.shape)
        elif key.endswith(".bias"):
            value = 0.01 * torch.randn(value.shape)
        keep32 = key.startswith(FLOAT32_PREFIXES)
        state[key] = value.float() if keep32 else value.to(torch.bfloat16)
    paths = {"bf16": directory / "h3_small_bf16.safetensors", "int8": directory / "h3_small_int8_convrot.safetensors"}
    save_quantized(paths["bf16"], state)
    quantized, metadata = quantize_state_dict(state, RELEASED_INT8_LAYERS["h3_transformer"], "int8_tensorwise",
                                              rotation_group=256)
    save_quantized(paths["int8"], quantized, metadata)
    return paths


def step_inputs(config: H3TransformerConfig, device: torch.device, quick: bool):
    """One step's latents: video (1, 24, T, H, W), audio (1, 32, 2, Ta), text (1, L, text_dim)."""
    gen = torch.Generator().manual_seed(1)
    frames, size = (2, 16) if quick else (3, 24)
    video = torch.randn(1, config.video_channels, frames, size, size, generator=gen)
    audio = torch.randn(1, config.audio_channels, 2, 16, generator=gen)
    text = torch.randn(1, 32, config.text_dim, generator=gen)
    return video.to(device), audio.to(device), text.to(device), 0.7, 0.6


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(device: torch.device, paths: dict[str, Path], config: H3TransformerConfig, rounds: int,
            quick: bool) -> dict:
    """Peak resident bytes and per-step times of the three paths on `device`."""
    models = {"int8": load_model(paths["int8"]).model, "bf16": load_model(paths["bf16"]).model}
    if not any(isinstance(m, QuantizedLinear) for m in models["int8"].modules()):
        raise SystemExit("the int8 file loaded without quantized layers")
    managers = {name: memory.MemoryManager(device=device, dtype=torch.bfloat16, mode="highvram") for name in models}
    inputs = step_inputs(config, device, quick)
    previous = os.environ.get("WEFT_KERNEL_BACKEND")
    outputs, backends = {}, {}
    try:
        for path, forced in PATHS.items():  # warm-up; fills each manager; records peaks and backends
            os.environ["WEFT_KERNEL_BACKEND"] = forced
            model_name = "bf16" if path == "bf16" else "int8"
            memory.activate(managers[model_name])
            outputs[path] = models[model_name](*inputs)
            backends[path] = QUANTIZED_LINEAR.last_backend if model_name == "int8" else LINEAR.last_backend
        times = {path: [] for path in PATHS}
        for _ in range(rounds):
            for path, forced in PATHS.items():
                os.environ["WEFT_KERNEL_BACKEND"] = forced
                model_name = "bf16" if path == "bf16" else "int8"
                memory.activate(managers[model_name])
                times[path].append(timed(lambda: models[model_name](*inputs), device))
    finally:
        memory.unconfigure()
        if previous is None:
            os.environ.pop("WEFT_KERNEL_BACKEND", None)
        else:
            os.environ["WEFT_KERNEL_BACKEND"] = previous
    largest_dequantized = max(m.out_features * m.in_features * 2 for m in models["int8"].modules()
                              if isinstance(m, QuantizedLinear))
    reference_video = outputs["dequantize"][0].float()
    drift = {path: float((outputs[path][0].float() - reference_video).abs().max() / reference_video.abs().max())
             for path in ("int8", "bf16")}
    return {
        "peak_resident_bytes": {name: managers[name].stats().peak_resident_bytes for name in models},
        "step_seconds": {path: statistics.median(values) for path, values in times.items()},
        "backends": backends, "largest_dequantized_weight_bytes": largest_dequantized,
        "video_drift_vs_dequantize": drift,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 blocks, fewer tokens and rounds; one small decode shape")
    parser.add_argument("--sections", default="decode,step", help="comma-separated sections: decode, step")
    parser.add_argument("--decode-rounds", type=int, default=None, help="rounds of the decode section (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= {"decode", "step"}:
        raise SystemExit(f"--sections takes decode and/or step, got {args.sections!r}")
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    report = {"bench": "quantized", "threads": args.threads}
    if "decode" in sections:
        rounds = args.decode_rounds or 2
        report["decode"] = print_decode(measure_decode(rounds, args.quick), rounds)
    if "step" in sections:
        report.update(step_section(args.quick))
    print(json.dumps(report))


def step_section(quick: bool) -> dict:
    """(a) and (b): the int8-convrot model's resident bytes and step time against the bfloat16 model."""
    config = small_config(quick)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rounds = 2 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(Path(tmp), config)
        sizes = {name: os.path.getsize(path) for name, path in paths.items()}
        results = {str(device): measure(device, paths, config, rounds, quick) for device in devices}
    print(f"\nH3 transformer: hidden {config.hidden_size}, {config.num_layers} blocks, ffn {config.ffn_size}, "
          f"pruned curve AdaLN; files: int8 convrot {sizes['int8'] / 2**20:.1f} MiB, bf16 {sizes['bf16'] / 2**20:.1f} MiB"
          f"{'' if len(devices) > 1 else '; no GPU on this machine: CPU only'}")
    summary = {}
    for device, result in results.items():
        peak = result["peak_resident_bytes"]
        steps = result["step_seconds"]
        ratio_file = peak["int8"] / sizes["int8"]
        print(f"\n[{device}] (a) peak resident weights while running")
        print(f"  int8 {peak['int8'] / 2**20:8.1f} MiB = {ratio_file:.3f}x its file (goal <= 1.1x), "
              f"{peak['int8'] / peak['bf16']:.3f}x the bf16 model's {peak['bf16'] / 2**20:.1f} MiB")
        print(f"  largest dequantized weight alive during one op (reference path): "
              f"{result['largest_dequantized_weight_bytes'] / 2**20:.1f} MiB")
        print(f"[{device}] (b) time per step (median of {rounds}, same rounds)")
        print(f"  {'path':<11} {'seconds':>8} {'vs bf16':>8} {'backend':>14} {'video drift':>12}")
        for path in PATHS:
            drift = result["video_drift_vs_dequantize"].get(path, 0.0)
            print(f"  {path:<11} {steps[path]:>8.3f} {steps[path] / steps['bf16']:>7.2f}x {result['backends'][path]:>14} "
                  f"{drift:>12.2e}")
        summary[device] = {"peak_int8_over_file": round(ratio_file, 4),
                           "peak_int8_over_bf16": round(peak["int8"] / peak["bf16"], 4),
                           "step_s": {k: round(v, 4) for k, v in steps.items()},
                           "int8_over_bf16": round(steps["int8"] / steps["bf16"], 3),
                           "dequantize_over_bf16": round(steps["dequantize"] / steps["bf16"], 3),
                           "int8_over_dequantize": round(steps["int8"] / steps["dequantize"], 3),
                           "backends": result["backends"], "video_drift_vs_dequantize": result["video_drift_vs_dequantize"],
                           "peak_resident_bytes": peak}
    return {"file_bytes": sizes, "hidden": config.hidden_size, "blocks": config.num_layers, "gpu": len(devices) > 1,
            "devices": summary}


if __name__ == "__main__":
    main()
