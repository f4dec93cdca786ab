"""What both forms of persistent-memory attention share: input checks and the position terms.

Positions are relative: query i of a block of Tq queries sits at position Tk - Tq + i of the
Tk context keys (so a query block that continues a cache lines up with the end of the keys),
and the distance of key c from query t is t - c.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memattn.errors import ConfigError, ShapeError, check_devices, check_float, check_tensor
from memattn.ops.contract import check_mask, check_qkv, check_state_type
from memattn.ops.softmax import KVState

VARIANTS = ("joint", "split", "heads")


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


def check_inputs(q, k, v, pk, pv, *, variant, pq, rel, span, ramp, window, attention_mask,
                 initial_state, causal):
    """Validate shapes and options; returns (k, v) with `initial_state` prepended.

    Heads: k / v carry the Hc context heads, pk / pv the Hp persistent heads. "joint" and
    "split": Hc = Hp = H. "heads": the first Hc query heads read only the context, the last
    Hp only the persistent vectors, Hc + Hp = H.
    """
    if variant not in VARIANTS:
        raise ConfigError(f"variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")
    B, Tq, _, Hc, K, V = check_qkv(q, k, v, length="Tk", heads="Hc")
    H = q.shape[2]
    check_tensor("pk", pk, "[Hp, N, Kp]", None, None, None)
    Hp, N, Kp = pk.shape
    check_tensor("pv", pv, "[Hp, N, V]", Hp, N, V)
    for name, t in (("pk", pk), ("pv", pv)):
        check_float(name, t)
    check_devices(q, pk=pk, pv=pv, pq=pq, attention_mask=attention_mask)
    if variant == "heads":
        if Hc + Hp != H:
            raise ShapeError(f"pk: variant 'heads' splits the H={H} query heads into context heads "
                             f"(k has Hc={Hc}) and persistent heads (pk has Hp={Hp}); expected "
                             f"Hc + Hp = {H}, got {Hc + Hp}")
        if N == 0:
            raise ShapeError("pk: variant 'heads' needs N >= 1 persistent vectors for its persistent heads, got N=0")
    else:
        if Hc != H:
            raise ShapeError(f"k: expected [B, Tk, H, K] with H = {H} heads (variant {variant!r}), got shape {tuple(k.shape)}")
        if Hp != H:
            raise ShapeError(f"pk: expected [H, N, Kp] with H = {H} heads (variant {variant!r}), got shape {tuple(pk.shape)}")
    if pq is not None:
        check_tensor("pq", pq, "[B, Tq, Hp, Kp]", B, Tq, Hp, Kp)
    elif Kp != K:
        raise ShapeError(f"pk: without pq the persistent keys share the queries' dim K={K}, got Kp={Kp}")
    check_state_type(initial_state, KVState)
    if initial_state is not None:
        k0, v0 = initial_state
        check_devices(q, **{"initial_state.k": k0, "initial_state.v": v0})
        check_tensor("initial_state.k", k0, "[B, Hc, T0, K]", B, Hc, None, K)
        check_tensor("initial_state.v", v0, "[B, Hc, T0, V]", B, Hc, k0.shape[2], V)
        k, v = (torch.cat([held.transpose(1, 2).to(x.dtype), x], 1) for held, x in ((k0, k), (v0, v)))
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
            raise ConfigError(f"ramp: the soft span mask needs a ramp > 0, got {ramp!r}")
    if window is not None and window < 1:
        raise ConfigError(f"window: expected a number of tokens >= 1, got {window}")
    check_mask(attention_mask, B, Tk, "[B, Tk]")
    return k, v


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
