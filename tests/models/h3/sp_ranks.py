"""Sequence-parallel test scaffolding: tiny H3 scenarios, and a launcher that runs them on N gloo ranks.

Every scenario is deterministic (seeded weights, inputs and noise), so the single process and each rank
build the same models and inputs; `run_scenarios` returns {name: tensor} for comparison.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models import parallel
from models.h3 import transformer
from models.h3.fun_control import FunControlConfig, FunControlHook, FunControlNet
from models.h3.make_tiny import _init_weights, write_tiny
from models.h3.sampling import sample, sigmas
from models.h3.sparse_attention import SparseAttentionSettings
from models.loading import load_model
from models.patcher import BLOCK_HOOKS, ModelHandle

# Four heads, so 1, 2 and 4 ranks divide them; the FastH3 gate so VSA's coarse branch trades heads too.
SP_CONFIG = dataclasses.replace(transformer.TINY_CONFIG, num_heads=4, gate_compress=True)
MODEL_SEED = 4242
STEPS = 3


def _text(length: int, seed: int) -> torch.Tensor:
    return torch.randn(1, length, SP_CONFIG.text_dim, generator=torch.Generator().manual_seed(seed))


def _latent(lt: int, lh: int, lw: int, at: int) -> dict:
    return {"samples": torch.zeros(1, 24, lt, lh, lw), "audio_samples": torch.zeros(1, 32, 2, at)}


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def base_model() -> transformer.H3Transformer:
    """The float32 tiny transformer every scenario but int8 samples with."""
    model = transformer.H3Transformer(SP_CONFIG)
    _init_weights(model, MODEL_SEED)
    return model.eval().requires_grad_(False)


def write_setup(folder: Path) -> Path:
    """The files the scenarios load (tiny VAEs, an int8-convrot transformer, a LoRA), written once."""
    from models.h3.tiny_released import RELEASED_INT8_LAYERS, ROTATION_GROUP
    from models.quant.writer import quantize_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    paths = {kind: str(path) for kind, path in write_tiny(folder).items()}
    state = {k: v.detach().float().contiguous() for k, v in base_model().state_dict().items()}
    tensors, _ = quantize_state_dict(state, RELEASED_INT8_LAYERS["h3_transformer"], "int8_tensorwise",
                                     rotation_group=ROTATION_GROUP)
    paths["int8"] = str(folder / "sp_int8_convrot.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, paths["int8"],
              metadata={"weft_config": json.dumps(dataclasses.asdict(SP_CONFIG))})
    lora = {}
    for n, block in enumerate(range(SP_CONFIG.num_layers)):
        for name, (out_f, in_f) in {"attn_qkv_proj": (3 * SP_CONFIG.inner_dim, SP_CONFIG.hidden_size),
                                    "mlp_fc2": (SP_CONFIG.hidden_size, SP_CONFIG.ffn_size)}.items():
            key = f"lora_unet_blocks_{block}_{name}"
            lora[f"{key}.lora_up.weight"] = _rand(out_f, 4, seed=10 * n + 1) * 0.2
            lora[f"{key}.lora_down.weight"] = _rand(4, in_f, seed=10 * n + 2) * 0.2
            lora[f"{key}.alpha"] = torch.tensor(4.0)
    paths["lora"] = str(folder / "sp_lora.safetensors")
    save_file(lora, paths["lora"])
    (folder / "paths.json").write_text(json.dumps(paths))
    return folder


def _fit(frames: torch.Tensor, width: int, height: int) -> torch.Tensor:
    return F.interpolate(frames.permute(0, 3, 1, 2), size=(height, width), mode="bilinear",
                         align_corners=False).permute(0, 2, 3, 1)


def run_scenarios(setup: Path, only: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every scenario's outputs, {scenario/output: tensor}; `only` limits the scenarios run."""
    from models.adapters import load_adapter

    paths = json.loads((Path(setup) / "paths.json").read_text())
    model = base_model()
    video_vae = load_model(paths["video_vae"]).model
    audio_vae = load_model(paths["audio_vae"]).model
    out: dict[str, torch.Tensor] = {}

    def run(name: str, handle, latent: dict, extras: dict | None = None, text_len: int = 7) -> dict:
        if only and name not in only:
            return {}
        conditioning = [[_text(text_len, 3), dict(extras or {})]]
        result = sample(handle, latent, conditioning, sigmas(STEPS, shift=3.0), noise_seed=11)
        out[f"{name}/video"], out[f"{name}/audio"] = result["samples"], result["audio_samples"]
        return result

    small = (2, 8, 6, 5)   # latent (T', H, W) and audio frames: 2 * 12 video rows + 10 audio + 7 text = 41 rows
    t2va = run("t2va", model, _latent(*small))
    if t2va:
        out["t2va/frames"] = video_vae.decode(t2va["samples"])
        out["t2va/sound"] = audio_vae.decode(t2va["audio_samples"])
        out["decode/frames"] = video_vae.decode(_rand(1, 24, 12, 2, 2, seed=5))   # three temporal windows
    keyframes = [{"frame_index": 0, "latent": _rand(1, 24, 1, 8, 6, seed=21)},
                 {"frame_index": -1, "latent": _rand(1, 24, 1, 8, 6, seed=22),
                  "audio_latent": _rand(1, 32, 2, 2, seed=23)}]
    run("fl2va", model, dict(_latent(7, 8, 6, 9), length=22), {"keyframes": keyframes})
    references = [{"kind": "image", "latent": _rand(1, 24, 1, 4, 4, seed=31)},
                  {"kind": "audio", "audio_latent": _rand(1, 32, 2, 3, seed=32)}]
    run("ref2va", model, _latent(*small), {"references": references})
    masked = _latent(*small)
    masked["samples"] = _rand(1, 24, 2, 8, 6, seed=41)
    masked["noise_mask"] = (torch.arange(8)[:, None] < 4).float().expand(2, 8, 6).clone()
    masked["audio_samples"] = _rand(1, 32, 2, 5, seed=42)
    masked["audio_noise_mask"] = (torch.arange(5) >= 2).float()
    run("masked", model, masked)
    if not only or "int8" in only:
        run("int8", load_model(paths["int8"]).model, _latent(*small))
    if not only or "lora" in only:
        run("lora", ModelHandle(model).with_adapter(load_adapter(paths["lora"]), 0.8), _latent(*small))
    vsa = SparseAttentionSettings("vsa", keep_ratio=0.5, min_tokens=0)
    # A (7, 16, 16) latent: 7 x 8 x 8 video rows make 8 VSA cubes, so half the tiles are skipped.
    run("vsa", ModelHandle(model).with_options(sparse_attention=vsa), _latent(7, 16, 16, 9))
    if not only or "fun_control" in only:
        net = FunControlNet(FunControlConfig(hidden_size=SP_CONFIG.hidden_size, num_heads=SP_CONFIG.num_heads,
                                             head_dim=SP_CONFIG.head_dim, ffn_size=SP_CONFIG.ffn_size,
                                             time_embed_dim=SP_CONFIG.time_embed_dim, injection_layers=(0, 1)))
        _init_weights(net, 77)
        hook = FunControlHook(net.eval(), video_vae.encode, _fit, strength=0.7, sigma_start=1.0, sigma_end=0.0,
                              control_video=torch.rand(5, 32, 24, 3, generator=torch.Generator().manual_seed(51)))
        run("fun_control", ModelHandle(model).with_options(**{BLOCK_HOOKS: (hook,)}), _latent(*small))
    return out


# The launcher -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, size: int, port: int, job: str, setup: str, result_dir: str, timeout_s: float) -> None:
    """One rank: join the group, run `job`, save what it returns (or the error) under result_dir."""
    torch.set_num_threads(1)
    result = Path(result_dir)
    try:
        comm = parallel.Communicator.start(rank=rank, size=size, address=f"tcp://127.0.0.1:{port}",
                                           backend="gloo", timeout_s=timeout_s)
        parallel.configure(comm)
        tensors = JOBS[job](Path(setup), comm)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(result / f"rank{rank}.safetensors"))
        comm.close()
    except BaseException as err:  # the test reads what each rank raised
        (result / f"rank{rank}.error").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")


def run_ranks(size: int, job: str, setup: Path, result_dir: Path, *, timeout_s: float = 60.0,
              wait_s: float = 600.0) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, str]]:
    """Run `job` on `size` spawned gloo ranks: ({rank: outputs}, {rank: error text})."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    result_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [context.Process(target=rank_main, args=(r, size, port, job, str(setup), str(result_dir), timeout_s))
             for r in range(size)]
    for p in procs:
        p.start()
    # Rank 0 speaks for the group; the others get a short grace after it (a stalled rank is then killed).
    procs[0].join(wait_s)
    deadline = time.monotonic() + 30.0
    for p in procs[1:]:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    outputs = {r: load_file(str(result_dir / f"rank{r}.safetensors")) for r in range(size)
               if (result_dir / f"rank{r}.safetensors").exists()}
    errors = {r: (result_dir / f"rank{r}.error").read_text() for r in range(size)
              if (result_dir / f"rank{r}.error").exists()}
    return outputs, errors


def _all_scenarios(setup: Path, comm: parallel.Communicator) -> dict[str, torch.Tensor]:
    only = os.environ.get("WEFT_SP_ONLY")
    return run_scenarios(setup, tuple(only.split(",")) if only else ())


def _refused(setup: Path, comm: parallel.Communicator) -> dict[str, torch.Tensor]:
    two_heads = transformer.H3Transformer(transformer.TINY_CONFIG).eval()
    try:
        sample(two_heads, _latent(2, 4, 4, 3), [[torch.zeros(1, 3, 48), {}]], sigmas(1), noise_seed=0)
    except ValueError as err:
        return {"message": torch.tensor(list(str(err).encode()), dtype=torch.uint8)}
    return {}


class _DieAt:
    """A block hook that ends (or stalls) rank 1 inside the second step's second block."""

    def __init__(self, how: str) -> None:
        self.how, self.calls = how, 0

    def begin(self, context):
        self.calls += 1
        if self.calls < 2 or parallel.communicator().rank != 1:
            return None

        def after(index, block_input, block_output):
            if index == 1:
                if self.how == "kill":
                    os._exit(3)
                time.sleep(3600)
            return block_output
        return after


def _rank_lost(how: str):
    def job(setup: Path, comm: parallel.Communicator) -> dict[str, torch.Tensor]:
        handle = ModelHandle(base_model()).with_options(**{BLOCK_HOOKS: (_DieAt(how),)})
        started = time.monotonic()
        try:
            sample(handle, _latent(2, 8, 6, 5), [[_text(7, 3), {}]], sigmas(STEPS, shift=3.0), noise_seed=11)
        except parallel.RankFailure as err:
            return {"message": torch.tensor(list(str(err).encode()), dtype=torch.uint8),
                    "seconds": torch.tensor([time.monotonic() - started], dtype=torch.float64)}
        return {}
    return job


JOBS = {"scenarios": _all_scenarios, "refused": _refused, "killed": _rank_lost("kill"), "hung": _rank_lost("hang")}
