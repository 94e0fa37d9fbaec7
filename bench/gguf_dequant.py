"""Decoding one GGUF weight per op: the `gguf` package's numpy reference vs Weft's torch decoders.

Weft keeps GGUF layers in their block type and decodes the weight for every product, so the
decoder's cost is paid once per layer per step. This script measures both decoders on the same
bytes, side by side in one run, alternating (numpy, torch, numpy, torch, ...), and reports the
median time of each and the ratio numpy / torch. The blocks are random valid blocks (random code
and scale bytes, finite float16 super-block scales) for the K types and the torch encoder's
output for the 32-value types; both decoders are checked to agree bit for bit first.

Run: .venv/bin/python bench/gguf_dequant.py [--size 4096] [--repeats 5] [--types Q4_K,Q8_0,Q6_K,Q2_K] [--threads 1]
(needs the `gguf` test extra; last line: JSON with the figures). On a shared CPU the absolute
times are noisy; the ratio is the figure to read. Both run on the CPU with one thread by default
(numpy's decoder uses one core). The reason for the torch path is beyond this table: it runs where
the bytes are, so on an accelerator the weight is decoded there instead of on the host and copied.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.gguf_blocks import BLOCK_SIZES, decode_blocks  # noqa: E402
from models.quant.formats.gguf import WRITABLE_TYPES, encode_blocks  # noqa: E402

# Byte offsets of the float16 super-block scales (d, dmin) in each K block.
HALF_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def test_rows(type_name: str, size: int, seed: int = 0) -> np.ndarray:
    """uint8 rows (size, bytes per row) of valid `type_name` blocks for a size x size weight."""
    if type_name in WRITABLE_TYPES:
        gen = torch.Generator().manual_seed(seed)
        return encode_blocks(type_name, torch.randn(size, size, generator=gen) * 0.02).numpy()
    rng = np.random.default_rng(seed)
    block_values, block_bytes = BLOCK_SIZES[type_name]
    blocks = rng.integers(0, 256, size=(size * size // block_values, block_bytes), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        halves = (rng.standard_normal(blocks.shape[0]) * 1e-3).astype(np.float16)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(size, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="the weight is size x size (default 4096)")
    parser.add_argument("--repeats", type=int, default=5, help="timed decodes per decoder and type (default 5)")
    parser.add_argument("--types", default="Q4_K,Q8_0,Q6_K,Q2_K", help="comma-separated ggml block types")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: numpy's decoder runs on one core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import gguf  # the test extra (requirements-test.txt)

    rows = []
    for type_name in args.types.split(","):
        data = test_rows(type_name, args.size)
        qtype = gguf.GGMLQuantizationType[type_name]
        tensor = torch.from_numpy(data)
        reference = gguf.quants.dequantize(data, qtype)
        ours = decode_blocks(type_name, tensor)
        if not np.array_equal(ours.numpy().view(np.int32), reference.view(np.int32)):
            raise SystemExit(f"{type_name}: the decoders disagree; the timing would compare different work")
        times = {"numpy": [], "torch": []}
        for _ in range(args.repeats):  # alternating, so drift on a shared machine hits both
            start = time.perf_counter()
            gguf.quants.dequantize(data, qtype)
            times["numpy"].append(time.perf_counter() - start)
            start = time.perf_counter()
            decode_blocks(type_name, tensor)
            times["torch"].append(time.perf_counter() - start)
        numpy_ms = statistics.median(times["numpy"]) * 1e3
        torch_ms = statistics.median(times["torch"]) * 1e3
        rows.append({"type": type_name, "numpy_ms": round(numpy_ms, 1), "torch_ms": round(torch_ms, 1),
                     "numpy_over_torch": round(numpy_ms / torch_ms, 2), "bytes": int(data.nbytes)})
    print(f"GGUF decode of one {args.size}x{args.size} weight, median of {args.repeats}, "
          f"{torch.get_num_threads()} torch threads (CPU)")
    print(f"{'type':6} {'bytes':>11} {'numpy ms':>10} {'torch ms':>10} {'numpy/torch':>12}")
    for row in rows:
        print(f"{row['type']:6} {row['bytes']:>11} {row['numpy_ms']:>10} {row['torch_ms']:>10} "
              f"{row['numpy_over_torch']:>12}")
    print(json.dumps({"bench": "gguf_dequant", "size": args.size, "repeats": args.repeats,
                      "threads": torch.get_num_threads(), "results": rows}))


if __name__ == "__main__":
    main()
