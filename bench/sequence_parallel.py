"""Sequence-parallel H3: one DiT step and one video decode on 1 rank vs 2 ranks, side by side in one run.

Two gloo ranks (spawned processes, one compute thread each, 127.0.0.1) stay up for the whole run. For each
sequence length (about 8k, 16k and 32k packed rows) the same DiT step (one transformer forward of a
config four times wider than the tiny one) runs alternately on rank 0 alone (rank 1 waits at a barrier,
idle) and on both ranks, `REPEATS` times each; the table shows the median and min time per step, their
ratio (the speed-up), the bytes each rank sends per step, and the peak memory of new tensors per rank
during a step (models/h3/tiling.measure_peak_bytes, taken in one extra, untimed call: weights and inputs
are made before it and are not counted). The decode split is measured the same way: the tiny video VAE
decoding a latent of several temporal windows, on one rank vs two.

The outputs of the two ways are compared too (they must match; the tests hold the bound).

Run: .venv/bin/python bench/sequence_parallel.py [--tokens 8192,16384,32768] [--repeats 3]
(about 10-20 minutes on 2 CPU cores). The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
# (latent T', latent H, latent W) per target row count: T' * H/2 * W/2 video rows + 2 * 40 audio + 32 text.
SHAPES = {8192: (7, 48, 96), 16384: (7, 96, 96), 32768: (12, 96, 112)}
AUDIO_FRAMES, TEXT_ROWS = 40, 32
DECODE_LATENT = (1, 24, 22, 8, 8)     # 4 temporal windows of the video VAE


def _config():
    from models.h3 import transformer
    return dataclasses.replace(transformer.TINY_CONFIG, hidden_size=256, num_heads=4, head_dim=64, ffn_size=768,
                               text_dim=64, time_hidden_size=256, time_embed_dim=64)


def _timed(call) -> tuple[float, object]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def _rank(rank: int, port: int, tokens: list[int], repeats: int, conn) -> None:
    os.environ.setdefault("WEFT_KERNEL_BACKEND", "linear:eager")  # no torch.compile time inside a measurement
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed

    torch.set_num_threads(1)
    from models import parallel
    from models.h3 import transformer
    from models.h3.make_tiny import _init_weights, build_tiny
    from models.h3.tiling import measure_peak_bytes

    comm = parallel.Communicator.start(rank=rank, size=2, address=f"tcp://127.0.0.1:{port}", backend="gloo",
                                       timeout_s=1800)
    model = transformer.H3Transformer(_config())
    _init_weights(model, 5)
    model.eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []

    def measure(name: str, run_one, run_group) -> dict:
        """Alternate one rank / the group; then one untimed call each under the memory tracker."""
        times = {"one": [], "group": []}
        outputs = {}
        for _ in range(repeats):
            for way in ("one", "group"):
                comm.barrier()
                if way == "one":
                    parallel.configure(None)
                    if rank == 0:
                        seconds, outputs["one"] = _timed(run_one)
                        times["one"].append(seconds)
                    parallel.configure(comm)
                else:
                    sent = comm.bytes_sent
                    seconds, outputs["group"] = _timed(run_group)
                    times["group"].append(seconds)
                    bytes_sent = comm.bytes_sent - sent
        comm.barrier()
        peak_one = 0
        if rank == 0:
            parallel.configure(None)
            _, peak_one = measure_peak_bytes(run_one, "cpu")
            parallel.configure(comm)
        comm.barrier()
        _, peak_group = measure_peak_bytes(run_group, "cpu")
        return {"name": name, "times": times, "bytes_sent": bytes_sent, "peak_one": peak_one,
                "peak_group": peak_group, "outputs": outputs}

    for count in tokens:
        lt, lh, lw = SHAPES[count]
        video = torch.randn(1, 24, lt, lh, lw, generator=gen)
        audio = torch.randn(1, 32, 2, AUDIO_FRAMES, generator=gen)
        text = torch.randn(1, TEXT_ROWS, model.config.text_dim, generator=gen)

        def step():
            with torch.no_grad():
                return model(video, audio, text, 0.7, 0.5)
        rows.append({"tokens": lt * (lh // 2) * (lw // 2) + 2 * AUDIO_FRAMES + TEXT_ROWS, **measure("dit", step, step)})

    vae = build_tiny("video_vae").eval()
    latent = torch.randn(*DECODE_LATENT, generator=gen)
    rows.append({"tokens": 0, **measure("decode", lambda: vae.decode(latent), lambda: vae.decode(latent))})

    # Rank 1 reports its own figures to rank 0 (over the group, pickled between our own processes).
    mine = [{k: v for k, v in row.items() if k != "outputs"} for row in rows]
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        for row, other in zip(rows, gathered[1]):
            one, group = row["outputs"]["one"], row["outputs"]["group"]
            pairs = zip(one, group) if isinstance(one, tuple) else [(one, group)]
            row["max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
            row["peak_group_rank1"] = other["peak_group"]
            row["bytes_sent_rank1"] = other["bytes_sent"]
            row.pop("outputs")
        conn.send(rows)
    comm.close()


def main(argv: list[str] | None = None) -> None:
    import multiprocessing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,16384,32768", help="sequence lengths (of 8192, 16384, 32768)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per way and length")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    procs = [context.Process(target=_rank, args=(r, port, tokens, args.repeats, send if r == 0 else None))
             for r in range(2)]
    for p in procs:
        p.start()
    rows = receive.recv()
    for p in procs:
        p.join()

    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          "(other work shares these cores, so the times are noisy)")
    header = (f"{'what':<8}{'rows':>7}{'1 rank s (med/min)':>21}{'2 ranks s (med/min)':>22}{'speed-up':>10}"
              f"{'MiB sent/rank':>15}{'peak MiB 1 rank':>17}{'peak MiB/rank 2':>17}{'peak ratio':>12}{'max rel diff':>14}")
    print(header)
    figures = []
    for row in rows:
        one, group = row["times"]["one"], row["times"]["group"]
        med1, med2 = statistics.median(one), statistics.median(group)
        peak2 = max(row["peak_group"], row["peak_group_rank1"])
        figure = {"what": row["name"], "rows": row["tokens"], "one_rank_s_median": med1, "one_rank_s_min": min(one),
                  "two_ranks_s_median": med2, "two_ranks_s_min": min(group), "speedup_median": med1 / med2,
                  "speedup_min": min(one) / min(group),
                  "bytes_sent_per_rank": max(row["bytes_sent"], row["bytes_sent_rank1"]),
                  "peak_bytes_one_rank": row["peak_one"], "peak_bytes_per_rank_two": peak2,
                  "peak_ratio": peak2 / max(1, row["peak_one"]), "max_rel_diff": row["max_rel_diff"]}
        figures.append(figure)
        print(f"{row['name']:<8}{row['tokens']:>7}{med1:>12.2f} / {min(one):<7.2f}{med2:>13.2f} / {min(group):<7.2f}"
              f"{figure['speedup_median']:>9.2f}x{figure['bytes_sent_per_rank'] / MIB:>15.1f}"
              f"{row['peak_one'] / MIB:>17.1f}{peak2 / MIB:>17.1f}{figure['peak_ratio']:>12.2f}"
              f"{row['max_rel_diff']:>14.1e}")
    print(json.dumps({"bench": "sequence_parallel", "repeats": args.repeats, "load_average": load,
                      "rows": figures}))


if __name__ == "__main__":
    main()
