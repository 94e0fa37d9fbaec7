"""Every stored format's object agrees with itself: marker, layout, encoding, decoding and product."""
import pytest
import torch

from kernels.linear import linear_eager
from kernels.quantized import WeightFormat
from models.quant.formats import EMBEDDABLE_FORMATS, FORMATS, STORED_DTYPES, SUPPORTED_FORMATS, LayerQuant
from models.quant.markers import parse_marker

SAFETENSORS_NAMES = {dtype: name for name, dtype in STORED_DTYPES.items()}
# (format, rotation group); int8 once plain and once rotated.
CASES = [(WeightFormat.INT8, 0), (WeightFormat.INT8, 16), (WeightFormat.FLOAT8_E4M3, 0),
         (WeightFormat.FLOAT8_E5M2, 0), (WeightFormat.NVFP4, 0), (WeightFormat.MXFP8, 0)]


def _weight(shape=(40, 48), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1


def test_every_format_is_registered_once_in_marker_order():
    assert SUPPORTED_FORMATS == ("int8_tensorwise", "float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8")
    assert set(FORMATS) == set(WeightFormat)
    assert EMBEDDABLE_FORMATS == ("int8_tensorwise", "float8_e4m3fn", "float8_e5m2")


@pytest.mark.parametrize("fmt,group", CASES)
def test_marker_written_by_the_object_reads_back_as_the_same_options(fmt, group):
    for full_precision in (False, True):
        quant = LayerQuant(fmt, group, full_precision)
        assert parse_marker("layer", quant.marker(), "f") == quant


@pytest.mark.parametrize("fmt,group", CASES)
def test_encoded_tensors_fit_the_layout_the_object_checks(fmt, group):
    out_features, in_features = 40, 48
    quant = LayerQuant(fmt, group)
    stored_format = quant.stored_format
    stored = stored_format.encode(_weight((out_features, in_features)), quant)
    assert set(stored) == {"weight", *stored_format.scales.required}
    assert tuple(stored["weight"].shape) == stored_format.storage_shape(out_features, in_features)
    assert stored_format.dense_shape(tuple(stored["weight"].shape))[1] >= in_features
    shapes = {leaf: tuple(t.shape) for leaf, t in stored.items()}
    dtypes = {leaf: SAFETENSORS_NAMES[t.dtype] for leaf, t in stored.items()}
    stored_format.check_stored("layer", quant, {leaf: leaf for leaf in stored}, out_features, in_features,
                               shapes, dtypes, "f")
    with pytest.raises(ValueError, match=r"f: 'weight' has shape"):
        stored_format.check_stored("layer", quant, {leaf: leaf for leaf in stored}, out_features + 64, in_features,
                                   shapes, dtypes, "f")


@pytest.mark.parametrize("fmt,group", CASES)
def test_product_through_the_object_is_the_float_linear_on_its_dequantized_weight(fmt, group):
    quant = LayerQuant(fmt, group, full_precision=True)  # the reference product: exact comparison
    stored_format = quant.stored_format
    dense = _weight()
    weight = stored_format.weight(stored_format.encode(dense, quant), tuple(dense.shape), quant)
    decoded = weight.dequantize(torch.float32)
    assert decoded.shape == dense.shape
    assert (decoded - dense).abs().max() < 0.2 * dense.abs().max()  # nvfp4: half the widest E2M1 step, 1/6
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(40, generator=torch.Generator().manual_seed(2))
    assert torch.equal(stored_format.linear(x, weight, bias), linear_eager(x, decoded, bias))
    patched = decoded + 0.01
    assert torch.equal(stored_format.linear_patched(x, weight, patched, bias), linear_eager(x, patched, bias))


def test_the_adapter_input_carries_the_pre_quant_scale():
    quant = LayerQuant(WeightFormat.NVFP4)
    stored_format = quant.stored_format
    dense = _weight((32, 32))
    tensors = stored_format.encode(dense, quant)
    tensors["pre_quant_scale"] = torch.linspace(0.5, 2.0, 32)
    weight = stored_format.weight(tensors, (32, 32), quant)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(stored_format.adapter_input(x, weight, None, None, 1e-6), x * tensors["pre_quant_scale"])
    patched = weight.dequantize(torch.float32)
    assert torch.allclose(stored_format.linear_patched(x, weight, patched, None),
                          stored_format.linear(x, weight, None), atol=1e-5)


@pytest.mark.parametrize("fmt", [WeightFormat.NVFP4, WeightFormat.MXFP8])
def test_block_formats_refuse_embedding_lookups(fmt):
    quant = LayerQuant(fmt)
    weight = quant.stored_format.weight(quant.stored_format.encode(_weight((32, 32)), quant), (32, 32), quant)
    with pytest.raises(ValueError, match=f"embedding tables are not read in {fmt.value}"):
        quant.stored_format.embedding(torch.tensor([0, 1]), weight, torch.float32)
