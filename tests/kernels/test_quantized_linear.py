"""The quantized backends of the unified Linear against their reference, dequantize-then-matmul."""
import pytest
import torch

from kernels.linear import linear
from kernels.quantized import QuantizedWeight, WeightFormat
from kernels.linear import LINEAR
from kernels.quantized_linear import (QUANTIZED_LINEAR, dequantize_int8_stored, quantized_linear_eager,
                                      quantized_linear_fp8)
from models.quant.writer import encode_float8, encode_int8, encode_nvfp4


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _int8(out_features, in_features, group=0, seed=0, full_precision=False):
    stored = encode_int8(torch.randn(out_features, in_features, generator=_gen(seed)) * 0.05, group)
    return QuantizedWeight(WeightFormat.INT8, stored["weight"], stored["weight_scale"],
                           torch.Size((out_features, in_features)), rotation_group=group, full_precision=full_precision)


@pytest.mark.parametrize("group", [0, 4, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"prologue": "rms_norm"}, {"prologue": "gelu_tanh", "residual_scale": 0.3}])
def test_int8_backend_is_within_activation_rounding_of_the_reference(group, dtype, options):
    weight = _int8(48, 128, group)
    x = torch.randn(3, 9, 128, generator=_gen(1)).to(dtype)
    bias = torch.randn(48, generator=_gen(2)).to(dtype)
    residual = torch.randn(3, 9, 48, generator=_gen(3)).to(dtype)
    fast = QUANTIZED_LINEAR(x, weight, bias, residual=residual, backend="int8", **options)
    assert fast.dtype == dtype
    reference = QUANTIZED_LINEAR(x, weight, bias, residual=residual, backend="eager", **options)
    # Per-token int8 activations round each value by at most 1/254 of the token's largest one.
    scale = (reference - residual).abs().max()
    assert (fast.float() - reference.float()).abs().max() < 2e-2 * scale


def test_reference_equals_the_float_linear_on_the_dequantized_weight():
    weight = _int8(32, 64, 16)
    x = torch.randn(5, 64, generator=_gen(4))
    expected = linear(x, weight.dequantize(), None, prologue="rms_norm")
    assert torch.equal(quantized_linear_eager(x, weight, prologue="rms_norm"), expected)


def test_nvfp4_pre_quant_scale_multiplies_the_input():
    w = torch.randn(32, 64, generator=_gen(5)) * 0.05
    stored = encode_nvfp4(w)
    pre = torch.rand(64, generator=_gen(6)) + 0.5
    weight = QuantizedWeight(WeightFormat.NVFP4, stored["weight"], stored["weight_scale"], torch.Size((32, 64)),
                             tensor_scale=stored["weight_scale_2"], pre_quant_scale=pre.to(torch.bfloat16))
    x = torch.randn(4, 64, generator=_gen(7))
    expected = (x * pre.to(torch.bfloat16).float()) @ weight.dequantize().T
    torch.testing.assert_close(linear(x, weight), expected, rtol=1e-6, atol=1e-6)
    assert QUANTIZED_LINEAR.last_backend == "eager"  # no native nvfp4 product here


def test_full_precision_marker_and_forcing_pick_the_reference():
    x = torch.randn(4, 64, generator=_gen(8))
    linear(x, _int8(32, 64, full_precision=True))
    assert QUANTIZED_LINEAR.last_backend == "eager"
    assert "full_precision_matrix_mult" in QUANTIZED_LINEAR.backend("int8").decline_reason(
        x, _int8(32, 64, full_precision=True))
    with pytest.raises(ValueError, match="backend 'int8' .* cannot run this call: .*full_precision_matrix_mult"):
        QUANTIZED_LINEAR(x, _int8(32, 64, full_precision=True), backend="int8")


@pytest.mark.parametrize("fmt,dtype", [(WeightFormat.FLOAT8_E4M3, torch.float8_e4m3fn),
                                       (WeightFormat.FLOAT8_E5M2, torch.float8_e5m2)])
@pytest.mark.parametrize("input_scale", [None, 0.02])
def test_fp8_product_arithmetic_against_the_reference(fmt, dtype, input_scale):
    # The fp8 backend runs on CUDA 8.9+ only; its arithmetic (torch._scaled_mm exists on the CPU too) is
    # checked here by calling it directly.
    stored = encode_float8(torch.randn(64, 96, generator=_gen(9)) * 0.05, dtype)
    weight = QuantizedWeight(fmt, stored["weight"], stored["weight_scale"], torch.Size((64, 96)),
                             input_scale=None if input_scale is None else torch.tensor(input_scale))
    x = torch.randn(2, 5, 96, generator=_gen(10))
    fast = quantized_linear_fp8(x, weight, torch.full((64,), 0.1), residual=torch.ones(2, 5, 64), residual_scale=0.5)
    reference = quantized_linear_eager(x, weight, torch.full((64,), 0.1), residual=torch.ones(2, 5, 64),
                                       residual_scale=0.5)
    # float8-e4m3 activations keep 3 mantissa bits: about 3% of the product's range (measured 2.5-2.9%).
    assert (fast - reference).abs().max() < 5e-2 * (reference - 1).abs().max()
    if not torch.cuda.is_available():
        assert QUANTIZED_LINEAR.backend("fp8").decline_reason(x, weight) is not None


def test_quantized_weight_shapes_are_checked_like_float_ones():
    with pytest.raises(ValueError, match=r"x of shape \(4, 60\) does not fit weight \(32, 64\)"):
        linear(torch.randn(4, 60), _int8(32, 64))
    with pytest.raises(ValueError, match=r"bias must be \(32,\)"):
        linear(torch.randn(4, 64), _int8(32, 64), torch.zeros(31))


def test_compiled_int8_backend_matches_the_eager_int8_backend():
    # Forced: automatic choice compiles only products large enough to repay it. One shape class.
    weight = _int8(32, 64, 16)
    x = torch.randn(20, 128, generator=_gen(11))
    residual = torch.randn(20, 32, generator=_gen(12))
    options = dict(prologue="swiglu", residual=residual, residual_scale=torch.rand(32, generator=_gen(13)))
    bias = torch.randn(32, generator=_gen(14))
    compiled = QUANTIZED_LINEAR(x, weight, bias, backend="int8_compiled", **options)
    eager = QUANTIZED_LINEAR(x, weight, bias, backend="int8", **options)
    # Same arithmetic; only the rotation's summation order and the rounding of exact ties may differ.
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-2 * (eager - residual).abs().max().item())
    assert QUANTIZED_LINEAR.backend("int8_compiled").worthwhile(x, weight) is not None  # too small to compile by itself


@pytest.mark.parametrize("group", [0, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"prologue": "rms_norm"}, {"prologue": "swiglu", "residual_scale": 0.3}])
def test_cpu_int8_goes_to_the_dequantizing_product_within_rounding_of_the_reference(group, dtype, options):
    weight = _int8(40, 512, group)
    width = 1024 if options.get("prologue") == "swiglu" else 512
    x = torch.randn(2, 7, width, generator=_gen(15)).to(dtype)
    bias = torch.randn(40, generator=_gen(16)).to(dtype)
    residual = torch.randn(2, 7, 40, generator=_gen(17)).to(dtype)
    if "prologue_weight" not in options and options.get("prologue") == "rms_norm":
        options = {**options, "prologue_weight": (1 + 0.1 * torch.randn(512, generator=_gen(18))).to(dtype)}
    fast = linear(x, weight, bias, residual=residual, **options)
    assert QUANTIZED_LINEAR.last_backend == "int8_dequantized" and fast.dtype == dtype
    reference = QUANTIZED_LINEAR(x, weight, bias, residual=residual, backend="eager", **options)
    # The same weight values; the fast path works in float32, the reference in x's dtype (bfloat16
    # rounds the prologue's output, the product and the result: about 2^-8 of each).
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (fast.float() - reference.float()).abs().max() < tolerance * (reference.float() - residual.float()).abs().max()
    alone = linear(x, weight, bias, **options)  # no residual: the output takes x's dtype
    alone_reference = QUANTIZED_LINEAR(x, weight, bias, backend="eager", **options)
    assert alone.dtype == dtype
    assert (alone.float() - alone_reference.float()).abs().max() < tolerance * alone_reference.float().abs().max()


def test_dequantizing_product_reuses_one_buffer_and_never_returns_stale_values():
    big, small = _int8(64, 128, 16, seed=20), _int8(16, 64, 0, seed=21)
    first = dequantize_int8_stored(big)
    torch.testing.assert_close(first, big.data.float() * big.scale.float())
    pointer = first.data_ptr()
    second = dequantize_int8_stored(small)  # smaller: the same memory, overwritten
    assert second.data_ptr() == pointer
    torch.testing.assert_close(second, small.data.float() * small.scale.float())
    x = torch.randn(3, 128, generator=_gen(22))
    for weight, features in ((big, 128), (small, 64), (big, 128)):
        out = linear(x[:, :features], weight)
        assert QUANTIZED_LINEAR.last_backend == "int8_dequantized"
        torch.testing.assert_close(out, x[:, :features] @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


def test_dequantizing_product_serves_the_cpu_only_and_never_the_full_precision_marker():
    backend = QUANTIZED_LINEAR.backend("int8_dequantized")
    weight = _int8(32, 64)
    assert "CPU" in backend.decline_reason(torch.empty(4, 64, device="meta"), weight)
    assert "full_precision" in backend.decline_reason(torch.randn(4, 64), _int8(32, 64, full_precision=True))
    assert backend.decline_reason(torch.randn(4, 64), weight) is None
    # The float product it hands to is the float Linear's own choice, decided like any float32 call.
    linear(torch.randn(4, 64), weight)
    assert LINEAR.last_backend is not None
