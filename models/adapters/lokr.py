"""LoKr: delta = kron(w1, w2), each factor stored whole or low-rank (w2 possibly Tucker).

Stored shapes (LyCORIS):
  w1    (a, c)                      lokr_w1, or lokr_w1_a (a, r) @ lokr_w1_b (r, c)
  w2    (b, d, *kernel)             lokr_w2, or
                                    lokr_w2_a (b, r) @ lokr_w2_b (r, d, *kernel), or Tucker:
                                    lokr_t2 (r, r, *kernel) with lokr_w2_a (r, b), lokr_w2_b (r, d):
                                    w2[p, q, ...] = sum_ij t2[i, j, ...] * w2_a[i, p] * w2_b[j, q]
  delta (a * b, c * d, *kernel) = kron(w1, w2)
The alpha / rank scale applies only when a factor is low-rank (rank from w1_b, else w2_b); when
both factors are whole, alpha is ignored: some tools store a huge placeholder alpha there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.adapters.base import RankedDelta, side_factors


@dataclass
class LokrDelta(RankedDelta):
    """The factors of one LoKr entry."""

    w1: torch.Tensor | None = None
    w1_a: torch.Tensor | None = None
    w1_b: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    w2_a: torch.Tensor | None = None
    w2_b: torch.Tensor | None = None
    t2: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    kind: str = "lokr"

    @property
    def rank(self) -> int | None:
        """The rank of the low-rank factor, or None when both factors are whole."""
        if self.w1 is None:
            return int(self.w1_b.shape[0])
        if self.w2 is None:
            return int(self.w2_b.shape[0])
        return None

    def check(self) -> str | None:
        """Why the stored factors are incomplete or do not join, or None."""
        if self.w1 is None and (self.w1_a is None or self.w1_b is None):
            return "needs lokr_w1, or both lokr_w1_a and lokr_w1_b"
        if self.w2 is None and (self.w2_a is None or self.w2_b is None):
            return "needs lokr_w2, or both lokr_w2_a and lokr_w2_b"
        if self.w1 is None and self.w1_a.shape[1] != self.w1_b.shape[0]:
            return f"lokr_w1_a {tuple(self.w1_a.shape)} and lokr_w1_b {tuple(self.w1_b.shape)} disagree on the rank"
        if self.w2 is None:
            if self.t2 is not None:
                if self.w2_a.dim() != 2 or self.w2_b.dim() != 2 or self.t2.shape[0] != self.w2_a.shape[0] \
                        or self.t2.shape[1] != self.w2_b.shape[0]:
                    return (f"lokr_t2 {tuple(self.t2.shape)} does not join lokr_w2_a {tuple(self.w2_a.shape)} "
                            f"and lokr_w2_b {tuple(self.w2_b.shape)}")
            elif self.w2_a.shape[1] != self.w2_b.shape[0]:
                return (f"lokr_w2_a {tuple(self.w2_a.shape)} and lokr_w2_b {tuple(self.w2_b.shape)} "
                        "disagree on the rank")
        if len(self._w1_shape()) != 2:
            return f"w1 must be a matrix, found {self._w1_shape()}"
        return None

    def _w1_shape(self) -> tuple[int, ...]:
        if self.w1 is not None:
            return tuple(int(d) for d in self.w1.shape)
        return (int(self.w1_a.shape[0]), int(self.w1_b.shape[1]))

    def _w2_shape(self) -> tuple[int, ...]:
        if self.w2 is not None:
            return tuple(int(d) for d in self.w2.shape)
        if self.t2 is not None:
            return (int(self.w2_a.shape[1]), int(self.w2_b.shape[1]), *[int(d) for d in self.t2.shape[2:]])
        return (int(self.w2_a.shape[0]), *[int(d) for d in self.w2_b.shape[1:]])

    def delta_shape(self) -> tuple[int, ...]:
        (a, c), w2 = self._w1_shape(), self._w2_shape()
        return (a * w2[0], c * w2[1], *w2[2:])

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b", "t2")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def add_scaled(self, region: torch.Tensor, alpha: float, swap_halves: bool) -> bool:
        # Linear layers only: region viewed as (a, b, c, d) gets w1[p, q] * w2[i, j] at [p, i, q, j],
        # which is kron(w1, w2) without building it (one broadcast multiply-add pass).
        (a, c), w2_shape = self._w1_shape(), self._w2_shape()
        if len(w2_shape) != 2 or self.t2 is not None or region.dim() != 2 or not region.is_contiguous():
            return False
        factors = {role: t.to(device=region.device, dtype=torch.float32) for role, t in self.tensors().items()}
        w1 = factors["w1"] if "w1" in factors else factors["w1_a"] @ factors["w1_b"]
        w2 = factors["w2"] if "w2" in factors else factors["w2_a"] @ factors["w2_b"]
        if swap_halves:
            # Row r = p * b + i; exchanging halves moves p by a / 2 when a is even, i by b / 2 when a is 1.
            if a % 2 == 0:
                w1 = torch.cat((w1[a // 2:], w1[:a // 2]))
            elif a == 1:
                w2 = torch.cat((w2[w2.shape[0] // 2:], w2[:w2.shape[0] // 2]))
            else:
                return False
        b, d = w2_shape
        region.view(a, b, c, d).addcmul_(w1.view(a, 1, c, 1), w2.view(1, b, 1, d), value=alpha * self.scale)
        return True

    def side_product(self, h: torch.Tensor, alpha: float) -> torch.Tensor:
        # kron(w1, w2) @ x, with x's columns read as a (c, d) grid: w1 @ X @ w2.T, an (a, b) grid
        # of outputs, row r = p * b + i as in the delta. w2 stays factored when it is stored so.
        (a, c), w2_shape = self._w1_shape(), self._w2_shape()
        if len(w2_shape) != 2 or self.t2 is not None:
            return super().side_product(h, alpha)
        factors = side_factors(self, h.device, h.dtype)
        w1 = factors["w1"] if "w1" in factors else factors["w1_a"] @ factors["w1_b"]
        b, d = w2_shape
        grid = h.reshape(-1, c, d)  # (M, c, d)
        if "w2" in factors:
            grid = F.linear(grid, factors["w2"])  # (M, c, b)
        else:
            grid = F.linear(F.linear(grid, factors["w2_b"]), factors["w2_a"])
        out = torch.matmul(w1 * (alpha * self.scale), grid)  # (M, a, b)
        return out.reshape(*h.shape[:-1], a * b)

    def delta_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Row r of kron(w1, w2) is w1[r // b] (x) w2[r % b]: the outer product of one row of each factor.
        (a, c), w2_shape = self._w1_shape(), self._w2_shape()
        if len(w2_shape) != 2 or self.t2 is not None:
            return super().delta_rows(ids, dtype)
        b, d = w2_shape
        factors = side_factors(self, ids.device, dtype)
        outer, inner = ids // b, ids % b
        w1_rows = factors["w1"][outer] if "w1" in factors else factors["w1_a"][outer] @ factors["w1_b"]  # (..., c)
        w2_rows = factors["w2"][inner] if "w2" in factors else factors["w2_a"][inner] @ factors["w2_b"]  # (..., d)
        rows = (w1_rows * self.scale)[..., :, None] * w2_rows[..., None, :]  # (..., c, d)
        return rows.reshape(*ids.shape, c * d)

    def compute(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        w1 = factors["w1"] if "w1" in factors else factors["w1_a"] @ factors["w1_b"]
        if "w2" in factors:
            w2 = factors["w2"]
        elif "t2" in factors:
            w2 = torch.einsum("ij...,ip,jq->pq...", factors["t2"], factors["w2_a"], factors["w2_b"])
        else:
            w2_b = factors["w2_b"]
            w2 = (factors["w2_a"] @ w2_b.reshape(w2_b.shape[0], -1)).reshape(self._w2_shape())
        # kron needs equal ranks: a (a, c) w1 against a conv w2 (b, d, k...) becomes (a, c, 1...).
        w1 = w1.reshape(*w1.shape, *[1] * (w2.dim() - w1.dim()))
        return torch.kron(w1.contiguous(), w2.contiguous()) * self.scale  # kron needs contiguous inputs
