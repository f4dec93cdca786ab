"""Causal ABC_MLP over a packed batch of sequences of different lengths (torch form).

The N sequences lie end to end in one row, q [1, total, H, K] and so on; cu_seqlens
[N + 1] holds their boundaries (sequence n is tokens cu_seqlens[n] .. cu_seqlens[n+1] - 1).
Each sequence starts from its own initial state (batch N) and ends in its own final state.
The checks and the loop over the sequences (`check_varlen`, `each_sequence`) serve the gated
slot op too (memattn.ops.gsa).
"""

from __future__ import annotations

import itertools

import torch

from memattn.errors import ShapeError
from memattn.ops.abc.chunked import abc_chunked
from memattn.ops.abc.common import ABCState, check_inputs, check_state


def check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
                 cu_seqlens: torch.Tensor, initial_state: tuple | None, *, w_name: str = "s",
                 state_type: type = ABCState) -> list[int]:
    """Check a packed batch: q [1, total, H, K], k [1, total, H, K], v [1, total, H, V],
    s [1, total, H, M] (named `w_name`), cu_seqlens [N + 1] integers 0 = c_0 < c_1 < ... <
    c_N = total, initial_state a `state_type` of batch N. Returns cu_seqlens as a list (one
    host sync)."""
    B, _, total, H, K, V, M = check_inputs(q, k, v, s, w_name, True, None, state_type)
    if B != 1:
        raise ShapeError(f"q: with cu_seqlens the sequences are packed into one row, "
                         f"expected batch 1 in [1, total, H, K], got shape {tuple(q.shape)}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
            or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
            or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() < 2:
        what = (f"{cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}"
                if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
        raise ShapeError(f"cu_seqlens: expected a 1-D integer tensor [N + 1] with N >= 1, "
                         f"got a {what}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ShapeError(f"cu_seqlens: expected to start at 0, got {bounds[0]}")
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ShapeError(f"cu_seqlens: expected strictly increasing boundaries (every "
                         f"sequence at least one token), got {bounds}")
    if bounds[-1] != total:
        raise ShapeError(f"cu_seqlens: expected to end at the packed length {total} "
                         f"(q.shape[1]), got {bounds[-1]}")
    check_state(initial_state, state_type, len(bounds) - 1, H, M, K, V)
    return bounds


def each_sequence(form, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                  bounds: list[int], state_type: type, initial_state: tuple | None,
                  output_final_state: bool, **kwargs) -> tuple[torch.Tensor, tuple | None]:
    """`form(q, k, v, w, initial_state=, output_final_state=, **kwargs)` (a causal torch form)
    on each packed sequence alone: q [1, total, H, K], ..., w [1, total, H, M], `bounds` the
    checked cu_seqlens, initial_state a `state_type` of batch N or None. Returns
    o [1, total, H, V] and, if asked, the states of the N sequences stacked (batch N)."""
    outs, finals = [], []
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        state = None if initial_state is None else state_type(*(t[n:n + 1] for t in initial_state))
        o, final = form(q[:, a:b], k[:, a:b], v[:, a:b], w[:, a:b], initial_state=state,
                        output_final_state=output_final_state, **kwargs)
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=1)
    if not output_final_state:
        return o, None
    return o, state_type(*(torch.cat(parts, dim=0) for parts in zip(*finals)))


def abc_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
               cu_seqlens: torch.Tensor, *, scale: float | None = None,
               initial_state: ABCState | None = None, output_final_state: bool = False,
               chunk_size: int = 64) -> tuple[torch.Tensor, ABCState | None]:
    """Causal ABC_MLP of each packed sequence, one `abc_chunked` call per sequence.

    q [1, total, H, K], k [1, total, H, K], v [1, total, H, V], s [1, total, H, M],
    cu_seqlens [N + 1]; initial_state: ABCState of batch N (log_z [N, H, M],
    k [N, H, M, K], v [N, H, M, V]) or None. Returns o [1, total, H, V] in q's dtype and,
    if asked, the ABCState of batch N after the last token of each sequence.
    """
    bounds = check_varlen(q, k, v, s, cu_seqlens, initial_state)
    return each_sequence(abc_chunked, q, k, v, s, bounds, ABCState, initial_state,
                         output_final_state, causal=True, scale=scale, chunk_size=chunk_size)
