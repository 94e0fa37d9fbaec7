"""One H3 transformer step, Weft against diffusers' `MiniMaxH3Transformer3DModel` on the same weights.

Weft's model gets seeded random weights; diffusers' model gets the same weights through diffusers' own
single-file converter (as tests/models/h3/test_h3_diffusers_parity.py does). Both see the same packed
sequence. Measured side by side in one run, on the CPU:
  - per thread count (1 and 2) and size (the 4-block quarter-width config at ~1,060 tokens and at 4x
    the tokens): Weft and diffusers in float32 and in bfloat16, Weft's int8-convrot and nvfp4 models
    (written and loaded by Weft's own quantized writer and loader), and a bare 2048^3 matrix product
    per dtype (the machine's matmul limit at that thread count: in float32 the faster of torch's `@`
    and oneDNN's product, which on some CPUs differ by 2x; in bfloat16 the faster of torch's `@` and
    the product widened to float32 and rounded back, which on a CPU without bfloat16 arithmetic is
    several times faster and is what Weft's compiled Linear runs there);
  - every variant once per round, the order rotated each round, several rounds; min and median, of
    this process's CPU time (steady on a shared machine) and of wall time;
  - a "step" is the transformer forward plus the sampler's Euler update of both latents;
  - useful FLOP/s = the step's matrix-product and attention FLOPs (counted once, by torch's
    FlopCounterMode on diffusers' forward, with a formula registered for the CPU attention op, which torch
    counts as zero) / time, as a fraction of the bare product's FLOP/s;
  - the "floor fp32" row: every counted FLOP at the bare float32 product's rate and nothing else; its ratio
    to diffusers is the least any implementation of the same float32 math could reach on this machine;
  - a per-op profile of Weft's float32 step (torch profiler for op time; cProfile to split the
    Python time between the memory manager, adapter/patch checks, kernel dispatch and model code).
Weft runs as the server runs it: under a configured memory manager with every weight resident.

Run: .venv/bin/python bench/dit_step.py [--quick] [--rounds N] [--threads 1,2] [--sizes small,large]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see bench/kernels.py

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import memory  # noqa: E402
from models.h3.sampling import euler_step  # noqa: E402
from models.h3.transformer import FLOAT32_PREFIXES, H3Transformer, H3TransformerConfig  # noqa: E402
from models.loading import load_model  # noqa: E402
from models.quant.writer import RELEASED_INT8_LAYERS, quantize_state_dict, save_quantized  # noqa: E402

# A quarter of the released width, 4 blocks: every interface of the real model at a CPU-sized cost.
QUARTER_CONFIG = H3TransformerConfig(hidden_size=1344, num_layers=4, refiner_layers=2, num_heads=14, head_dim=128,
                                     ffn_size=3584, text_dim=1280, time_freq_dim=256, time_hidden_size=1344,
                                     time_embed_dim=672)
QUICK_CONFIG = H3TransformerConfig(hidden_size=256, num_layers=2, refiner_layers=1, num_heads=2, head_dim=128,
                                   ffn_size=512, text_dim=256, time_freq_dim=64, time_hidden_size=256,
                                   time_embed_dim=128)
# Latent sizes per size name: video (T', H, W), audio frames, text tokens; rows = T'*H/2*W/2 + 2*Ta + text.
SIZES = {"small": ((7, 16, 24), 176, 36),      # 672 + 352 + 36 = 1,060 rows
         "large": ((7, 32, 48), 704, 144),     # 2,688 + 1,408 + 144 = 4,240 rows
         "quick": ((2, 8, 8), 24, 8)}          # 32 + 48 + 8 = 88 rows
TARGETS = {"fraction_of_matmul_limit": 0.70, "weft_over_diffusers": 0.90, "int8_over_diffusers_bf16": 0.60}
SIGMAS = (0.7, 0.55, 0.6, 0.45)  # video sigma, next; audio sigma, next


def seeded_state(config: H3TransformerConfig) -> dict[str, torch.Tensor]:
    """A float32 state dict of random weights scaled like a trained model's (unit-ish activations)."""
    torch.manual_seed(0)
    state = {}
    for key, value in H3Transformer(config).state_dict().items():
        if value.dim() >= 2:
            value = torch.randn(value.shape) / value.shape[1] ** 0.5
        elif "norm" in key:
            value = 1.0 + 0.1 * torch.randn(value.shape)
        elif key.endswith(".bias"):
            value = 0.01 * torch.randn(value.shape)
        state[key] = value.float().contiguous()
    return state


def write_files(directory: Path, state: dict[str, torch.Tensor]) -> dict[str, Path]:
    """The float32 file and the int8-convrot and nvfp4 files of one state dict, by Weft's writer."""
    paths = {"fp32": directory / "h3_fp32.safetensors", "int8": directory / "h3_int8_convrot.safetensors",
             "nvfp4": directory / "h3_nvfp4.safetensors"}
    save_quantized(paths["fp32"], state)
    layers = RELEASED_INT8_LAYERS["h3_transformer"]
    bf16_state = {k: v if k.startswith(FLOAT32_PREFIXES) else v.to(torch.bfloat16) for k, v in state.items()}
    save_quantized(paths["int8"], *quantize_state_dict(bf16_state, layers, "int8_tensorwise", rotation_group=256))
    save_quantized(paths["nvfp4"], *quantize_state_dict(bf16_state, layers, "nvfp4"))
    return paths


def diffusers_model(config: H3TransformerConfig, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """diffusers' transformer holding `state` through diffusers' own converter, in `dtype`."""
    from tests.models.h3.test_h3_diffusers_parity import diffusers_config
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    arguments = diffusers_config(config)
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        {k: v.clone() for k, v in state.items()}, arguments, qkv_layout="stacked")
    model = MiniMaxH3Transformer3DModel(**arguments).eval().requires_grad_(False)
    model.load_state_dict(converted, strict=True)
    return model.to(dtype)


def step_latents(config: H3TransformerConfig, size: str):
    """Seeded latents of one size: video (24, T', H, W), audio (32, 2, Ta), text (L, text_dim)."""
    (frames, height, width), audio_frames, text_tokens = SIZES[size]
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(config.video_channels, frames, height, width, generator=gen),
            torch.randn(config.audio_channels, 2, audio_frames, generator=gen),
            torch.randn(text_tokens, config.text_dim, generator=gen))


def sequence_rows(size: str) -> int:
    """Rows of the packed sequence at `size`: video patches (1x2x2), two rows per audio frame, text."""
    (frames, height, width), audio_frames, text_tokens = SIZES[size]
    return frames * (height // 2) * (width // 2) + 2 * audio_frames + text_tokens


class WeftStep:
    """Weft's step: the forward under its own memory manager (all resident) and the Euler update."""

    def __init__(self, model: H3Transformer, latents, dtype: torch.dtype):
        self.model = model
        self.manager = memory.MemoryManager(device="cpu", dtype=dtype)
        video, audio, text = latents
        self.video, self.audio, self.text = video[None], audio[None], text[None].to(dtype)

    def forward(self):
        memory.activate(self.manager)
        try:
            return self.model(self.video, self.audio, self.text, SIGMAS[0], SIGMAS[2])
        finally:
            memory.activate(None)

    def __call__(self):
        v_video, v_audio = self.forward()
        sv, sv_next, sa, sa_next = (torch.tensor(s, dtype=torch.float32) for s in SIGMAS)
        return euler_step(self.video, v_video, sv, sv_next), euler_step(self.audio, v_audio, sa, sa_next)


class DiffusersStep:
    """diffusers' step on the same packed sequence (the packing itself is done once, outside the timing)."""

    def __init__(self, model, latents, dtype: torch.dtype):
        from tests.models.h3.test_h3_diffusers_parity import diffusers_inputs

        self.model = model
        self.video, self.audio, text = latents
        kwargs = diffusers_inputs(self.video, self.audio, text, SIGMAS[0], SIGMAS[2])
        for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
            kwargs[name] = kwargs[name].to(dtype)
        self.kwargs = kwargs

    def forward(self):
        from tests.models.h3.test_h3_diffusers_parity import diffusers_outputs

        out_v, out_a = self.model(**self.kwargs)
        v_video, v_audio = diffusers_outputs(out_v.float(), out_a.float(), self.video, self.audio)
        return v_video[None], v_audio[None]

    def __call__(self):
        v_video, v_audio = self.forward()
        sv, sv_next, sa, sa_next = (torch.tensor(s, dtype=torch.float32) for s in SIGMAS)
        return euler_step(self.video[None], v_video, sv, sv_next), euler_step(self.audio[None], v_audio, sa, sa_next)


class BareMatmul:
    """The machine's limit for one dtype: a large square matrix product (2 n^3 FLOPs)."""

    def __init__(self, n: int, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(2)
        self.a = torch.randn(n, n, generator=gen).to(dtype)
        self.b = torch.randn(n, n, generator=gen).to(dtype)
        self.flops = 2 * n ** 3

    def __call__(self):
        return self.a @ self.b

    def onednn(self):
        """The same product through oneDNN (what Weft's float32 Linear calls on an AVX-512 CPU)."""
        return torch.ops.mkldnn._linear_pointwise(self.a, self.b, None, "none", [], "")

    def widened(self):
        """The same half-precision product multiplied in float32 and rounded back (what a CPU without bf16 runs)."""
        return (self.a.float() @ self.b.float()).to(self.a.dtype)


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The CPU flash-attention op's FLOPs, counted as torch counts its GPU ops (torch 2.13 has no formula for it)."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def count_flops(step: DiffusersStep) -> dict[str, int]:
    """Matrix-product and attention FLOPs of one forward (torch's FlopCounterMode), in total and per kind.

    torch's counter has no formula for the CPU flash-attention op and would count the attention as zero;
    the formula of its GPU attention ops is registered for it here.
    """
    from torch.utils.flop_counter import FlopCounterMode

    attention_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    counter = FlopCounterMode(display=False, custom_mapping={attention_op: _cpu_attention_flops})
    with counter:
        step.forward()
    per_op = counter.get_flop_counts()["Global"]
    attention = sum(count for op, count in per_op.items() if "attention" in str(op))
    total = int(counter.get_total_flops())
    return {"total": total, "attention": attention, "matmul": total - attention}


def measure(runs: dict, rounds: int, rounds_of: dict[str, int] | None = None
            ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall, process CPU) seconds per variant per round; each variant once a round, the order rotated.

    `rounds_of` names variants timed in only their first N rounds (diffusers' bfloat16 step, emulated on a CPU
    without bfloat16 arithmetic, is several times every other row and far from any target).
    CPU time counts only the time this process ran, so on a machine shared with other busy
    processes it is the steadier figure; wall time is what a user waits.
    """
    order = list(runs)
    rounds_of = rounds_of or {}
    wall = {key: [] for key in order}
    cpu = {key: [] for key in order}
    gc.disable()
    try:
        for index in range(rounds):
            shift = index % len(order)
            for key in order[shift:] + order[:shift]:
                if index >= rounds_of.get(key, rounds):
                    continue
                cpu_start, start = time.process_time(), time.perf_counter()
                runs[key]()
                wall[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - cpu_start)
    finally:
        gc.enable()
    return wall, cpu


# ----------------------------------------------------------------------------------------------
# profile

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_int_mm",
              "aten::baddbmm", "mkldnn", "aten::_weight_int8pack_mm", "weft::onednn_linear")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "aten::_efficient_attention")
COPY_OPS = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat",
            "aten::empty", "aten::empty_like", "aten::stack", "aten::index", "aten::slice", "aten::view",
            "aten::reshape", "aten::unbind", "aten::select", "aten::transpose", "aten::t", "aten::expand",
            "aten::as_strided", "aten::chunk", "aten::split", "aten::unsqueeze", "aten::flatten",
            "aten::_unsafe_view", "aten::detach", "aten::lift_fresh", "aten::alias", "aten::resize_",
            "aten::fill_", "aten::zero_", "aten::zeros", "aten::ones", "aten::arange", "aten::unique",
            "aten::_unique2", "aten::item", "aten::_local_scalar_dense", "aten::set_", "aten::scalar_tensor")
COMPILED_OPS = ("Torch-Compiled Region", "CompiledFunction", "CompiledFxGraph", "cpp_fused", "inductor")


def _op_category(name: str) -> str:
    if any(name.startswith(p) or p in name for p in ATTENTION_OPS):
        return "attention"
    if any(name.startswith(p) for p in MATMUL_OPS):
        return "matmuls"
    if any(p in name for p in COMPILED_OPS):
        return "compiled fused passes (norms, modulation, rope, prologue/epilogue)"
    if name in COPY_OPS:
        return "copies, views, casts"
    if name.startswith("aten::"):
        return "norms/modulation/rope (elementwise)"
    return "other ops"


PYTHON_BUCKETS = (("memory-manager bookkeeping", ("models/memory.py",)),
                  ("adapter/patch checks", ("models/patcher.py",)),
                  ("kernel dispatch (registry, argument checks)", ("kernels/",)),
                  ("model code (Python)", ("models/",)))


def profile_step(step: WeftStep) -> dict:
    """Shares of one Weft forward: op categories (torch profiler) and the Python time split by where it runs."""
    from torch.profiler import ProfilerActivity, profile

    step.forward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step.forward()
        wall = time.perf_counter() - start
    op_seconds: dict[str, float] = {}
    for event in prof.key_averages():
        category = _op_category(event.key)
        op_seconds[category] = op_seconds.get(category, 0.0) + event.self_cpu_time_total / 1e6
    python_seconds = max(0.0, wall - sum(op_seconds.values()))
    shares = {name: seconds / wall for name, seconds in op_seconds.items()}

    # The Python time (wall minus time inside ops), split by cProfile's own-time per source file.
    profiler = cProfile.Profile()
    profiler.enable()
    step.forward()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    root = str(Path(__file__).resolve().parent.parent) + "/"
    bucket_time = {name: 0.0 for name, _ in PYTHON_BUCKETS}
    bucket_time["torch and standard library (Python)"] = 0.0
    calls = {name: 0 for name in bucket_time}
    for (filename, _line, _func), (_cc, ncalls, tottime, _cum, _callers) in stats.items():
        if filename == "~":  # a builtin, i.e. the op itself (timed by the torch profiler)
            continue
        relative = filename[len(root):] if filename.startswith(root) else None
        bucket = "torch and standard library (Python)"
        if relative is not None:
            bucket = next((name for name, prefixes in PYTHON_BUCKETS if relative.startswith(prefixes)), bucket)
        bucket_time[bucket] += tottime
        calls[bucket] += ncalls
    python_total = sum(bucket_time.values()) or 1.0
    for name, seconds in bucket_time.items():
        shares[f"python: {name}"] = python_seconds / wall * seconds / python_total
    top = sorted(((e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()),
                 key=lambda item: -item[1])[:12]
    return {"wall_s": wall, "shares": shares, "python_calls": calls, "top_ops": top}


# ----------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny config, one thread, two rounds (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds per size (default 5 small, 3 large)")
    parser.add_argument("--threads", default=None, help="comma-separated torch thread counts (default 1,2)")
    parser.add_argument("--sizes", default=None, help="comma-separated sizes of small,large (default both)")
    parser.add_argument("--no-quantized", action="store_true", help="skip the int8 and nvfp4 models")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-op profile")
    parser.add_argument("--bf16-reference-rounds", type=int, default=1,
                        help="rounds that time diffusers' bfloat16 step (default 1: it takes several times the others)")
    args = parser.parse_args()
    if importlib.util.find_spec("diffusers") is None:
        raise SystemExit("bench/dit_step.py needs diffusers (the test extra: requirements-test.txt)")
    torch.set_grad_enabled(False)
    config = QUICK_CONFIG if args.quick else QUARTER_CONFIG
    sizes = ["quick"] if args.quick else (args.sizes.split(",") if args.sizes else ["small", "large"])
    threads_list = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    matmul_n = 512 if args.quick else 2048
    state = seeded_state(config)
    params = sum(v.numel() for v in state.values())
    load = os.getloadavg()[0]
    print(f"H3 transformer: hidden {config.hidden_size}, {config.num_layers} blocks + {config.refiner_layers} "
          f"refiner, {config.num_heads} heads x {config.head_dim}, ffn {config.ffn_size}; {params / 1e6:.0f}M parameters; "
          f"CPU ({os.cpu_count()} cores), load average {load:.1f} at start (a shared machine: ratios are what count)")

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(Path(tmp), state)
        weft = {"fp32": load_model(paths["fp32"], dtype=torch.float32).model,
                "bf16": load_model(paths["fp32"], dtype=torch.bfloat16).model}
        if not args.no_quantized:
            weft["int8"] = load_model(paths["int8"], dtype=torch.bfloat16).model
            weft["nvfp4"] = load_model(paths["nvfp4"], dtype=torch.bfloat16).model
    reference = {"fp32": diffusers_model(config, state, torch.float32),
                 "bf16": diffusers_model(config, state, torch.bfloat16)}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}

    results, profiles = [], {}
    started = time.perf_counter()
    for threads in threads_list:
        torch.set_num_threads(threads)
        for size in sizes:
            latents = step_latents(config, size)
            runs = {}
            for name, model in weft.items():
                runs[f"weft {name}"] = WeftStep(model, latents, dtypes.get(name, torch.bfloat16))
            for name, model in reference.items():
                runs[f"diffusers {name}"] = DiffusersStep(model, latents, dtypes[name])
            bare = {name: BareMatmul(matmul_n, dtype) for name, dtype in dtypes.items()}
            for name, matmul in bare.items():
                runs[f"matmul {name}"] = matmul
            runs["matmul fp32 onednn"] = bare["fp32"].onednn
            runs["matmul bf16 widened"] = bare["bf16"].widened
            counted = count_flops(runs["diffusers bf16"])  # the same count in any dtype; bf16 runs faster
            flops = counted["total"]
            # Warm-up (compiles, fills the managers) and parity of each Weft model with diffusers' float32.
            ref_video = runs["diffusers fp32"]()[0]
            drift = {}
            for key, run in runs.items():  # one call each: compiles, fills the managers
                out = run()
                if key.startswith("weft"):
                    drift[key] = float((out[0] - ref_video).abs().max() / ref_video.abs().max())
            rounds = args.rounds or (2 if args.quick else 3 if size == "small" else 2)
            wall, cpu = measure(runs, rounds, rounds_of={"diffusers bf16": args.bf16_reference_rounds})
            rows = {}
            limit = {}
            for clock, times in (("wall", wall), ("cpu", cpu)):
                # The machine's limit: the fastest bare product of each dtype's matrices, at its best round
                # (float32: torch's or oneDNN's; bfloat16: native, or widened to float32 and rounded back).
                limit[clock] = {name: max(matmul.flops / min(values) for key, values in times.items()
                                          if key == f"matmul {name}" or key.startswith(f"matmul {name} "))
                                for name, matmul in bare.items()}
                for key, values in times.items():
                    if key.startswith("matmul"):
                        continue
                    dtype_name = "fp32" if key.endswith("fp32") else "bf16"
                    median, best = statistics.median(values), min(values)
                    row = rows.setdefault(key, {})
                    row[clock] = {"min_s": best, "median_s": median, "useful_flops_per_s": flops / median,
                                  "fraction_of_limit": flops / median / limit[clock][dtype_name]}
                    if key.startswith("weft"):
                        against = times["diffusers bf16" if key in ("weft int8", "weft nvfp4") else f"diffusers {dtype_name}"]
                        row[clock]["over_diffusers_median"] = median / statistics.median(against)
                        row[clock]["over_diffusers_min"] = best / min(against)
                        row["drift_vs_diffusers_fp32"] = drift[key]
                # The floor: every counted FLOP at the bare product's rate, nothing else. A ratio to diffusers
                # below floor / diffusers is out of reach on this machine for any implementation of the same math.
                against = times["diffusers fp32"]
                floor = flops / limit[clock]["fp32"]
                rows.setdefault("floor fp32", {})[clock] = {
                    "min_s": floor, "median_s": floor, "useful_flops_per_s": limit[clock]["fp32"],
                    "fraction_of_limit": 1.0, "over_diffusers_median": floor / statistics.median(against),
                    "over_diffusers_min": floor / min(against)}
            result = {"threads": threads, "size": size, "tokens": sequence_rows(size), "rounds": rounds, "flops": flops,
                      "attention_flops": counted["attention"], "matmul_limit_flops_per_s": limit, "rows": rows}
            results.append(result)
            print_table(result)
            if threads == threads_list[0] and size == sizes[0] and not args.no_profile:
                for name in ("fp32", "bf16"):
                    profiles[name] = profile_step(runs[f"weft {name}"])
                    print_profile(name, profiles[name])

    targets_met = check_targets(results)
    print(f"total {time.perf_counter() - started:.0f} s")
    print(json.dumps({"bench": "dit_step", "params": params, "config": config.__dict__ | {"patch_size": list(config.patch_size)},
                      "targets": TARGETS, "targets_met": targets_met, "results": results,
                      "profile": {k: {"wall_s": v["wall_s"], "shares": v["shares"]} for k, v in profiles.items()}},
                     default=str))


def print_table(result: dict) -> None:
    print(f"\n{result['size']}: {result['tokens']} tokens, {result['threads']} thread(s), {result['rounds']} rounds; "
          f"{result['flops'] / 1e9:.1f} GFLOP per step, {result['attention_flops'] / 1e9:.1f} of them in attention")
    for clock in ("cpu", "wall"):
        limit = result["matmul_limit_flops_per_s"][clock]
        print(f"  [{clock} time] matmul limit fp32 {limit['fp32'] / 1e9:.1f} GFLOP/s, bf16 {limit['bf16'] / 1e9:.1f} GFLOP/s")
        print(f"  {'variant':<16} {'min s':>8} {'median s':>9} {'of limit':>9} {'vs diffusers':>13} {'drift':>9}")
        for key, row in result["rows"].items():
            figures = row[clock]
            ratio = f"{figures['over_diffusers_median']:.3f}x" if "over_diffusers_median" in figures else ""
            drift = f"{row['drift_vs_diffusers_fp32']:.1e}" if "drift_vs_diffusers_fp32" in row else ""
            print(f"  {key:<16} {figures['min_s']:>8.3f} {figures['median_s']:>9.3f} {figures['fraction_of_limit']:>8.1%} "
                  f"{ratio:>13} {drift:>9}")


def print_profile(name: str, profile: dict) -> None:
    print(f"\nprofile of Weft's {name} forward ({profile['wall_s'] * 1e3:.0f} ms under the profiler): share of wall time")
    for category, share in sorted(profile["shares"].items(), key=lambda item: -item[1]):
        print(f"  {category:<58} {share:>6.1%}")
    print("  top ops (self time): " + ", ".join(f"{k} {s * 1e3:.0f} ms/{n}" for k, s, n in profile["top_ops"][:8]))


def check_targets(results: list[dict]) -> dict:
    """Each Done-when target per size and thread count, judged on the median CPU and wall times."""
    met = {}
    for result in results:
        stem = f"{result['size']}_{result['threads']}t"
        rows = result["rows"]
        for clock in ("cpu", "wall"):
            for name in ("fp32", "bf16"):
                figures = rows[f"weft {name}"][clock]
                met[f"{stem}_{name}_limit_{clock}"] = figures["fraction_of_limit"] >= TARGETS["fraction_of_matmul_limit"]
                met[f"{stem}_{name}_vs_diffusers_{clock}"] = figures["over_diffusers_median"] <= TARGETS["weft_over_diffusers"]
            if "weft int8" in rows:
                met[f"{stem}_int8_vs_diffusers_bf16_{clock}"] = (rows["weft int8"][clock]["over_diffusers_median"]
                                                                 <= TARGETS["int8_over_diffusers_bf16"])
    print("\ntargets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()))
    return met


if __name__ == "__main__":
    main()
