"""LoHa: delta = (w1_a @ w1_b) * (w2_a @ w2_b) (element-wise), times alpha / rank.

Stored shapes (LyCORIS):
  hada_w1_a (out, r), hada_w1_b (r, in, *kernel), the same for hada_w2_a / hada_w2_b; or, with
  Tucker (hada_t1, hada_t2 of shape (r, r, *kernel)): hada_wN_a (r, out), hada_wN_b (r, in) and
  wN[p, q, ...] = sum_ij tN[i, j, ...] * wN_a[i, p] * wN_b[j, q].
The rank is the rows of hada_w1_b; without an alpha the scale is 1.0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.adapters.base import RankedDelta, side_factors


@dataclass
class LohaDelta(RankedDelta):
    """The factors of one LoHa entry."""

    w1_a: torch.Tensor
    w1_b: torch.Tensor
    w2_a: torch.Tensor
    w2_b: torch.Tensor
    t1: torch.Tensor | None = None
    t2: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    kind: str = "loha"

    @property
    def rank(self) -> int:
        """The Hadamard factors' rank."""
        return int(self.w1_b.shape[0])

    def check(self) -> str | None:
        """Why the factors do not join, or None."""
        if (self.t1 is None) != (self.t2 is None):
            return "needs both hada_t1 and hada_t2, or neither"
        if self.t1 is None:
            if self.w1_a.shape[1] != self.w1_b.shape[0] or self.w2_a.shape[1] != self.w2_b.shape[0]:
                return (f"hada_w1_a {tuple(self.w1_a.shape)} / hada_w1_b {tuple(self.w1_b.shape)} or hada_w2_a "
                        f"{tuple(self.w2_a.shape)} / hada_w2_b {tuple(self.w2_b.shape)} disagree on the rank")
        if self._shape(1) != self._shape(2):
            return f"the two Hadamard factors rebuild to different shapes {self._shape(1)} and {self._shape(2)}"
        return None

    def _shape(self, which: int) -> tuple[int, ...]:
        a, b = getattr(self, f"w{which}_a"), getattr(self, f"w{which}_b")
        t = getattr(self, f"t{which}")
        if t is not None:
            return (int(a.shape[1]), int(b.shape[1]), *[int(d) for d in t.shape[2:]])
        return (int(a.shape[0]), *[int(d) for d in b.shape[1:]])

    def delta_shape(self) -> tuple[int, ...]:
        return self._shape(1)

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("w1_a", "w1_b", "w2_a", "w2_b", "t1", "t2")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def _rebuild(self, factors: dict[str, torch.Tensor], which: int) -> torch.Tensor:
        a, b = factors[f"w{which}_a"], factors[f"w{which}_b"]
        t = factors.get(f"t{which}")
        if t is not None:
            return torch.einsum("ij...,ip,jq->pq...", t, a, b)
        return (a @ b.reshape(b.shape[0], -1)).reshape(self._shape(which))

    def compute(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._rebuild(factors, 1) * self._rebuild(factors, 2) * self.scale

    def delta_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.t1 is not None or len(self._shape(1)) != 2:
            return super().delta_rows(ids, dtype)
        factors = side_factors(self, ids.device, dtype)
        first = factors["w1_a"][ids] @ factors["w1_b"]  # (..., columns)
        return first * (factors["w2_a"][ids] @ factors["w2_b"]) * self.scale

    def side_product(self, h: torch.Tensor, alpha: float) -> torch.Tensor:
        # (A1 B1) * (A2 B2) is a rank r1 * r2 product U V, U[o, (i, j)] = A1[o, i] A2[o, j] and
        # V[(i, j), c] = B1[i, c] B2[j, c]; it is used while it is cheaper than the delta itself.
        out_features, in_features = self._shape(1)[:2]
        inner = self.w1_b.shape[0] * self.w2_b.shape[0]
        if self.t1 is not None or len(self._shape(1)) != 2 or inner * (out_features + in_features) >= \
                out_features * in_features:
            return super().side_product(h, alpha)
        factors = side_factors(self, h.device, h.dtype)
        u = (factors["w1_a"][:, :, None] * factors["w2_a"][:, None, :]).reshape(out_features, inner)
        v = (factors["w1_b"][:, None, :] * factors["w2_b"][None, :, :]).reshape(inner, in_features)
        return F.linear(F.linear(h, v) * (alpha * self.scale), u)  # (..., out)
