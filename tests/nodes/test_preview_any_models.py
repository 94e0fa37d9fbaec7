"""PreviewAny on a model wire shows what the model is, never a RecursionError."""
from __future__ import annotations

from nodes.primitives import _preview_text
from tests.nodes.test_h3_nodes import TINY_NAMES, configured_paths, h3  # noqa: F401 (fixtures)


def test_unet_loader_into_preview_any_shows_a_summary_of_the_model(h3):  # noqa: F811
    prompt = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": TINY_NAMES["transformer"][1],
                                                        "weight_dtype": "default"}},
        "show": {"class_type": "PreviewAny", "inputs": {"source": ["unet", 0]}},
    }
    text = h3.run(prompt).outputs["show"]["text"][0]
    assert text.startswith(f"MODEL {TINY_NAMES['transformer'][1]}: ")
    assert "float32" in text and "adapters: none" in text


def test_values_json_cannot_hold_are_described_not_recursed_into():
    circular: list = []
    circular.append(circular)
    assert _preview_text(circular).startswith("[[")
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert _preview_text(deep).startswith("[[[[")

    class Opaque:
        def __repr__(self):
            return "<opaque>"

    assert '"<opaque>"' in _preview_text({"a": Opaque()})
