"""The GGUF block formats as stored-format objects: layout, encoding (equal to the `gguf` package's), refusals."""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # pinned in requirements-test.txt; never skipped there

from kernels.quantized import WeightFormat  # noqa: E402
from models.quant.formats import FORMATS, SUPPORTED_FORMATS, format_named  # noqa: E402
from kernels.gguf_blocks import decode_blocks  # noqa: E402
from models.quant.formats.gguf import GGUF_BY_TYPE, K_WRITABLE_TYPES, WRITABLE_TYPES, encode_blocks  # noqa: E402
from models.quant.markers import parse_marker  # noqa: E402
from models.quant.writer import quantize_state_dict  # noqa: E402


def _rows(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((rows, cols), generator=gen) * 0.05
    w[0, :32] = 0.0
    w[1, 3] = -0.7
    w[2, :32] = 0.125
    w[3, :32] = torch.linspace(-1, 1, 32)  # halves exactly between codes
    return w


@pytest.mark.parametrize("type_name", WRITABLE_TYPES)
def test_encoding_writes_the_bytes_the_gguf_package_writes(type_name):
    w = _rows(6, 128, seed=4)
    ours = encode_blocks(type_name, w)
    expected = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[type_name])
    assert np.array_equal(ours.numpy(), expected)
    fmt = GGUF_BY_TYPE[type_name]
    assert tuple(ours.shape) == fmt.storage_shape(6, 128)
    assert fmt.dense_shape(tuple(ours.shape)) == (6, 128)


def test_every_block_type_has_one_object_and_none_is_named_by_a_marker():
    for fmt in WeightFormat:
        if fmt.gguf_type is not None:
            assert FORMATS[fmt] is GGUF_BY_TYPE[fmt.gguf_type]
            assert fmt.value not in SUPPORTED_FORMATS and format_named(fmt.value) is None
    with pytest.raises(ValueError, match="Weft does not read"):
        parse_marker("blocks.0.fc1", {"format": "gguf_q4_k"}, "x.safetensors")
    with pytest.raises(ValueError, match="written into .gguf files"):
        quantize_state_dict({"a.weight": torch.zeros(4, 32)}, ["a"], "gguf_q8_0")


# Relative RMS error of Weft's direct K fit on Gaussian rows (measured 1.9e-2 and 7.8e-2; Q8_0 5e-3,
# Q4_1 7.8e-2 on the same rows).
K_ERRORS = {"Q6_K": 2.5e-2, "Q4_K": 9e-2}


@pytest.mark.parametrize("type_name", K_WRITABLE_TYPES)
def test_k_encoding_writes_blocks_the_gguf_package_decodes_to_the_weights_within_the_stated_error(type_name):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(16, 512, generator=gen) * 0.05
    ours = encode_blocks(type_name, w)
    fmt = GGUF_BY_TYPE[type_name]
    assert tuple(ours.shape) == fmt.storage_shape(16, 512) and fmt.dense_shape(tuple(ours.shape)) == (16, 512)
    decoded = torch.from_numpy(gguf.quants.dequantize(ours.numpy(), gguf.GGMLQuantizationType[type_name]))
    assert torch.equal(decode_blocks(type_name, ours), decoded.reshape(16, 512))
    assert (decoded - w).pow(2).mean().sqrt() <= K_ERRORS[type_name] * w.pow(2).mean().sqrt()
    # Blocks of zeros, of one sign only and of one repeated value stay exact or within a code of it.
    edges = torch.zeros(3, 256)
    edges[1] = torch.linspace(0.1, 2.0, 256)
    edges[2] = -0.375
    back = decode_blocks(type_name, encode_blocks(type_name, edges))
    assert torch.equal(back[0], edges[0])
    assert (back[1:] - edges[1:]).abs().max() <= (2.0 / 15 if type_name == "Q4_K" else 2.0 / 31)


def test_the_other_k_types_are_read_only_and_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="the other K types are read, not written"):
        encode_blocks("Q5_K", torch.zeros(2, 256))
    with pytest.raises(ValueError, match="blocks of 32 values"):
        encode_blocks("Q8_0", torch.zeros(2, 40))
    with pytest.raises(ValueError, match="blocks of 256 values"):
        encode_blocks("Q4_K", torch.zeros(2, 288))
    fmt = GGUF_BY_TYPE["Q4_K"]
    with pytest.raises(ValueError, match="blocks hold 256 values"):
        fmt.check_stored("fc1", None, {"weight": "fc1.weight"}, 8, 128, {"fc1.weight": (8, 72)},
                         {"fc1.weight": "U8"}, "m.gguf")
