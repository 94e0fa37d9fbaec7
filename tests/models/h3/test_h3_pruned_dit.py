"""The pruned (curve-form AdaLN) H3 DiT: detected by its keys, config recovered from shapes, and run.

A pruned checkpoint has no time embedder: every AdaLN projection reads a row of `adaln_t_table`, a
float32 table sampling a curve over t in [0, 1] (row k at t = k / (rows - 1)), linearly interpolated
between rows, with no SiLU in front of the projection. So a pruned model whose table holds
silu(time_embedder(k / (rows - 1))) of a full model, with the full model's projections, is that full
model wherever t falls on a row. The full model's reference is diffusers' own transformer.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from models.h3 import transformer
from models.h3.make_tiny import build_tiny
from models.loading import load_model, read_header

pytest.importorskip("diffusers", minversion="0.42.1")
from tests.models.h3.test_h3_diffusers_parity import diffusers_forward, inputs, to_diffusers  # noqa: E402

ROWS = 1025


def pruned_state_of(full: transformer.H3Transformer) -> dict[str, torch.Tensor]:
    """A curve-form state dict equivalent to `full` on the table's grid of t."""
    grid = torch.linspace(0.0, 1.0, ROWS, dtype=torch.float64).float()
    with torch.no_grad():
        table = torch.nn.functional.silu(full.time_embedder(grid).float())
    state = {k: v.detach().clone().contiguous() for k, v in full.state_dict().items() if not k.startswith("time_embedder.")}
    state["adaln_t_table"] = table.contiguous()
    return state


@pytest.fixture(scope="module")
def full():
    return build_tiny("transformer").float()


def test_pruned_file_is_detected_and_its_config_recovered(full, tmp_path):
    path = tmp_path / "pruned.safetensors"
    save_file(pruned_state_of(full), str(path))
    loaded = load_model(path, expect="h3_transformer")
    assert loaded.config.adaln_curve_points == ROWS
    assert loaded.config.time_embed_dim == full.config.time_embed_dim
    assert not hasattr(loaded.model, "time_embedder")
    assert dataclasses.replace(loaded.config, adaln_curve_points=None, time_freq_dim=full.config.time_freq_dim,
                               time_hidden_size=full.config.time_hidden_size) == full.config


@pytest.mark.parametrize("sigmas", [(0.75, 0.5), (0.25, 0.125)])
def test_pruned_model_on_the_grid_equals_the_full_model_in_diffusers(full, tmp_path, sigmas):
    # t = 1 - sigma lands on table rows (multiples of 1/1024); condition rows sit at t = 1, the last row.
    path = tmp_path / "pruned.safetensors"
    save_file(pruned_state_of(full), str(path))
    pruned = load_model(path).model.float()
    reference = to_diffusers(full)
    video, audio, text = inputs(5)
    with torch.no_grad():
        v, a = pruned(video[None], audio[None], text[None], *sigmas)
    rv, ra = diffusers_forward(reference, video, audio, text, *sigmas)
    assert torch.allclose(v[0], rv, atol=1e-5, rtol=0), (v[0] - rv).abs().max()
    assert torch.allclose(a[0], ra, atol=1e-5, rtol=0), (a[0] - ra).abs().max()


def test_time_embedding_interpolates_between_rows_and_clamps(tmp_path):
    cfg = dataclasses.replace(transformer.TINY_CONFIG, adaln_curve_points=5, time_embed_dim=3)
    model = transformer.H3Transformer(cfg)
    table = torch.arange(15, dtype=torch.float32).view(5, 3) ** 2          # rows at t = 0, .25, .5, .75, 1
    model.adaln_t_table.copy_(table)
    t = torch.tensor([0.0, 0.1, 0.25, 0.6, 1.0, 1.5, -0.2])
    want = []
    for value in t.tolist():
        x = min(max(value, 0.0), 1.0) * 4
        lo = min(int(x), 3)
        want.append(table[lo] + (x - lo) * (table[lo + 1] - table[lo]))
    torch.testing.assert_close(model.time_embedding(t), torch.stack(want), rtol=1e-6, atol=1e-5)


def test_released_pruned_layout_loads_with_float32_adaln(tmp_path):
    from models.h3.tiny_released import pruned_transformer_bytes
    path = tmp_path / "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
    path.write_bytes(pruned_transformer_bytes(2001))
    header = read_header(path)
    assert "time_embedder.proj_in.weight" not in header.tensors
    assert header.tensors["adaln_t_table"].dtype == "F32" and header.tensors["adaln_t_table"].shape == (1025, 8)
    assert header.tensors["blocks.0.adaln_proj.linear.weight"].dtype == "F16"
    assert header.tensors["blocks.0.attn.qkv_proj.weight"].dtype == "I8"
    model = load_model(path).model
    assert model.blocks[0].adaln_proj.linear.weight.dtype == torch.float32      # run as the reference runs it
    assert model.condition_proj.weight.dtype == torch.bfloat16
    video, audio, text = inputs(6)
    with torch.no_grad():
        v, a = model(video[None], audio[None], text[None], 0.6, 0.3)
    assert torch.isfinite(v).all() and torch.isfinite(a).all() and v.abs().mean() > 0.1
