"""What both forms of persistent-memory attention share: input checks and the position terms.

Positions are relative: query i of a block of Tq queries sits at position Tk - Tq + i of the
Tk context keys (so a query block that continues a cache lines up with the end of the keys),
and the distance of key c from query t is t - c.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memattn.errors import ShapeError, check_tensor

MODES = ("joint", "split", "heads")


@dataclass(frozen=True)
class DistanceTerms:
    """How a context score depends on the distance x = t - c from its query to its key (each
    term optional; the persistent vectors have no distance and are never affected).

    rel: learned relative position embeddings u, [R, K] when causal (u_0 .. u_(R-1)) or
        [2R - 1, K] (u_-(R-1) .. u_(R-1)), the score q_tᵀ (k_c + u_x); farther distances
        read the last one.
    span [Hc] (tokens) with ramp > 0: the soft mask m_z(x) = clamp((ramp + z - |x|) / ramp,
        0, 1) multiplying the context's exp-scores, per context head.
    window: a query sees context keys at |x| < window only.
    """

    rel: torch.Tensor | None = None
    span: torch.Tensor | None = None
    ramp: float | None = None
    window: int | None = None


NO_DISTANCE_TERMS = DistanceTerms()


def check_inputs(q, k, v, pk, pv, *, mode, pq, rel, span, ramp, window, attention_mask,
                 initial_state, causal):
    """Validate shapes and options; returns (k, v) with `initial_state` prepended.

    Heads: k / v carry the Hc context heads, pk / pv the Hp persistent heads. "joint" and
    "split": Hc = Hp = H. "heads": the first Hc query heads read only the context, the last
    Hp only the persistent vectors, Hc + Hp = H.
    """
    if mode not in MODES:
        raise ShapeError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    check_tensor("q", q, "[B, Tq, H, K]", None, None, None, None)
    B, Tq, H, K = q.shape
    check_tensor("k", k, "[B, Tk, Hc, K]", B, None, None, K)
    Hc = k.shape[2]
    check_tensor("v", v, "[B, Tk, Hc, V]", B, k.shape[1], Hc, None)
    V = v.shape[-1]
    check_tensor("pk", pk, "[Hp, N, Kp]", None, None, None)
    Hp, N, Kp = pk.shape
    check_tensor("pv", pv, "[Hp, N, V]", Hp, N, V)
    if mode == "heads":
        if Hc + Hp != H:
            raise ShapeError(f"pk: mode 'heads' splits the H={H} query heads into context heads "
                             f"(k has Hc={Hc}) and persistent heads (pk has Hp={Hp}); expected "
                             f"Hc + Hp = {H}, got {Hc + Hp}")
        if N == 0:
            raise ShapeError("pk: mode 'heads' needs N >= 1 persistent vectors for its persistent heads, got N=0")
    else:
        if Hc != H:
            raise ShapeError(f"k: expected [B, Tk, H, K] with H = {H} heads (mode {mode!r}), got shape {tuple(k.shape)}")
        if Hp != H:
            raise ShapeError(f"pk: expected [H, N, Kp] with H = {H} heads (mode {mode!r}), got shape {tuple(pk.shape)}")
    if pq is not None:
        check_tensor("pq", pq, "[B, Tq, Hp, Kp]", B, Tq, Hp, Kp)
    elif Kp != K:
        raise ShapeError(f"pk: without pq the persistent keys share the queries' dim K={K}, got Kp={Kp}")
    if initial_state is not None:
        if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
            raise ShapeError("initial_state: expected a pair (k0 [B, T0, Hc, K], v0 [B, T0, Hc, V]), "
                             f"got {type(initial_state).__name__}")
        k0, v0 = initial_state
        check_tensor("initial_state[0]", k0, "[B, T0, Hc, K]", B, None, Hc, K)
        check_tensor("initial_state[1]", v0, "[B, T0, Hc, V]", B, k0.shape[1], Hc, V)
        k, v = torch.cat([k0.to(k.dtype), k], 1), torch.cat([v0.to(v.dtype), v], 1)
    Tk = k.shape[1]
    if causal and Tq > Tk:
        raise ShapeError(f"q: causal attention needs Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    if rel is not None:
        check_tensor("rel", rel, "[R, K] (causal) or [2R - 1, K]", None, K)
        if not causal and rel.shape[0] % 2 == 0:
            raise ShapeError(f"rel: not causal, expected 2R - 1 rows (u_-(R-1) .. u_(R-1)), got {rel.shape[0]}")
        if rel.shape[0] == 0:
            raise ShapeError("rel: expected at least one relative position embedding, got none")
    if span is not None:
        check_tensor("span", span, "[Hc]", Hc)
        if ramp is None or ramp <= 0:
            raise ShapeError(f"ramp: the soft span mask needs a ramp > 0, got {ramp!r}")
    if window is not None and window < 1:
        raise ShapeError(f"window: expected a number of tokens >= 1, got {window}")
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask, "[B, Tk]", B, Tk)
        if attention_mask.dtype != torch.bool:
            raise ShapeError(f"attention_mask: expected dtype torch.bool, got {attention_mask.dtype}")
    return k, v


def resolve_scale(scale: float | None, dim: int) -> float:
    return 1.0 / math.sqrt(dim) if scale is None else float(scale)


def distances(Tq: int, Tk: int, device=None) -> torch.Tensor:
    """Distance t - c of key c from query t, [Tq, Tk] (int64); query i sits at Tk - Tq + i."""
    rows = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)
    return rows - torch.arange(Tk, device=device)[None, :]


def visible(dist: torch.Tensor, *, causal: bool, window: int | None) -> torch.Tensor:
    """Which context keys a query may see, bool [Tq, Tk]: the past (causal) within the window."""
    seen = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
    if window is not None:
        seen = seen & (dist.abs() < window)
    return seen


def span_mask(span: torch.Tensor, ramp: float, dist: torch.Tensor) -> torch.Tensor:
    """Soft span mask m_z(x) = clamp((R + z - x) / R, 0, 1) at x = |distance|.

    span: z per head [Hc] (tokens), dist [Tq, Tk] -> [Hc, Tq, Tk]. Differentiable in z.
    """
    x = dist.abs().to(span.dtype)
    return ((ramp + span[:, None, None] - x) / ramp).clamp(0.0, 1.0)


def rel_index(dist: torch.Tensor, rows: int, *, causal: bool) -> torch.Tensor:
    """Row of the relative embedding table for each distance, [Tq, Tk].

    Causal: u_0 .. u_(R-1) with R = rows, distances past R - 1 clipped to it (negative
    distances, always masked, read u_0). Not causal: rows = 2R - 1 for u_-(R-1) .. u_(R-1).
    """
    if causal:
        return dist.clamp(0, rows - 1)
    reach = (rows - 1) // 2
    return dist.clamp(-reach, reach) + reach
