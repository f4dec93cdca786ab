"""Softmax attention, the unbounded memory: one slot per token (φ_i = e_i)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from memattn.errors import ShapeError, check_devices, check_tensor
from memattn.ops.contract import check_mask, check_qkv, check_state_type, public_op


class KVState(NamedTuple):
    """The unbounded memory of softmax attention: the keys and values of every token seen.

    k [B, H, T, K]  their keys
    v [B, H, T, V]  their values

    Held in the dtype of the keys and values it gathers; it grows by one row a token.
    """

    k: torch.Tensor
    v: torch.Tensor


@public_op("torch")
def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      scale: float | None = None, attention_mask: torch.Tensor | None = None,
                      initial_state: KVState | None = None, output_final_state: bool = False,
                      backend: str = "auto") -> tuple[torch.Tensor, KVState | None]:
    """o = softmax(scale · q kᵀ) v through `scaled_dot_product_attention`: (o, state).

    q [B, Tq, H, K], k [B, Tk, H, K], v [B, Tk, H, V] -> o [B, Tq, H, V].
    causal: query i sits at position Tk - Tq + i and sees keys up to it (so a query
    block that continues a cache lines up with the end of the keys).
    scale defaults to K^-0.5.
    initial_state: a KVState of earlier tokens (k [B, H, Tp, K], v [B, H, Tp, V]), read
        before k and v (the unbounded memory: every key so far). The state returned with
        output_final_state is the KVState of all Tp + Tk tokens, else None.
    attention_mask: optional bool [B, Tk] (Tp + Tk with an initial state), True for keys that
        may be attended. A query whose keys are all masked (padding itself, at the start of a
        left-padded row) reads its own key (Tq <= Tk), so its output is defined and never NaN.
    backend: "auto" or "torch", both SDPA, which picks its own kernels ("triton" is a
        ConfigError).
    """
    check_state_type(initial_state, KVState)
    if initial_state is not None:
        B, _, _, H, K, V = check_qkv(q, k, v, length="Tk")
        check_devices(q, **{f"initial_state.{f}": t for f, t in zip(KVState._fields, initial_state)})
        check_tensor("initial_state.k", initial_state.k, "[B, H, Tp, K]", B, H, None, K)
        check_tensor("initial_state.v", initial_state.v, "[B, H, Tp, V]", B, H,
                     initial_state.k.shape[2], V)
        k, v = (torch.cat([held.transpose(1, 2), x], 1) for held, x in ((initial_state.k, k),
                                                                          (initial_state.v, v)))
    o = _softmax(q, k, v, causal, scale, attention_mask)
    return o, (KVState(k.transpose(1, 2), v.transpose(1, 2)) if output_final_state else None)


def _softmax(q, k, v, causal, scale, attention_mask) -> torch.Tensor:
    B, Tq, Tk, H, K, V = check_qkv(q, k, v, length="Tk")
    check_devices(q, attention_mask=attention_mask)
    if causal and Tq > Tk:
        raise ShapeError(f"q: causal attention needs Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    mask = None
    if attention_mask is not None:
        check_mask(attention_mask, B, Tk, "[B, Tk]")
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
