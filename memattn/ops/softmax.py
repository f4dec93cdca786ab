"""Softmax attention, the unbounded memory: one slot per token (φ_i = e_i)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from memattn.errors import ShapeError, check_devices, check_float, check_tensor


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      scale: float | None = None, attention_mask: torch.Tensor | None = None,
                      initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
                      output_final_state: bool = False
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """o = softmax(scale · q kᵀ) v through `scaled_dot_product_attention`: (o, state).

    q [B, Tq, H, K], k [B, Tk, H, K], v [B, Tk, H, V] -> o [B, Tq, H, V].
    causal: query i sits at position Tk - Tq + i and sees keys up to it (so a query
    block that continues a cache lines up with the end of the keys).
    scale defaults to K^-0.5.
    initial_state: (k, v) of earlier tokens, [B, Tp, H, K] and [B, Tp, H, V], read before k
        and v (the unbounded memory: every key so far). The state returned with
        output_final_state is the (k, v) of all Tp + Tk tokens, else None.
    attention_mask: optional bool [B, Tk] (Tp + Tk with an initial state), True for keys that
        may be attended. A query whose keys are all masked (padding itself, at the start of a
        left-padded row) reads its own key (Tq <= Tk), so its output is defined and never NaN.
    """
    if initial_state is not None:
        if not isinstance(initial_state, tuple) or len(initial_state) != 2:
            raise ShapeError(f"initial_state: expected the (k, v) of earlier tokens, got {type(initial_state).__name__}")
        check_tensor("k", k, "[B, Tk, H, K]", None, None, None, None)
        check_tensor("v", v, "[B, Tk, H, V]", k.shape[0], k.shape[1], k.shape[2], None)
        check_tensor("initial_state.k", initial_state[0], "[B, Tp, H, K]", *k.shape[:1], None, *k.shape[2:])
        check_tensor("initial_state.v", initial_state[1], "[B, Tp, H, V]", *v.shape[:1],
                     initial_state[0].shape[1], *v.shape[2:])
        k, v = torch.cat([initial_state[0], k], 1), torch.cat([initial_state[1], v], 1)
    o = _softmax(q, k, v, causal, scale, attention_mask)
    return o, ((k, v) if output_final_state else None)


def _softmax(q, k, v, causal, scale, attention_mask) -> torch.Tensor:
    B, Tq, H, K = q.shape if q.dim() == 4 else (None,) * 4
    check_tensor("q", q, "[B, Tq, H, K]", None, None, None, None)
    check_tensor("k", k, "[B, Tk, H, K]", B, None, H, K)
    Tk = k.shape[1]
    check_tensor("v", v, "[B, Tk, H, V]", B, Tk, H, None)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
        if t.dtype != q.dtype:
            raise ShapeError(f"{name}: expected the dtype of q ({q.dtype}), got {t.dtype}")
    check_devices(q, k=k, v=v, attention_mask=attention_mask)
    if causal and Tq > Tk:
        raise ShapeError(f"q: causal attention needs Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    mask = None
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask, "[B, Tk]", B, Tk)
        if attention_mask.dtype != torch.bool:
            raise ShapeError(f"attention_mask: expected dtype torch.bool, got {attention_mask.dtype}")
        mask = attention_mask[:, None, None, :]  # [B, 1, 1, Tk]
    is_causal = causal and Tq == Tk and mask is None
    if causal and not is_causal and Tq > 1:
        rows = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
        allowed = torch.arange(Tk, device=q.device)[None, :] <= rows  # [Tq, Tk]
        mask = allowed if mask is None else mask & allowed
    if attention_mask is not None and Tq <= Tk:  # a query with no key left reads its own
        own = torch.arange(Tk, device=q.device)[None, :] == torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
        mask = mask | (own & ~mask.any(-1, keepdim=True))  # [B, 1, Tq, Tk]
    with _backends(q, Tq, Tk):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=is_causal, scale=scale)
    return o.transpose(1, 2)


# SDPA's backends for a query block that continues a cache on a GPU: all but cuDNN's, which
# builds a graph for every new key length (with it allowed, a step of a 6-layer LM took 42 ms
# on an H200 at every context from 256 to 32k tokens, benchmarks/results/nvidia-h200/decode.md).
_CONTINUING = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _backends(q: torch.Tensor, Tq: int, Tk: int):
    """The context SDPA runs in: decoding on CUDA (Tq < Tk, the key length grows each call)
    keeps off cuDNN; anything else as torch chooses."""
    return sdpa_kernel(_CONTINUING) if q.is_cuda and Tq < Tk else nullcontext()
