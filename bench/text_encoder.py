"""The Qwen3-VL text encoder stored as the released file stores it (nvfp4 linears, int8 token table) against
the same model in bfloat16: prompt tokens per second and peak resident weight bytes, side by side.

Two language-model sizes, each written twice by Weft's own writer from one random model:
  tiny     the tiny encoder `make_tiny --released-formats` writes (48 wide, 3 layers)
  eighth   the released language model at 1/8 of its width and all 50 of its layers: hidden 640, MLP
           3200, 8 query heads and 1 key/value head of 128, the full 151,936-token table; its vision
           tower is small (prompts here are text, which never runs it)
nvfp4: the file as released (nvfp4 linears with AWQ pre_quant_scale on o_proj/down_proj, int8 token
table, bf16 norms and vision tower); bf16: every weight in bfloat16. Both run in float32 activations,
as the encoder does; the bf16 weights are widened per op.

Peak resident bytes are the memory manager's (host copies stand in on a machine without a GPU) in its
lowvram mode, which streams the layers one at a time, and in highvram mode, which keeps every weight
taken. Tokens per second: a prompt of `--tokens` tokens encoded `--rounds` times without a manager
(median), after those two runs.

On a CPU the nvfp4 layers are decoded to float before each product (no nvfp4 arithmetic there), which
is what their speed measures. About 4 minutes of CPU time on 2 cores (more when the machine is shared); --quick (8 layers) about 1.

Run: .venv/bin/python bench/text_encoder.py [--tokens 64] [--rounds 1] [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import memory  # noqa: E402
from models.h3.make_tiny import _init_weights  # noqa: E402
from models.h3.tiny_released import released_qwen3vl_tensors  # noqa: E402
from models.loading import load_model  # noqa: E402
from models.text.qwen3vl import (DEEPSTACK_METADATA, TINY_CONFIG, Qwen3VL, Qwen3VLConfig,  # noqa: E402
                                 Qwen3VLVisionConfig)


def eighth_config(layers: int) -> Qwen3VLConfig:
    """The released language model at 1/8 width (heads of 128 kept), with a small vision tower."""
    return Qwen3VLConfig(hidden_size=640, intermediate_size=3200, num_layers=layers, num_heads=8, num_kv_heads=1,
                         head_dim=128, vision=Qwen3VLVisionConfig(depth=3, hidden_size=64, intermediate_size=128,
                                                                  out_hidden_size=640, deepstack_layers=(0, 1, 2)))


def write_pair(directory: Path, name: str, config: Qwen3VLConfig) -> dict[str, Path]:
    """The nvfp4 file and the bf16 file of one seeded random model."""
    model = Qwen3VL(config)
    _init_weights(model, 3)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    metadata = {DEEPSTACK_METADATA: json.dumps(list(config.vision.deepstack_layers))}
    paths = {"nvfp4": directory / f"{name}_nvfp4.safetensors", "bf16": directory / f"{name}_bf16.safetensors"}
    save_file(released_qwen3vl_tensors(state), str(paths["nvfp4"]), metadata=metadata)
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(paths["bf16"]), metadata=metadata)
    return paths


def measure(path: Path, tokens: int, rounds: int) -> dict:
    """Tokens per second and peak resident bytes (lowvram and highvram) of one file."""
    model = load_model(str(path)).model
    ids = torch.arange(1000, 1000 + tokens)
    peaks = {}
    for mode in ("lowvram", "highvram"):
        manager = memory.MemoryManager(device="cpu", dtype=torch.float32, mode=mode)
        memory.activate(manager)
        try:
            model.encode(ids)
            peaks[mode] = manager.stats().peak_resident_bytes
        finally:
            memory.unconfigure()
    seconds = []  # the two runs above were the warm-up
    for _ in range(rounds):
        start = time.perf_counter()
        model.encode(ids)
        seconds.append(time.perf_counter() - start)
    return {"file_bytes": os.path.getsize(path), "tokens_per_s": tokens / statistics.median(seconds),
            "peak_lowvram_bytes": peaks["lowvram"], "peak_highvram_bytes": peaks["highvram"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="prompt length in tokens")
    parser.add_argument("--rounds", type=int, default=1, help="timed encodes per file (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="the 1/8-width model with 8 layers instead of 50")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    configs = {"tiny": TINY_CONFIG, "eighth": eighth_config(8 if args.quick else 50)}
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            paths = write_pair(Path(tmp), name, config)
            results[name] = {fmt: measure(path, args.tokens, args.rounds) for fmt, path in paths.items()}
    mib = 1024 ** 2
    print(f"Qwen3-VL text encoder, {args.tokens}-token text prompt, CPU, float32 activations, "
          f"median of {args.rounds}")
    print(f"{'model':30s} {'format':7s} {'file MiB':>9s} {'tokens/s':>9s} {'peak lowvram MiB':>17s} "
          f"{'peak highvram MiB':>18s}")
    for name, config in configs.items():
        label = f"{name} ({config.hidden_size} wide, {config.num_layers} layers)"
        for fmt, row in results[name].items():
            print(f"{label:30s} {fmt:7s} {row['file_bytes'] / mib:9.1f} {row['tokens_per_s']:9.1f} "
                  f"{row['peak_lowvram_bytes'] / mib:17.1f} {row['peak_highvram_bytes'] / mib:18.1f}")
    ratios = {name: {key: results[name]["nvfp4"][key] / results[name]["bf16"][key]
                     for key in ("file_bytes", "tokens_per_s", "peak_lowvram_bytes", "peak_highvram_bytes")}
              for name in configs}
    for name, ratio in ratios.items():
        print(f"{name}: nvfp4 / bf16 = file {ratio['file_bytes']:.2f}x, speed {ratio['tokens_per_s']:.2f}x, "
              f"peak lowvram {ratio['peak_lowvram_bytes']:.2f}x, peak highvram {ratio['peak_highvram_bytes']:.2f}x")
    summary = {"tokens": args.tokens, "rounds": args.rounds,
               "configs": {name: dataclasses.asdict(config) | {"vision": None} for name, config in configs.items()},
               "results": results, "nvfp4_over_bf16": ratios}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
