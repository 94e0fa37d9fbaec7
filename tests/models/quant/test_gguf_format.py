"""The GGUF block formats as stored-format objects: layout, encoding (equal to the `gguf` package's), refusals."""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # pinned in requirements-test.txt; never skipped there

from kernels.quantized import WeightFormat  # noqa: E402
from models.quant.formats import FORMATS, SUPPORTED_FORMATS, format_named  # noqa: E402
from models.quant.formats.gguf import GGUF_BY_TYPE, WRITABLE_TYPES, encode_blocks  # noqa: E402
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


def test_k_types_are_read_only_and_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="K-type files are read, not written"):
        encode_blocks("Q4_K", torch.zeros(2, 256))
    with pytest.raises(ValueError, match="blocks of 32 values"):
        encode_blocks("Q8_0", torch.zeros(2, 40))
    fmt = GGUF_BY_TYPE["Q4_K"]
    with pytest.raises(ValueError, match="blocks hold 256 values"):
        fmt.check_stored("fc1", None, {"weight": "fc1.weight"}, 8, 128, {"fc1.weight": (8, 72)},
                         {"fc1.weight": "U8"}, "m.gguf")
