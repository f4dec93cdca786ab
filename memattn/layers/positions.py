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

    def forward(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least, fp64 kept
        if isinstance(offset, torch.Tensor):
            t = offset.to(device=x.device, dtype=dtype)  # [B, T]
        else:
            t = torch.arange(offset, offset + x.shape[1], device=x.device, dtype=dtype)[None]  # [1, T]
        inv_freq = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2, device=x.device, dtype=dtype) / self.head_dim)
        angles = t[..., None] * inv_freq  # [B or 1, T, D/2]
        cos = angles.cos()[:, :, None, :]
        sin = angles.sin()[:, :, None, :]
        x1, x2 = x.to(dtype).chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
