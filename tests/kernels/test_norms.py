"""The fused ops of kernels/norms.py: each compiled backend against its eager reference, dispatch and refusals."""
import pytest
import torch

from kernels import norms
from kernels.norms import MODULATED_RMS_NORM, RMS_NORM_ROPE, modulated_rms_norm, rms_norm, rms_norm_rope, rope_split_half

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _compiled_here(registry):
    reason = registry.backend("compiled").unavailable_reason()
    if reason is None:
        from kernels import compiled
        reason = compiled.decline_reason([torch.zeros(2)])
    if reason is not None:
        pytest.skip(f"compiled backend unavailable here: {reason}")


def _modulation_inputs(tokens, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(tokens, width, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    shift, scale = (torch.randn(4, width, generator=gen).to(dtype) for _ in range(2))
    row_index = torch.randint(0, 4, (tokens,), generator=gen)
    return x, weight, shift, scale, row_index


def test_eager_modulation_is_the_formula_written_out():
    x, weight, shift, scale, row_index = _modulation_inputs(7, 12, torch.float32, 0)
    expected = rms_norm(x, weight, 1e-5) * (1 + scale[row_index]) + shift[row_index]
    torch.testing.assert_close(modulated_rms_norm(x, weight, 1e-5, shift, scale, row_index, backend="eager"), expected)
    with pytest.raises(ValueError, match="do not fit together"):
        modulated_rms_norm(x, weight, 1e-5, shift, scale[:, :5], row_index)


def test_compiled_modulated_norm_matches_eager_within_bfloat16_rounding():
    _compiled_here(MODULATED_RMS_NORM)
    dtype = torch.bfloat16  # one compile keeps the test fast; float32 is covered through the rope op
    for seed in range(2):
        x, weight, shift, scale, row_index = _modulation_inputs(33, 24, dtype, seed)
        fused = modulated_rms_norm(x, weight, 1e-5, shift, scale, row_index, backend="compiled")
        assert fused.dtype == dtype and fused.shape == x.shape
        torch.testing.assert_close(fused, modulated_rms_norm(x, weight, 1e-5, shift, scale, row_index, backend="eager"),
                                   **TOLERANCE[dtype])


def test_compiled_norm_rope_matches_eager():
    _compiled_here(RMS_NORM_ROPE)
    dtype = torch.float32
    gen = torch.Generator().manual_seed(3)
    x = (2 * torch.randn(40, 3, 16, generator=gen)).to(dtype)
    strided = torch.randn(40, 3, 3, 16, generator=gen).to(dtype).unbind(1)[0]  # a q out of a fused qkv
    weight = (1 + 0.1 * torch.randn(16, generator=gen)).to(dtype)
    angles = torch.randn(40, 6, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    for inp in (x, strided):
        fused = rms_norm_rope(inp, weight, 1e-5, cos, sin, backend="compiled")
        reference = rope_split_half(rms_norm(inp, weight, 1e-5), cos, sin)
        assert fused.dtype == dtype
        torch.testing.assert_close(fused, reference, **TOLERANCE[dtype])
        # The rotation keeps each pair's length: the rotated dims' norm per head is unchanged.
        normed = rms_norm(inp.float(), weight.float(), 1e-5)
        torch.testing.assert_close(fused.float()[..., :12].pow(2).sum(-1), normed[..., :12].pow(2).sum(-1),
                                   **TOLERANCE[dtype])


def test_small_inputs_stay_eager_and_large_ones_compile():
    x, weight, shift, scale, row_index = _modulation_inputs(8, 16, torch.float32, 1)
    modulated_rms_norm(x, weight, 1e-5, shift, scale, row_index)
    assert MODULATED_RMS_NORM.last_backend == "eager"  # far below MIN_FUSED_ELEMENTS: never compiled
    assert "too small" in norms._fused_worthwhile(x)
    big = torch.zeros(norms.MIN_FUSED_ELEMENTS // 64, 64)
    assert norms._fused_worthwhile(big) is None


def test_norm_rope_refuses_tables_that_do_not_fit():
    x = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="does not fit"):
        rms_norm_rope(x, None, 1e-5, torch.ones(5, 5), torch.ones(5, 5))  # 2 * 5 rotated dims > head_dim 8
