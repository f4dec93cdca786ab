"""Position encodings that live inside the attention layer (rotary)."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Rotary position embedding: rotates pairs of channels of q and k by position·θ_i.

    Applied to x [B, T, H, D] whose tokens sit at absolute positions offset, offset + 1, ...
    or, given as a tensor, at positions [B, T] (each row its own: left-padded batches).
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions: head dim must be even, got {head_dim}")
        self.head_dim, self.base = head_dim, base
        # θ_i per (device, dtype), computed on first use: not a buffer, which model.to(dtype)
        # would round (fp16 θ_i misplace far positions), and not state, as it follows from base
        self._inv_freq: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def forward(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        return self.rotate((x,), offset)[0]

    def rotate(self, xs: tuple[torch.Tensor, ...], offset: int | torch.Tensor = 0) -> list[torch.Tensor]:
        """Each x [B, T, H_x, D] of `xs` (q and k: one angle computation for both) rotated."""
        x = xs[0]
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least, fp64 kept
        if isinstance(offset, torch.Tensor):
            t = offset.to(device=x.device, dtype=dtype)  # [B, T]
        else:
            t = torch.arange(offset, offset + x.shape[1], device=x.device, dtype=dtype)[None]  # [1, T]
        inv_freq = self._inv_freq.get((x.device, dtype))
        if inv_freq is None:
            inv_freq = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2, device=x.device, dtype=dtype) / self.head_dim)
            self._inv_freq[(x.device, dtype)] = inv_freq
        angles = t[..., None] * inv_freq  # [B or 1, T, D/2]
        cos = angles.cos()[:, :, None, :]
        sin = angles.sin()[:, :, None, :]
        out = []
        for x in xs:
            x1, x2 = x.to(dtype).chunk(2, dim=-1)
            out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))
        return out
