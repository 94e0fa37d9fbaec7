"""Block-sparse attention in the H3 transformer: the VSA tiles of a packed sequence, the same call as
comfy-kitchen's eager `sol_attn` on them, a FastH3 DiT with `to_gate_compress`, and when blocks go sparse."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from models.h3 import packing, transformer
from models.h3.make_tiny import _init_weights
from models.h3.sparse_attention import (SparseAttentionSettings, parse_block_list, percent_to_sigma, sparse_call,
                                        vsa_plan)
from models.loading import load_model
from models.patcher import ModelHandle

sol_attn = pytest.importorskip("comfy_kitchen.backends.eager.sol_attn").sol_attn

GATED = dataclasses.replace(transformer.TINY_CONFIG, gate_compress=True)


def layout_of(text=70, lt=5, lh=10, lw=12, at=9):
    return packing.build_layout(text, lt, lh, lw, at), (lt, lh, lw)


def test_vsa_tiles_hold_each_row_once_prefix_segments_apart_and_video_in_cubes():
    layout, (lt, lh, lw) = layout_of()
    plan = vsa_plan(layout, lt, lh, lw)
    live = plan.source[plan.source >= 0]
    assert sorted(live.tolist()) == list(range(layout.seq_len))
    assert torch.equal(plan.source[plan.position], torch.arange(layout.seq_len))
    tiles = plan.source.view(-1, 64)
    # text (70 rows) takes two tiles, target audio (18 rows) one, each padded on its own
    assert plan.prefix_tiles == 3 and plan.tile_len[:3].tolist() == [64, 6, 18]
    video = layout.segment(packing.SegmentRole.VIDEO)
    grid = (lt, lh // 2, lw // 2)                               # 5 x 5 x 6 patches -> 2 x 2 x 2 cubes
    assert tiles.shape[0] - plan.prefix_tiles == 8
    cubes = []
    for tile, length in zip(tiles[3:], plan.tile_len[3:]):
        rows = tile[:length] - video.start
        assert (tile[length:] == -1).all() and (rows >= 0).all()
        assert (rows[1:] > rows[:-1]).all()                     # inside a cube, rows keep their (t, h, w) order
        t, rest = rows // (grid[1] * grid[2]), rows % (grid[1] * grid[2])
        h, w = rest // grid[2], rest % grid[2]
        for axis in (t, h, w):                                  # one 4x4x4 cube of the grid
            assert axis.max() // 4 == axis.min() // 4
        cubes.append((int(t[0]) // 4, int(h[0]) // 4, int(w[0]) // 4))
    assert cubes == sorted(cubes) and len(set(cubes)) == len(cubes)    # cubes in (t, h, w) order
    assert plan.tile_len[3:].tolist() == [64, 32, 16, 8, 16, 8, 4, 2]   # edge cubes: 1 frame, 1 row, 2 columns
    assert int(plan.tile_len[3:].sum()) == video.stop - video.start


def test_vsa_call_matches_the_kitchen_reference_on_its_tiles():
    layout, shape = layout_of()
    settings = SparseAttentionSettings("vsa", keep_ratio=0.25, min_tokens=0)
    call = sparse_call(settings, layout, 0.5, shape, has_gate=True)
    gen = torch.Generator().manual_seed(3)
    q, k, v, gate = (torch.randn(layout.seq_len, 2, 32, generator=gen) for _ in range(4))
    out = call.attend(q, k, v, gate)
    plan = call.plan
    expected = sol_attn(*(plan.gather(t)[None] for t in (q, k, v)), topk_ratio=0.25, tail=False,
                        sink_blocks=[0, plan.prefix_tiles], sink_q=[0, plan.prefix_tiles],
                        block_len=plan.tile_len, coarse_gate=plan.gather(gate)[None])
    torch.testing.assert_close(out, plan.scatter(expected[0]), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("method,sinks,rows", [("sla", "exact_kv_and_rows", True), ("sol-attn", "exact_kv", False)])
def test_sla_and_sol_attn_sink_the_conditioning_rows(method, sinks, rows):
    layout, shape = layout_of(text=130)
    settings = SparseAttentionSettings(method, keep_ratio=0.2, tau=0.8, min_tokens=0, sink_conditioning=sinks)
    call = sparse_call(settings, layout, 0.5, shape, has_gate=False)
    audio = layout.segment(packing.SegmentRole.AUDIO)
    video = layout.segment(packing.SegmentRole.VIDEO)
    assert call.sink_blocks == (0, -(-video.start // 64))
    assert call.sink_rows == ((audio.start // 64, call.sink_blocks[1]) if rows else (0, 0))
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(layout.seq_len, 2, 16, generator=gen) for _ in range(3))
    expected = sol_attn(q[None], k[None], v[None], tau=0.8, topk_ratio=0.2 if method == "sla" else 0.0,
                        sink_blocks=list(call.sink_blocks), sink_q=list(call.sink_rows))
    torch.testing.assert_close(call.attend(q, k, v, None), expected[0], atol=2e-5, rtol=1e-5)


def test_dense_reasons_and_block_lists():
    settings = SparseAttentionSettings("vsa", sigma_start=percent_to_sigma(0.2, 10.0), sigma_end=0.0,
                                       min_tokens=1000, dense_blocks=parse_block_list("0, 1, 47-49"))
    assert settings.sigma_start == pytest.approx(8.0 / 8.2)
    assert settings.dense_blocks == {0, 1, 47, 48, 49}
    assert "outside" in settings.dense_reason(1.0, 5000)
    assert "min_tokens" in settings.dense_reason(0.5, 999)
    assert "dense_blocks" in settings.dense_reason(0.5, 5000, 48)
    assert settings.dense_reason(0.5, 5000, 2) is None
    with pytest.raises(ValueError, match="'4-x'"):
        parse_block_list("1, 4-x")


@pytest.fixture(scope="module")
def gated_file(tmp_path_factory):
    model = transformer.H3Transformer(GATED)
    _init_weights(model, 7)
    path = tmp_path_factory.mktemp("fasth3") / "fasth3.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path, model


def test_dit_with_to_gate_compress_loads_it(gated_file):
    path, original = gated_file
    loaded = load_model(str(path), expect="h3_transformer")
    assert loaded.config.gate_compress
    gate = loaded.model.blocks[1].attn.to_gate_compress
    assert gate is not None and gate.bias is None
    torch.testing.assert_close(gate.weight.float(), original.blocks[1].attn.to_gate_compress.weight.float())
    assert load_model(str(path), expect="h3_transformer").model.token_refiner.blocks[0].attn.to_gate_compress is None


def _run(handle, sigma=0.5):
    gen = torch.Generator().manual_seed(5)
    video = torch.randn(1, 24, 5, 10, 12, generator=gen)
    audio = torch.randn(1, 32, 2, 9, generator=gen)
    context = torch.randn(1, 70, GATED.text_dim, generator=gen)
    with torch.no_grad():
        return handle(video, audio, context, sigma, sigma)


def test_vsa_runs_in_its_window_and_blocks_listed_dense_stay_dense(gated_file):
    model = load_model(str(gated_file[0]), expect="h3_transformer").model.float()
    dense = ModelHandle(model)
    vsa = dense.with_options(sparse_attention=SparseAttentionSettings(
        "vsa", keep_ratio=0.1, sigma_start=0.8, sigma_end=0.2, min_tokens=0))
    reference = _run(dense)
    for a, b in zip(_run(vsa, sigma=0.9), _run(dense, sigma=0.9)):   # sigma outside the window
        assert torch.equal(a, b)
    sparse = _run(vsa)
    assert all(torch.isfinite(t).all() for t in sparse)
    assert not torch.equal(sparse[0], reference[0])
    all_dense = dense.with_options(sparse_attention=SparseAttentionSettings(
        "vsa", min_tokens=0, dense_blocks=frozenset(range(GATED.num_layers))))
    for a, b in zip(_run(all_dense), reference):
        assert torch.equal(a, b)
    short = dense.with_options(sparse_attention=SparseAttentionSettings("vsa", min_tokens=100_000))
    for a, b in zip(_run(short), reference):
        assert torch.equal(a, b)


def test_int8_dense_backend_is_used_and_close(gated_file):
    model = load_model(str(gated_file[0]), expect="h3_transformer").model.float()
    dense = ModelHandle(model)
    int8 = dense.with_options(attention_backend="int8")
    reference, quantised = _run(dense), _run(int8)
    assert not torch.equal(quantised[0], reference[0])
    torch.testing.assert_close(quantised[0], reference[0], atol=0.1, rtol=0.1)
