"""Block-sparse attention (kernels/attention.py) against comfy-kitchen's eager `sol_attn` on random inputs."""
from __future__ import annotations

import pytest
import torch

from kernels import attention as attention_module
from kernels.attention import BLOCK_SPARSE, block_sparse_attention, select_tiles

sol_attn = pytest.importorskip("comfy_kitchen.backends.eager.sol_attn").sol_attn

TOKENS = 64 * 9 + 20          # a ragged last tile
CASES = {
    "vsa": dict(keep_ratio=0.3, pooled_tail=False, sink_blocks=(0, 2), sink_rows=(0, 2), tile_len=True, gate=True),
    "sla": dict(keep_ratio=0.2, pooled_tail=True, sink_blocks=(0, 1), sink_rows=(1, 2)),
    "sol-attn": dict(tau=0.5, pooled_tail=True, sink_blocks=(0, 1)),
    "sol-attn-no-sinks": dict(tau=1.3, pooled_tail=True),
    "sla-no-sinks": dict(keep_ratio=0.5, pooled_tail=True),
}


def inputs(seed=0, batch=2, heads=2, tokens=TOKENS, dim=32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, gate = (torch.randn(batch, heads, tokens, dim, generator=gen) for _ in range(4))
    tile_len = torch.randint(20, 65, (-(-tokens // 64),), generator=gen)
    return q, k, v, gate, tile_len


def kitchen(q, k, v, *, keep_ratio=0.0, tau=1.0, sink_blocks=(0, 0), sink_rows=(0, 0), tile_len=None,
            pooled_tail=True, coarse_gate=None):
    def flip(t):
        return None if t is None else t.transpose(1, 2)
    out = sol_attn(flip(q), flip(k), flip(v), tau=tau, topk_ratio=keep_ratio, sink_blocks=list(sink_blocks),
                   sink_q=list(sink_rows), tail=pooled_tail, block_len=tile_len, coarse_gate=flip(coarse_gate))
    return out.transpose(1, 2)


def live_rows(tokens, tile_len):
    if tile_len is None:
        return torch.ones(tokens, dtype=torch.bool)
    rows = torch.arange(tokens)
    return (rows % 64) < tile_len.clamp(max=64)[rows // 64]


@pytest.mark.parametrize("backend", ["blockwise", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_kitchen_reference(case, backend):
    q, k, v, gate, tile_len = inputs()
    options = dict(CASES[case])
    use_len, use_gate = options.pop("tile_len", False), options.pop("gate", False)
    options.update(tile_len=tile_len if use_len else None, coarse_gate=gate if use_gate else None)
    out = block_sparse_attention(q, k, v, backend=backend, **options)
    assert BLOCK_SPARSE.last_backend == backend
    expected = kitchen(q, k, v, **options)
    live = live_rows(TOKENS, options["tile_len"])      # padding rows' outputs are unspecified
    torch.testing.assert_close(out[:, :, live], expected[:, :, live], atol=1e-5, rtol=1e-5)


def test_blockwise_folds_many_small_groups_like_one(monkeypatch):
    q, k, v, gate, tile_len = inputs(seed=1, batch=1)
    options = dict(keep_ratio=0.4, sink_blocks=(0, 1), sink_rows=(0, 1), tile_len=tile_len, pooled_tail=False,
                   coarse_gate=gate)
    roomy = block_sparse_attention(q, k, v, backend="blockwise", **options)
    # One key tile and one query tile per step.
    monkeypatch.setitem(attention_module.SPARSE_WORKING_BYTES, "cpu", 1)
    tight = block_sparse_attention(q, k, v, backend="blockwise", **options)
    live = live_rows(TOKENS, tile_len)
    torch.testing.assert_close(tight[:, :, live], roomy[:, :, live], atol=1e-5, rtol=1e-5)


def test_gathering_into_the_outputs_spare_rows_matches_gathering_into_its_own_buffers(monkeypatch):
    # float32 gathers into output rows not yet computed (shrinking steps near the end), float64 into
    # buffers of its own; a budget of a few tiles makes both take many steps.
    q, k, v, gate, tile_len = inputs(seed=4)
    monkeypatch.setitem(attention_module.SPARSE_WORKING_BYTES, "cpu", 3 * 64 * (2 * 32 + 64) * 4)
    options = dict(keep_ratio=0.3, sink_blocks=(0, 1), sink_rows=(0, 1), tile_len=tile_len, pooled_tail=True)
    spare = block_sparse_attention(q, k, v, coarse_gate=gate, backend="blockwise", **options)
    own = block_sparse_attention(q.double(), k.double(), v.double(), coarse_gate=gate.double(), backend="blockwise",
                                 **options)
    live = live_rows(TOKENS, tile_len)
    torch.testing.assert_close(spare[:, :, live], own[:, :, live].float(), atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs_give_bfloat16_close_to_the_reference():
    q, k, v, gate, _ = inputs(seed=2, batch=1)
    options = dict(keep_ratio=0.3, pooled_tail=False, sink_blocks=(0, 1), sink_rows=(0, 1))
    out = block_sparse_attention(*(t.bfloat16() for t in (q, k, v)), coarse_gate=gate.bfloat16(), **options)
    assert out.dtype == torch.bfloat16
    expected = kitchen(q, k, v, coarse_gate=gate, **options)
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.05)


def test_selection_keeps_the_ranked_budget_the_diagonal_and_the_sinks():
    gen = torch.Generator().manual_seed(3)
    q_mean, k_mean = torch.randn(20, 8, generator=gen), torch.randn(20, 8, generator=gen)
    exact, _ = select_tiles(q_mean, k_mean, scale=0.3, keep_ratio=0.25, tau=0.0, sink_blocks=(0, 2),
                            sink_rows=(3, 4))
    assert exact[:, :2].all() and exact[3].all()
    index = torch.arange(20)
    assert exact[index, index].all() and exact[index[1:], index[:-1]].all() and exact[index[:-1], index[1:]].all()
    ranked = (q_mean @ k_mean.T)[:, 2:]
    top = ranked.topk(round(0.25 * 18), dim=1).indices + 2
    assert exact.gather(1, top).all()
    # rows other than the dense one keep at most the budget + 3 diagonal + 2 sink tiles
    others = torch.cat([exact[:3], exact[4:]])
    assert int(others.sum(dim=1).max()) <= round(0.25 * 18) + 3 + 2


def test_refuses_cross_attention_and_a_misshapen_gate():
    q, k, v, gate, _ = inputs(batch=1)
    with pytest.raises(ValueError, match="self-attention"):
        block_sparse_attention(q, k[:, :, :100], v[:, :, :100])
    with pytest.raises(ValueError, match="coarse_gate"):
        block_sparse_attention(q, k, v, coarse_gate=gate[:, :1])
    with pytest.raises(ValueError, match="tile_len"):
        block_sparse_attention(q, k, v, tile_len=torch.full((3,), 64))
