"""Softmax attention over a sliding window of keys: the read of abc-window and abc-dilated.

A FIFO memory of the last n tokens (ABC's shift-matrix control) holds exactly those n keys
and values, so reading it is softmax attention restricted to a window:

    causal          query t reads keys t-n+1 .. t
    bidirectional   query t reads keys t - n // 2 .. t + (n - 1) // 2 (centred; one more
                    before for even n)
    dilated         (causal) also the last n positions ≤ t that are multiples of d, in the
                    same softmax: a key in both sets counts twice

    local_window_attention   the whole sequence in blocks of about n tokens, O(T · n)
    local_window_reference   a loop over queries, the window spelled out; ground truth
    counted_softmax          softmax attention with a multiplicity per (query, key): the
                             read of a continued queue, whose held keys sit in slots
    in_window, in_strided_queue   the two membership rules, as boolean masks

`local_window_attention` keeps the queue of a causal window as its state (`WindowState`, the
last n keys and values); a layer that decodes one token at a time keeps its own ring buffer
of them, and reads it with `counted_softmax`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from memattn.errors import ConfigError, ShapeError, check_devices, check_tensor
from memattn.ops.contract import (accumulation_dtype, check_mask, check_no_state, check_qkv, check_state_type,
                                  default_scale, public_op)


class WindowState(NamedTuple):
    """The queue of a causal window of n after the tokens seen so far: their last n, oldest first.

    k    [B, H, n, K]  the keys of the last n tokens (zeros in a slot no token reached)
    v    [B, H, n, V]  their values
    real [B, H, n]     bool, False for a slot no token reached or one that holds padding (the
                       same for every head)

    Held in the dtype of the keys and values it copies.
    """

    k: torch.Tensor
    v: torch.Tensor
    real: torch.Tensor


def in_window(qpos: torch.Tensor, kpos: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """Key position kpos is in the window of n positions of query qpos (broadcast): causal
    the last n up to qpos, bidirectional qpos - n // 2 .. qpos + (n - 1) // 2."""
    rel = qpos - kpos
    return (rel >= 0) & (rel < window) if causal else (rel <= window // 2) & (-rel <= (window - 1) // 2)


def in_strided_queue(qpos: torch.Tensor, kpos: torch.Tensor, window: int,
                     dilation: int) -> torch.Tensor:
    """Key position kpos is in the dilated queue of query qpos (broadcast): one of the last
    n positions ≤ qpos that are multiples of d."""
    d = dilation
    return (kpos % d == 0) & (kpos <= qpos) & (qpos // d - kpos // d < window)


def counted_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """Softmax attention where key j enters query i's memory count[b, i, j] times (0: absent).

    q [B, Tq, H, D], k [B, Tk, H, D], v [B, Tk, H, V], count [B, Tq, Tk] -> o [B, Tq, H, V];
    a query with an empty memory reads zeros. A key held in two slots weighs twice.
    """
    scores = default_scale(scale, q.shape[-1]) * torch.einsum("bqhd,bkhd->bhqk", q, k)
    held = (count > 0)[:, None]  # [B, 1, Tq, Tk]
    scores = torch.where(held, scores + torch.log(count.clamp_min(1).to(scores.dtype))[:, None],
                         -torch.inf)
    # A query with an empty memory: finite scores in its row (no NaN, forward or backward),
    # then its weights are zeroed.
    empty = ~held.any(-1, keepdim=True)  # [B, 1, Tq, 1]
    p = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.einsum("bhqk,bkhv->bqhv", p, v)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, causal: bool,
           dilation: int, attention_mask: torch.Tensor | None) -> tuple[int, int]:
    """Check the inputs of both window ops; return (B, T)."""
    B, Tq, T, _, _, _ = check_qkv(q, k, v)
    if Tq != T:
        raise ShapeError(f"q: expected one query per key (Tq = T) in a sliding window, "
                         f"got Tq={Tq} for T={T}")
    check_mask(attention_mask, B, T)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"window: expected a positive integer, got {window!r}")
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 0:
        raise ConfigError(f"dilation: expected an integer >= 0 (0: no dilated queue), got {dilation!r}")
    if dilation and not causal:
        raise ConfigError("dilation: the dilated queue is a causal write rule; pass causal=True "
                          "or dilation=0")
    return B, T


def _check_state(state: WindowState, q: torch.Tensor, n: int, K: int, V: int) -> None:
    B, _, H, _ = q.shape
    check_state_type(state, WindowState)
    check_devices(q, **{f"initial_state.{f}": t for f, t in zip(WindowState._fields, state)})
    check_tensor("initial_state.k", state.k, "[B, H, n, K]", B, H, n, K)
    check_tensor("initial_state.v", state.v, "[B, H, n, V]", B, H, n, V)
    check_tensor("initial_state.real", state.real, "[B, H, n]", B, H, n)
    if state.real.dtype != torch.bool:
        raise ShapeError(f"initial_state.real: expected dtype torch.bool, got {state.real.dtype}")


def _last(k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, n: int) -> WindowState:
    """The queue after k, v [B, T, H, *], real [B, T]: their last n positions, zero / False
    filled in front when T < n, copied (a state the size of the window, not of the input)."""
    short = max(0, n - k.shape[1])

    def last(x):  # [B, T, *] -> [B, n, *]
        return torch.cat([x.new_zeros(x.shape[0], short, *x.shape[2:]), x[:, -n:]], 1)

    k, v = (last(x).transpose(1, 2).contiguous() for x in (k, v))  # [B, H, n, *]
    return WindowState(k, v, last(real)[:, None].expand(-1, k.shape[1], -1))


@public_op("torch")
def local_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
                           causal: bool = True, dilation: int = 0,
                           attention_mask: torch.Tensor | None = None,
                           scale: float | None = None, initial_state: WindowState | None = None,
                           output_final_state: bool = False, backend: str = "auto"
                           ) -> tuple[torch.Tensor, WindowState | None]:
    """Softmax attention over a sliding window, in blocks: O(T · n) time and memory.

    q, k [B, T, H, D], v [B, T, H, V] -> (o [B, T, H, V], state); attention_mask [B, T] bool
    (False: padding, never read; None: every key is real). scale defaults to D^-0.5.
    Causal: query t reads keys t-n+1 .. t; bidirectional: keys t - n // 2 .. t + (n - 1) // 2. The
    sequence is cut into blocks of c tokens (c = n causal, n // 2 + 1 bidirectional) and a
    block reads itself and its neighbours (the one before; bidirectional also the one
    after), which hold every key of its window. dilation d > 0 (causal): query t also reads
    the last n positions ≤ t that are multiples of d, in the same softmax (a key in both
    sets counts twice), gathered per block from the keys at 0, d, 2d, ... A query with no
    real key reads zeros.

    initial_state: a WindowState (k [B, H, n, D], v [B, H, n, V], real [B, H, n]), the queue
    of the tokens before q, k, v; the state returned with output_final_state is the queue
    after them, else None. A causal window without dilation only: a bidirectional window
    reads ahead, and the dilated queue's state is kept by the abc-dilated layer.
    backend: "auto" or "torch" (no Triton kernel; "triton" is a ConfigError).
    """
    B, T = _check(q, k, v, window, causal, dilation, attention_mask)
    if not causal or dilation:
        check_no_state("local_window_attention", initial_state, output_final_state,
                       "a state is the queue of a causal window without dilation")
    n = window
    if initial_state is not None or output_final_state:
        real = (attention_mask if attention_mask is not None
                else torch.ones(B, T, dtype=torch.bool, device=q.device))
    if initial_state is not None:  # the queue's tokens first, their queries discarded
        _check_state(initial_state, q, n, k.shape[-1], v.shape[-1])
        q = torch.cat([q.new_zeros(B, n, *q.shape[2:]), q], 1)
        k, v = (torch.cat([held.transpose(1, 2).to(x.dtype), x], 1)
                for held, x in ((initial_state.k, k), (initial_state.v, v)))
        real = attention_mask = torch.cat([initial_state.real[:, 0], real], 1)
    o = _blocks(q, k, v, window=n, causal=causal, dilation=dilation,
                attention_mask=attention_mask, scale=scale)
    if initial_state is not None:
        o = o[:, n:]
    return o, (_last(k, v, real, n) if output_final_state else None)


def _blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, causal: bool,
            dilation: int, attention_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """`local_window_attention` from an empty queue, inputs checked: o [B, T, H, V]."""
    (B, T, H, _), V = q.shape, v.shape[-1]
    c = window if causal else window // 2 + 1
    nb = -(-T // c)
    pad = nb * c - T
    before, after = 1, (0 if causal else 1)
    # heads first, [B, H, T, *]: block i of queries reads keys of blocks i - 1 .. i + after,
    # one fused softmax attention per (row, head, block) with the window as its mask
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))

    def neighbours(x: torch.Tensor, dim: int) -> torch.Tensor:
        """[..., T, *] with T at `dim` -> [..., nb, w, *]: each block's keys and its neighbours'."""
        x = F.pad(x.movedim(dim, -1), (before * c, pad + after * c)).movedim(-1, dim)
        x = x.unflatten(dim, (nb + before + after, c))
        return torch.cat([x.narrow(dim, i, nb) for i in range(before + after + 1)], dim=dim + 1)

    qb = F.pad(q, (0, 0, 0, pad)).unflatten(2, (nb, c))  # [B, H, nb, c, D]
    kb, vb = neighbours(k, 2), neighbours(v, 2)  # [B, H, nb, w, *]
    qpos = torch.arange(nb * c, device=q.device).view(nb, c)  # [nb, c]
    kpos = qpos[:, :1] - before * c + torch.arange(kb.shape[3], device=q.device)  # [nb, w]
    seen = in_window(qpos[:, :, None], kpos[:, None, :], window, causal)[None]  # [1, nb, c, w]
    if attention_mask is None:  # only the keys outside the sequence are hidden
        seen = seen & ((kpos >= 0) & (kpos < T))[None, :, None, :]
    else:
        seen = seen & neighbours(attention_mask, 1)[:, :, None, :]  # [B, nb, c, w]
    if dilation:  # the strided keys j·d of block i: j in [i c // d - n + 1, ((i + 1) c - 1) // d]
        d = dilation
        first = qpos[:, 0] // d - window + 1  # [nb]
        j = first[:, None] + torch.arange(window + c // d + 1, device=q.device)  # [nb, s]
        pos = (j * d).clamp(0, T - 1)
        kb = torch.cat([kb, k[:, :, pos]], dim=3)
        vb = torch.cat([vb, v[:, :, pos]], dim=3)
        strided = in_strided_queue(qpos[:, :, None], (j * d)[:, None, :], window, d)
        strided = strided & ((j >= 0) & (j * d < T))[:, None, :]  # [nb, c, s]
        if attention_mask is not None:
            strided = strided & attention_mask[:, pos][:, :, None, :]
        seen = torch.cat([seen, strided.expand(seen.shape[0], -1, -1, -1)], dim=-1)
    reads = None
    if attention_mask is not None:  # without padding every query reads at least itself
        # a query with no real key reads its whole block (finite everywhere, backward too),
        # then zeros
        reads = seen.any(-1, keepdim=True)  # [B, nb, c, 1]
        seen = (seen | ~reads)[:, None].expand(-1, H, -1, -1, -1).flatten(0, 1)
    o = F.scaled_dot_product_attention(qb.flatten(0, 1), kb.flatten(0, 1), vb.flatten(0, 1),
                                       attn_mask=seen, scale=scale)  # [B H, nb, c, V]
    o = o.view(B, H, nb, c, V)
    if reads is not None:
        o = o * reads[:, None].to(o.dtype)
    return o.flatten(2, 3)[:, :, :T].transpose(1, 2)


def local_window_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
                           causal: bool = True, dilation: int = 0,
                           attention_mask: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """`local_window_attention` as written: for each query, a softmax over its keys.

    Shapes and arguments as in `local_window_attention`. Query t of row b lists the positions
    it reads (its window, then with dilation d the last n multiples of d up to t, so a key in
    both is listed twice), drops padding, and takes one softmax over what is left; with
    nothing left it reads zeros. Computed in float32 (float64 for float64 inputs), returned
    in q's dtype. O(T · n) Python steps: for tests.
    """
    B, T = _check(q, k, v, window, causal, dilation, attention_mask)
    n = window
    scale = default_scale(scale, q.shape[-1])
    out_dtype, dt = q.dtype, accumulation_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    rows = []
    for b in range(B):
        outs = []
        for t in range(T):
            if causal:
                keys = list(range(max(0, t - n + 1), t + 1))
            else:
                keys = list(range(max(0, t - n // 2), min(T, t + (n - 1) // 2 + 1)))
            if dilation:
                keys += list(range(0, t + 1, dilation))[-n:]
            if attention_mask is not None:
                keys = [j for j in keys if attention_mask[b, j]]
            if not keys:
                outs.append(v.new_zeros(v.shape[2:]))  # [H, V]
                continue
            scores = scale * torch.einsum("hd,jhd->hj", q[b, t], k[b, keys])  # [H, len(keys)]
            outs.append(torch.einsum("hj,jhv->hv", torch.softmax(scores, -1), v[b, keys]))
        rows.append(torch.stack(outs))  # [T, H, V]
    return torch.stack(rows).to(out_dtype)  # [B, T, H, V]
