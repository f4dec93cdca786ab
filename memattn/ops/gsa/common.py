"""What the gated-slot forms share: the decoding state and the checks of their inputs."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from memattn.errors import ShapeError
from memattn.ops.abc.common import check_inputs

# Log forget gates are clamped to at least this in the chunked forms: α = exp(g) is 0 below
# it in float64 as well (exp underflows past -745), so nothing changes, and sums of C gates
# inside a chunk stay finite whatever g (a -inf gate on a GPU, where g is not checked).
G_FLOOR = -1000.0


class GSAState(NamedTuple):
    """Fixed-size state of `gated_slot_attention` after the tokens seen so far (positions ≤ t).

    k [B, H, M, K]  the key memory K̃_t = α_t ⊙ K̃_{t-1} + (1 - α_t) ⊗ k_t
    v [B, H, M, V]  the value memory Ṽ_t = α_t ⊙ Ṽ_{t-1} + (1 - α_t) ⊗ v_t

    Each slot is a convex mix of its old content and the new token, so no entry grows past
    the largest key / value written. Held in float32 (float64 when the inputs are float64).
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, slots: int, k_dim: int, v_dim: int, *,
              device=None, dtype=torch.float32) -> GSAState:
        """The state before any token: empty (zero) memories."""
        return cls(torch.zeros(batch, heads, slots, k_dim, device=device, dtype=dtype),
                   torch.zeros(batch, heads, slots, v_dim, device=device, dtype=dtype))


def check_gates(g: torch.Tensor, name: str = "g") -> None:
    """ShapeError unless every log forget gate is finite and ≤ 0 (α = exp(g) ∈ (0, 1]).

    One reduction (aminmax; NaN reaches it) and one host read, on the CPU only: on a GPU the
    read would synchronise at every call and decoding step, as in the ABC ops' checks, and
    memattn's layers make g ≤ 0 by construction (a log-sigmoid)."""
    if g.device.type != "cpu" or g.numel() == 0:
        return
    lo, hi = (x.item() for x in torch.aminmax(g.detach()))
    if not (hi <= 0 and lo > -math.inf):  # False for NaN too
        raise ShapeError(f"{name}: expected finite log forget gates ≤ 0 (log α, α ∈ (0, 1]), "
                         f"got values from {lo:g} to {hi:g}")


def check_gsa_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     causal: bool, initial_state) -> tuple[int, int, int, int, int, int, int]:
    """Check q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], g [B, T, H, M], the state and
    the gates' values. Returns (B, Tq, T, H, K, V, M); ShapeError names the argument."""
    dims = check_inputs(q, k, v, g, "g", causal, initial_state, GSAState)
    check_gates(g)
    return dims
