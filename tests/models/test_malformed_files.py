"""Malformed model files: each hostile header or quantization marker is a ValueError that names the
file and what is wrong, never a raw RecursionError, KeyError, TypeError or int() error."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from models.loading import load_model, read_header
from models.quant.markers import read_plan


def _raw_safetensors(path, header, data: bytes = b"") -> str:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header, says", [
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested far too deeply"),
    ({"video_patch_proj.weight": {"dtype": "F32", "data_offsets": [0, 8]}}, "needs a \"dtype\" string and a \"shape\""),
    ({"video_patch_proj.weight": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, "\"shape\" list of sizes"),
    ({"video_patch_proj.weight": {"dtype": "F32", "shape": -1, "data_offsets": [0, 8]}}, "\"shape\" list of sizes"),
    ({"video_patch_proj.weight": [1, 2]}, "needs a \"dtype\""),
    ([1, 2, 3], "no JSON header"),
    ({"__metadata__": {"a": {"b": 1}}, "w": _ENTRY}, "__metadata__ is not a map of strings"),
    ({"__metadata__": [1], "w": _ENTRY}, "__metadata__ is not a map of strings"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4000]}}, "not a valid safetensors file"),
    ({"w": {"dtype": "NOPE", "shape": [2], "data_offsets": [0, 8]}}, "not a valid safetensors file"),
    (b'{"w": \xff\xfe}', "not valid JSON"),
])
def test_malformed_headers_name_the_file_and_the_fault(tmp_path, header, says):
    path = _raw_safetensors(tmp_path / "hostile.safetensors", header, bytes(8))
    for load in (read_header, load_model):
        with pytest.raises(ValueError) as caught:
            load(path)
        assert "hostile.safetensors" in str(caught.value) and says in str(caught.value), str(caught.value)


def _marker(conf) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("marker_bytes, metadata, says", [
    (_marker({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": "abc"}), {}, "convrot_groupsize 'abc'"),
    (_marker({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": [16]}), {}, "convrot_groupsize [16]"),
    (torch.tensor(list(b"[" * 100_000 + b"]" * 100_000), dtype=torch.uint8), {}, "not a JSON quantization marker"),
    (None, {"_quantization_metadata": "[" * 100_000 + "]" * 100_000}, "is not a JSON object with \"layers\""),
    (None, {"_quantization_metadata": json.dumps({"layers": [1, 2]})}, "is not a JSON object with \"layers\""),
    (None, {"_quantization_metadata": json.dumps({"layers": {"blk": "int8"}})}, "not a JSON object"),
    (_marker({"format": ["int8_tensorwise"]}), {}, "which Weft does not read"),
])
def test_malformed_quantization_markers_name_the_file_and_the_fault(marker_bytes, metadata, says):
    keys = ["blk.weight", "blk.weight_scale"] + (["blk.comfy_quant"] if marker_bytes is not None else [])
    with pytest.raises(ValueError) as caught:
        read_plan(keys, "", metadata, lambda key: marker_bytes, "hostile.safetensors")
    assert "hostile.safetensors" in str(caught.value) and says in str(caught.value), str(caught.value)
