"""The quantized backends of the unified Linear against their reference, dequantize-then-matmul."""
import dataclasses

import pytest
import torch

from kernels.gguf_blocks import BLOCK_SIZES
from kernels.linear import linear
from kernels.quantized import QuantizedWeight, WeightFormat
from kernels.linear import LINEAR
from kernels.quantized_linear import (QUANTIZED_LINEAR, _scratch, decode_into_buffer, quantized_linear_eager,
                                      quantized_linear_fp8)
from models.quant.formats import LayerQuant
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


@pytest.mark.parametrize("backend", ["eager", "dequantized"])
def test_nvfp4_pre_quant_scale_multiplies_the_input(backend):
    w = torch.randn(32, 64, generator=_gen(5)) * 0.05
    stored = encode_nvfp4(w)
    pre = torch.rand(64, generator=_gen(6)) + 0.5
    weight = QuantizedWeight(WeightFormat.NVFP4, stored["weight"], stored["weight_scale"], torch.Size((32, 64)),
                             tensor_scale=stored["weight_scale_2"], pre_quant_scale=pre.to(torch.bfloat16))
    x = torch.randn(4, 64, generator=_gen(7))
    expected = (x * pre.to(torch.bfloat16).float()) @ weight.dequantize().T
    torch.testing.assert_close(QUANTIZED_LINEAR(x, weight, backend=backend), expected, rtol=1e-6, atol=1e-6)
    linear(x, weight)
    assert QUANTIZED_LINEAR.last_backend == "dequantized"  # the CPU's choice for every format


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
    assert QUANTIZED_LINEAR.last_backend == "dequantized" and fast.dtype == dtype
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
    first = decode_into_buffer(big)
    torch.testing.assert_close(first, big.data.float() * big.scale.float())
    pointer = first.data_ptr()
    second = decode_into_buffer(small)  # smaller: the same memory, overwritten
    assert second.data_ptr() == pointer
    torch.testing.assert_close(second, small.data.float() * small.scale.float())
    x = torch.randn(3, 128, generator=_gen(22))
    for weight, features in ((big, 128), (small, 64), (big, 128)):
        out = linear(x[:, :features], weight)
        assert QUANTIZED_LINEAR.last_backend == "dequantized"
        torch.testing.assert_close(out, x[:, :features] @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


def test_dequantizing_product_serves_the_cpu_only_and_never_the_full_precision_marker():
    backend = QUANTIZED_LINEAR.backend("dequantized")
    weight = _int8(32, 64)
    assert "CPU" in backend.decline_reason(torch.empty(4, 64, device="meta"), weight)
    assert "full_precision" in backend.decline_reason(torch.randn(4, 64), _int8(32, 64, full_precision=True))
    assert backend.decline_reason(torch.randn(4, 64), weight) is None
    # The float product it hands to is the float Linear's own choice, decided like any float32 call.
    linear(torch.randn(4, 64), weight)
    assert LINEAR.last_backend is not None


# ----------------------------------------------------------------------------------------------
# The dequantizing CPU product on every format

# Weft's writer makes every format but three GGUF K types, which are read only: their layers here are
# random block bytes with small finite float16 super-block scales (d, dmin at these byte offsets).
UNWRITTEN_K_TYPES = {WeightFormat.GGUF_Q2_K: (80, 82), WeightFormat.GGUF_Q3_K: (108,), WeightFormat.GGUF_Q5_K: (0, 2)}


def _stored(fmt, out_features, in_features, group=0, seed=0, full_precision=False, pre_quant_scale=False):
    """A QuantizedWeight of `fmt` encoded from a random weight by its format object (models/quant/formats)."""
    quant = LayerQuant(fmt, group, full_precision=full_precision)
    if fmt in UNWRITTEN_K_TYPES:
        block_size, type_size = BLOCK_SIZES[fmt.gguf_type]
        blocks = torch.randint(0, 256, (out_features * in_features // block_size, type_size), dtype=torch.uint8,
                               generator=_gen(seed))
        for offset in UNWRITTEN_K_TYPES[fmt]:
            halves = (torch.randn(blocks.shape[0], generator=_gen(seed + 1)) * 1e-3).to(torch.float16)
            blocks[:, offset:offset + 2] = halves.view(torch.uint8).reshape(-1, 2)
        tensors = {"weight": blocks.reshape(out_features, -1)}
    else:
        dense = torch.randn(out_features, in_features, generator=_gen(seed)) * 0.05
        tensors = quant.stored_format.encode(dense, quant)
    if pre_quant_scale:
        tensors["pre_quant_scale"] = (torch.rand(in_features, generator=_gen(seed + 1)) + 0.5).to(torch.bfloat16)
    return quant.stored_format.weight(tensors, (out_features, in_features), quant)


# Every format with a decoder; int8 also rotated by a group below and at the factored rotation's size.
EVERY_FORMAT = [(fmt, 0) for fmt in WeightFormat] + [(WeightFormat.INT8, 16), (WeightFormat.INT8, 256)]
OPTION_SETS = [{}, {"prologue": "rms_norm", "residual": True}, {"prologue": "swiglu", "residual_scale": True},
               {"prologue": "gelu_tanh", "residual": True, "residual_scale": True}]


def _call_arguments(options, x_width, out_features, dtype, seed):
    """x, bias and keyword options for one call; tensors made from `seed`, in `dtype`."""
    x = torch.randn(2, 5, x_width, generator=_gen(seed)).to(dtype)
    bias = torch.randn(out_features, generator=_gen(seed + 1)).to(dtype)
    kwargs = {"prologue": options.get("prologue")}
    if options.get("prologue") == "rms_norm":
        kwargs["prologue_weight"] = (1 + 0.1 * torch.randn(x_width, generator=_gen(seed + 2))).to(dtype)
    if options.get("residual"):
        kwargs["residual"] = torch.randn(2, 5, out_features, generator=_gen(seed + 3)).to(dtype)
    if options.get("residual_scale"):
        kwargs["residual_scale"] = torch.rand(out_features, generator=_gen(seed + 4)).to(dtype)
    return x, bias, kwargs


def _widened(kwargs):
    return {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("fmt,group", EVERY_FORMAT, ids=lambda v: getattr(v, "value", str(v)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_product_of_every_format_is_the_reference_computed_in_float32(fmt, group, dtype):
    # 512 input features: whole blocks of every format (GGUF K-quants need 256 per row).
    weight = _stored(fmt, 40, 512, group, seed=30, pre_quant_scale=fmt is WeightFormat.NVFP4)
    for index, options in enumerate(OPTION_SETS):
        width = 1024 if options.get("prologue") == "swiglu" else 512
        x, bias, kwargs = _call_arguments(options, width, 40, dtype, seed=31 + 10 * index)
        fast = linear(x, weight, bias, **kwargs)
        assert QUANTIZED_LINEAR.last_backend == "dequantized"
        expected_dtype = kwargs["residual"].dtype if "residual" in kwargs else dtype
        assert fast.dtype == expected_dtype
        # The reference with every input widened to float32: the same value up to float32 summation order,
        # then (for bfloat16) rounded once, which moves it by at most half a bfloat16 step (2^-8 relative).
        exact = QUANTIZED_LINEAR(x.float(), weight, bias.float(), backend="eager", **_widened(kwargs))
        scale = exact.abs().max()
        rounding = 0.0 if dtype == torch.float32 else 2.0 ** -8
        assert ((fast.float() - exact).abs() <= rounding * exact.abs() + 1e-5 * scale).all(), options
        if dtype == torch.bfloat16:
            # The bfloat16 reference rounds the prologue, the decoded weight, the product and the result:
            # a few bfloat16 steps of the output's range.
            reference = QUANTIZED_LINEAR(x, weight, bias, backend="eager", **kwargs)
            assert (fast.float() - reference.float()).abs().max() < 2e-2 * scale, options


def test_padded_block_formats_multiply_through_a_view_of_the_buffer():
    # 72 input features: nvfp4 pads the columns to 80, mxfp8 to 96; 40 rows pad to 48 and 64.
    for fmt in (WeightFormat.NVFP4, WeightFormat.MXFP8):
        weight = _stored(fmt, 40, 72, seed=40)
        assert weight.stored_shape != (40, 72)
        decoded = decode_into_buffer(weight)
        assert decoded.shape == (40, 72)
        assert torch.equal(decoded, weight.dequantize())
        x = torch.randn(3, 72, generator=_gen(41))
        torch.testing.assert_close(linear(x, weight), x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)
        assert QUANTIZED_LINEAR.last_backend == "dequantized"


def test_every_format_decodes_into_one_buffer_that_grows_to_the_largest_layer(monkeypatch):
    monkeypatch.delattr(_scratch, "buffer", raising=False)  # this thread's buffer, as a new thread starts
    big = _stored(WeightFormat.NVFP4, 64, 256, seed=50)
    small = [_stored(fmt, 32, 256, seed=51) for fmt in (WeightFormat.FLOAT8_E5M2, WeightFormat.MXFP8,
                                                         WeightFormat.GGUF_Q4_K, WeightFormat.INT8)]
    pointer = decode_into_buffer(big).data_ptr()
    for weight in small:
        decoded = decode_into_buffer(weight)
        assert decoded.data_ptr() == pointer
        assert torch.equal(decoded, weight.dequantize())
    assert _scratch.buffer.numel() == 64 * 256  # the largest layer, not the sum
    x = torch.randn(3, 256, generator=_gen(52))
    for weight in (big, *small, big):  # each product sees its own weight, never the one decoded before
        torch.testing.assert_close(linear(x, weight), x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


def test_dequantizing_product_refuses_with_a_reason():
    backend = QUANTIZED_LINEAR.backend("dequantized")
    for fmt in (WeightFormat.NVFP4, WeightFormat.FLOAT8_E4M3, WeightFormat.GGUF_Q8_0):
        weight = _stored(fmt, 32, 256)
        x = torch.randn(4, 256)
        assert backend.decline_reason(x, weight) is None
        assert "CPU" in backend.decline_reason(torch.empty(4, 256, device="meta"), weight)
        marked = dataclasses.replace(weight, full_precision=True)
        assert "full_precision" in backend.decline_reason(x, marked)
        assert "float64" in backend.decline_reason(x.double(), weight)
        grad_x = x.clone().requires_grad_()
        assert "requires grad" in backend.decline_reason(grad_x, weight)
        with torch.no_grad():
            assert backend.decline_reason(grad_x, weight) is None
        linear(x, marked)
        assert QUANTIZED_LINEAR.last_backend == "eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dequantizing_product_refuses_cuda_tensors():
    backend = QUANTIZED_LINEAR.backend("dequantized")
    weight = _stored(WeightFormat.NVFP4, 32, 256)
    cuda_weight = dataclasses.replace(weight, data=weight.data.cuda(), scale=weight.scale.cuda(),
                                      tensor_scale=weight.tensor_scale.cuda())
    assert "CPU" in backend.decline_reason(torch.randn(4, 256, device="cuda"), cuda_weight)
    assert "CPU" in backend.decline_reason(torch.randn(4, 256), cuda_weight)
