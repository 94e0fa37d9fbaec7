"""Weft's LoKr and LoHa against LyCORIS's own code (the test extra lycoris-lora), on random factors.

Two oracles from LyCORIS's functional modules, run on their plain torch path: the weight an entry
rebuilds (`diff_weight` / `kron_weight`: whole, low-rank and Tucker factors, on Linear and Conv3d
shapes), and the product beside a Linear that the side path computes (`bypass_forward_diff`: LyCORIS's
own bypass forward, y = scale * delta h). Weft reads the same factors from LyCORIS key names.

The alpha / rank rule: LyCORIS's LoKr functions take the rank from the low-rank factor (w1_a's columns,
else w2_a's; the bypass reads w1_b's or w2_b's rows) and use scale 1 when both factors are whole, as
Weft does. For a Tucker w2 their weight function would read the rank off w2_a's columns, which there
hold w2's rows (LyCORIS's modules pass the rank themselves), so the Tucker cases hand it the scale. Their
LoHa functions take the scale itself (gamma = alpha / rank).
"""
from __future__ import annotations

import pytest
import torch

from models.adapters import adapter_from_tensors
from tests.models.adapters.helpers import rand

lycoris_lokr = pytest.importorskip("lycoris.functional.lokr")  # pinned in requirements-test.txt
lycoris_loha = pytest.importorskip("lycoris.functional.loha")

OUT, IN = 48, 32  # a Linear; w1 (4, 4) leaves w2 (12, 8)


def _weft_source(tensors: dict[str, torch.Tensor]):
    """The delta source Weft builds from one entry's tensors, stored under a LyCORIS key."""
    adapter = adapter_from_tensors({f"lycoris_layer.{role}": t for role, t in tensors.items()}, source="oracle")
    (entry,) = adapter.entries
    return entry.weight


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


# (name, factors, alpha): the LoKr forms LyCORIS writes for a Linear.
LOKR_LINEAR = [
    ("whole", {"lokr_w1": (4, 4), "lokr_w2": (12, 8)}, 1e6),  # both whole: the alpha is a placeholder
    ("low-rank w2", {"lokr_w1": (4, 4), "lokr_w2_a": (12, 3), "lokr_w2_b": (3, 8)}, 1.5),
    ("low-rank w1", {"lokr_w1_a": (4, 2), "lokr_w1_b": (2, 4), "lokr_w2": (12, 8)}, 1.0),
    ("both low-rank", {"lokr_w1_a": (4, 2), "lokr_w1_b": (2, 4), "lokr_w2_a": (12, 2), "lokr_w2_b": (2, 8)}, 3.0),
]


def _lokr_args(factors: dict[str, torch.Tensor]) -> tuple:
    """LyCORIS's (w1, w1a, w1b, w2, w2a, w2b, t) order."""
    return tuple(factors.get(f"lokr_{role}") for role in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b", "t2"))


def _random(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    return {role: rand(*shape, seed=seed + i) * 0.3 for i, (role, shape) in enumerate(shapes.items())}


@pytest.mark.parametrize("name,shapes,alpha", LOKR_LINEAR, ids=[case[0] for case in LOKR_LINEAR])
def test_lokr_weight_and_bypass_product_equal_lycoris(name, shapes, alpha):
    factors = _random(shapes, seed=10)
    source = _weft_source({**factors, "alpha": torch.tensor(alpha)})
    want = lycoris_lokr.diff_weight(*_lokr_args(factors), gamma=alpha, backend="torch")
    _close(source.delta(), want)
    h = rand(5, IN, seed=3)
    beside = lycoris_lokr.bypass_forward_diff(h, None, *_lokr_args(factors), gamma=alpha, backend="torch")
    _close(source.side_product(h, 0.7), 0.7 * beside)


@pytest.mark.parametrize("kernel", [(), (3, 3, 3)], ids=["linear", "conv3d"])
def test_lokr_tucker_weight_equals_lycoris(kernel):
    rank, alpha = 2, 1.0
    factors = {"lokr_w1": rand(2, 2, seed=1), "lokr_t2": rand(rank, rank, *kernel, seed=2),
               "lokr_w2_a": rand(rank, 3, seed=3), "lokr_w2_b": rand(rank, 2, seed=4)}
    source = _weft_source({**factors, "alpha": torch.tensor(alpha)})
    want = lycoris_lokr.kron_weight(*_lokr_args(factors), scale=alpha / rank, backend="torch")
    assert tuple(want.shape) == (6, 4, *kernel)
    _close(source.delta(), want)


def _loha_args(factors: dict[str, torch.Tensor]) -> tuple:
    """LyCORIS's (w1d, w1u, w2d, w2u, t1, t2): d is the input side (hada_wN_b), u the output side (hada_wN_a)."""
    return (factors["hada_w1_b"], factors["hada_w1_a"], factors["hada_w2_b"], factors["hada_w2_a"],
            factors.get("hada_t1"), factors.get("hada_t2"))


def test_loha_weight_and_bypass_product_equal_lycoris():
    rank, alpha = 3, 1.5
    factors = {"hada_w1_a": rand(OUT, rank, seed=1), "hada_w1_b": rand(rank, IN, seed=2),
               "hada_w2_a": rand(OUT, rank, seed=3), "hada_w2_b": rand(rank, IN, seed=4)}
    source = _weft_source({**factors, "alpha": torch.tensor(alpha)})
    _close(source.delta(), lycoris_loha.diff_weight(*_loha_args(factors), gamma=alpha / rank, backend="torch"))
    # Weft's side product goes through the rank-9 factors of the Hadamard product; LyCORIS's builds the delta.
    h = rand(5, IN, seed=5)
    beside = lycoris_loha.bypass_forward_diff(h, None, *_loha_args(factors), gamma=alpha / rank, backend="torch")
    _close(source.side_product(h, -0.6), -0.6 * beside)


def test_loha_tucker_weight_on_a_convolution_equals_lycoris():
    rank, alpha = 2, 1.0
    factors = {"hada_t1": rand(rank, rank, 3, 3, 3, seed=1), "hada_w1_a": rand(rank, 6, seed=2),
               "hada_w1_b": rand(rank, 4, seed=3), "hada_t2": rand(rank, rank, 3, 3, 3, seed=4),
               "hada_w2_a": rand(rank, 6, seed=5), "hada_w2_b": rand(rank, 4, seed=6)}
    source = _weft_source({**factors, "alpha": torch.tensor(alpha)})
    want = lycoris_loha.diff_weight(*_loha_args(factors), gamma=alpha / rank, backend="torch")
    assert tuple(want.shape) == (6, 4, 3, 3, 3)
    _close(source.delta(), want)
