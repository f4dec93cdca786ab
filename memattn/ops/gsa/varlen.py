"""Causal gated slot attention over a packed batch of sequences of different lengths (torch
form): one `gsa_chunked` call per sequence, the layout and checks of memattn.ops.abc.varlen."""

from __future__ import annotations

import torch

from memattn.ops.abc.varlen import check_varlen, each_sequence
from memattn.ops.gsa.chunked import gsa_chunked
from memattn.ops.gsa.common import GSAState, check_gates


def gsa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               cu_seqlens: torch.Tensor, *, scale: float | None = None,
               initial_state: GSAState | None = None,
               output_final_state: bool = False) -> tuple[torch.Tensor, GSAState | None]:
    """Causal gated slot attention of each packed sequence alone.

    q [1, total, H, K], k [1, total, H, K], v [1, total, H, V], g [1, total, H, M] log forget
    gates, cu_seqlens [N + 1] integer boundaries 0 = c_0 < ... < c_N = total; initial_state:
    GSAState of batch N (k [N, H, M, K], v [N, H, M, V]) or None. Returns o [1, total, H, V]
    in q's dtype and, if asked, the GSAState of batch N after each sequence's last token.
    """
    bounds = check_varlen(q, k, v, g, cu_seqlens, initial_state, w_name="g", state_type=GSAState)
    check_gates(g)
    return each_sequence(gsa_chunked, q, k, v, g, bounds, GSAState, initial_state,
                         output_final_state, causal=True, scale=scale)
