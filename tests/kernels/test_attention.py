"""Attention backends against the eager reference; the int8 path's accuracy, fallback and NaN handling."""
import pytest
import torch

from kernels.attention import ATTENTION, ATTENTION_INT8, attention, attention_eager, quantize_per_block


def qkv(batch=2, heads=3, tokens=37, keys=29, dim=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=generator).to(dtype) for n in (tokens, keys, keys))
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [dict(), dict(batch=1, heads=1, tokens=1, keys=1, dim=8)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_sdpa_matches_eager(dtype, tol, shape, mask_kind):
    q, k, v = qkv(dtype=dtype, **shape)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(q.shape[2], k.shape[2], generator=torch.Generator().manual_seed(1)) > 0.3
        mask[:, 0] = True  # every query sees a key
    elif mask_kind == "additive":
        mask = torch.randn(1, 1, q.shape[2], k.shape[2])
    out = attention(q, k, v, mask=mask, backend="sdpa")
    torch.testing.assert_close(out.float(), attention_eager(q, k, v, mask=mask).float(), atol=tol, rtol=tol)
    attention(q, k, v, mask=mask)
    assert ATTENTION.last_backend == "sdpa"


def test_int8_quantisation_is_per_block_and_bounded():
    t = torch.randn(1, 2, 130, 8)
    t[:, :, 64:128] *= 100  # a loud middle block must not coarsen its neighbours
    values, scales = quantize_per_block(t)
    assert values.dtype == torch.int8 and values.abs().max() <= 127
    assert scales[0, 0, 0] == scales[0, 0, 63] and scales[0, 0, 64] > 50 * scales[0, 0, 0]
    assert (values.float() * scales - t).abs().max() <= scales.max() / 2 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_path_close_to_exact_attention(dtype):
    q, k, v = qkv(tokens=150, keys=140, dim=32, dtype=dtype)
    k = k + 3.0  # an offset that k smoothing removes before quantising
    out = attention(q, k, v, int8_qk=True)
    assert ATTENTION_INT8.last_backend == "int8" and out.dtype == dtype
    exact = attention_eager(q, k, v)
    assert (out.float() - exact.float()).abs().max() < 0.05


def test_int8_output_has_no_nan_when_a_row_is_fully_masked():
    q, k, v = qkv(tokens=4, keys=5)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    out = attention(q, k, v, mask=mask, int8_qk=True)
    assert torch.isfinite(out).all() and (out[:, :, 2] == 0).all()


def test_int8_path_falls_back_to_eager_when_it_declines():
    q, k, v = qkv(tokens=3, keys=3, dim=1100)  # too wide for exact float32 sums of int8 products
    out = attention(q, k, v, int8_qk=True)
    assert ATTENTION_INT8.last_backend == "eager"
    torch.testing.assert_close(out, attention_eager(q, k, v))


def test_shapes_are_checked():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="shapes do not fit"):
        attention(q, k[:, :, :, :8], v)
    with pytest.raises(ValueError, match="mask"):
        attention(q, k, v, mask=torch.ones(5, 5, dtype=torch.bool))
