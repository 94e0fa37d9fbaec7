"""LoRA: delta = up @ down (through an optional Tucker `mid` for convolutions), times alpha / rank.

Stored shapes (every community format, once the key names are mapped):
  down  (rank, in, *kernel)   lora_down / lora_A / lora.down / lora_linear_layer.down
  up    (out, rank, *ones)    lora_up / lora_B / lora.up / lora_linear_layer.up
  mid   (rank, rank, *kernel) lora_mid (LoCon with Tucker decomposition; then down and up are 1x1)
  alpha scalar, optional: scale = alpha / rank. Without one, the file's metadata `alpha` (one network
        alpha for every entry) is used; without either the scale is 1.0 (alpha = rank, what the common
        trainers and diffusers assume). The same rule holds for LoKr and LoHa (adapter.py, _file_alpha).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.adapters.base import RankedDelta, side_factors


@dataclass
class LoraDelta(RankedDelta):
    """The factors of one LoRA entry."""

    up: torch.Tensor
    down: torch.Tensor
    mid: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    kind: str = "lora"

    @property
    def rank(self) -> int:
        """The LoRA rank (rows of `down`)."""
        return int(self.down.shape[0])

    def check(self) -> str | None:
        """Why the factors cannot form a delta (inner dimensions disagree), or None."""
        if self.up.dim() < 2 or self.down.dim() < 2:
            return f"up {tuple(self.up.shape)} and down {tuple(self.down.shape)} must have at least 2 dimensions"
        if any(d != 1 for d in self.up.shape[2:]):
            return f"up {tuple(self.up.shape)} must be 1x1 beyond its first two dimensions"
        if self.mid is None:
            if self.up.shape[1] != self.down.shape[0]:
                return f"up {tuple(self.up.shape)} and down {tuple(self.down.shape)} disagree on the rank"
            return None
        if self.mid.dim() < 2 or self.mid.shape[0] != self.up.shape[1] or self.mid.shape[1] != self.down.shape[0]:
            return (f"mid {tuple(self.mid.shape)} does not join up {tuple(self.up.shape)} and "
                    f"down {tuple(self.down.shape)}")
        if any(d != 1 for d in self.down.shape[2:]):
            return f"down {tuple(self.down.shape)} must be 1x1 when a mid factor is present"
        return None

    def delta_shape(self) -> tuple[int, ...]:
        out_dim, in_dim = int(self.up.shape[0]), int(self.down.shape[1])
        if self.mid is not None:
            return (out_dim, in_dim, *[int(d) for d in self.mid.shape[2:]])
        return (out_dim, in_dim, *[int(d) for d in self.down.shape[2:]])

    def tensors(self) -> dict[str, torch.Tensor]:
        found = {"up": self.up, "down": self.down}
        if self.mid is not None:
            found["mid"] = self.mid
        return found

    def add_scaled(self, region: torch.Tensor, alpha: float, swap_halves: bool) -> bool:
        if self.mid is not None or not region.is_contiguous():
            return False
        up = self.up.to(device=region.device, dtype=torch.float32).reshape(self.up.shape[0], self.up.shape[1])
        if swap_halves:
            # Exchanging the delta's row halves is exchanging the rows of `up`.
            half = up.shape[0] // 2
            up = torch.cat((up[half:], up[:half]), dim=0)
        down = self.down.to(device=region.device, dtype=torch.float32).reshape(self.down.shape[0], -1)
        region.view(region.shape[0], -1).addmm_(up, down, alpha=alpha * self.scale)
        return True

    def side_product(self, h: torch.Tensor, alpha: float) -> torch.Tensor:
        if self.mid is not None:
            return super().side_product(h, alpha)
        factors = side_factors(self, h.device, h.dtype)
        down = factors["down"].reshape(self.down.shape[0], -1)  # (r, in)
        up = factors["up"].reshape(self.up.shape[0], self.up.shape[1])  # (out, r)
        # The scale goes on the rank-wide middle, the smallest tensor of the three products.
        return F.linear(F.linear(h, down) * (alpha * self.scale), up)  # (..., out)

    def delta_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.mid is not None or self.up.dim() != 2 or self.down.dim() != 2:
            return super().delta_rows(ids, dtype)
        factors = side_factors(self, ids.device, dtype)
        return F.linear(factors["up"][ids] * self.scale, factors["down"].T)  # (..., r) -> (..., columns)

    def compute(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        up = factors["up"].reshape(self.up.shape[0], self.up.shape[1])  # (out, r)
        down = factors["down"]
        mid = factors.get("mid")
        if mid is None:
            delta = up @ down.reshape(down.shape[0], -1)  # (out, in * prod(kernel))
        else:
            # x -> down (1x1, in -> r) -> mid (kernel, r -> r) -> up (1x1, r -> out): the kernel of
            # the composition is sum over a, b of up[o, a] * mid[a, b, ...] * down[b, i].
            down = down.reshape(down.shape[0], down.shape[1])  # (r, in)
            delta = torch.einsum("oa,ab...,bi->oi...", up, mid, down)
        return delta.reshape(self.delta_shape()) * self.scale
