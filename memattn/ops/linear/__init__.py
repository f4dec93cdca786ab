"""Cheap (gated) linear attention, de Brébisson & Vincent 2016: a fixed-size memory read linearly.

Write rule  C_t = α_t C_{t-1} + β_t v_t k_tᵀ     (with k = v = h: the paper's C = Σ h hᵀ)
Read rule   o_t = scale · C_t q_t                 (O(K·V) per query, whatever the length)

Notation: B batch, T length (Tq queries), H heads, K key / query dim, V value dim,
C chunk length, N = ⌈T / C⌉ chunks. Activations [B, T, H, D]; the state is a
LinearAttentionState whose kv is laid out [B, H, K, V], i.e. S = Cᵀ = Σ k vᵀ and o = Sᵀ q.
The read's scale defaults to 1 (the paper's C q), not the K^-0.5 of the softmax reads.

Forms (all agree; tests hold each to the reference):
    reference.py   loop over time, fp32: the ground truth
    recurrent.py   one step at a time with the fixed-size state: decoding, and reading a
                   stored memory with any number of queries
    chunked.py     C×C matmuls inside chunks, the state between them: the fast forward
    backward.py    autograd Function whose backward never stores the T states C_t
"""

from __future__ import annotations

import torch

from memattn.errors import ConfigError
from memattn.kernels import use_kernels
from memattn.ops.contract import check_state_type, finite_or_off_cpu, public_op
from memattn.ops.linear.backward import (ALPHA_MIN, MAX_AMPLIFICATION, choose_state_mode,
                                         linear_attention_autograd)
from memattn.ops.linear.chunked import DEFAULT_CHUNK_SIZE, linear_attention_chunked
from memattn.ops.linear.common import LinearAttentionState, check_alpha_values, check_inputs
from memattn.ops.linear.recurrent import (linear_attention_read, linear_attention_recurrent,
                                          linear_attention_step)
from memattn.ops.linear.reference import linear_attention_reference


@public_op("torch", "triton")
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                     alpha: torch.Tensor | None = None, beta: torch.Tensor | None = None,
                     scale: float | None = None, initial_state: LinearAttentionState | None = None,
                     output_final_state: bool = False, backend: str = "auto"
                     ) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Linear attention over the memory C_t = α_t C_{t-1} + β_t v_t k_tᵀ, read as scale · C_t q_t.

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V]; alpha, beta [B, T, H] (gates >= 0 and
    weights per step and head, default 1); scale: a float, None for 1 — deliberately the
    paper's read o = C q, where the softmax ops default to K^-0.5; initial_state a
    LinearAttentionState (kv [B, H, K, V]): the memory left by the previous part of the
    sequence (running x[:a] and then x[a:] from its final state equals running x whole).

    causal: o_t reads C_t (Tq = T). Not causal: every query reads C_T (any Tq).
    Returns o [B, Tq, H, V] in the dtype of q (fp16 / bf16 accumulate in fp32) and, if
    output_final_state, the LinearAttentionState after the last token (kv = C_Tᵀ in fp32,
    fp64 for fp64 inputs), else None.

    When a gradient is needed the chunked forward runs inside LinearAttentionFunction,
    whose backward stores O(T·(K+V) + K·V) numbers, or O(T·(K+V) + (T/C)·K·V) when the
    gates make inverting the updates unsafe (see backward.py).

    backend: "auto" (the Triton kernel for causal CUDA inputs, else the torch forms),
    "torch", or "triton" (causal only; memattn.kernels.linear, whose backward keeps only
    the inputs).
    """
    check_state_type(initial_state, LinearAttentionState)
    inputs = (q, k, v, alpha, beta, *(initial_state or ()))
    if backend == "triton" and not causal:
        raise ConfigError("backend: the Triton kernel is the causal form; use "
                          "backend='torch' (or 'auto') with causal=False")
    if causal and use_kernels(backend, inputs):
        from memattn.kernels.linear import linear_attention_triton
        return linear_attention_triton(q, k, v, alpha=alpha, beta=beta, scale=scale,
                                       initial_state=initial_state,
                                       output_final_state=output_final_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in inputs)
    if causal and q.dim() == 4 and q.shape[1] == 1 and not needs_grad:  # one decoding step
        check_inputs(q, k, v, causal=causal, alpha=alpha, beta=beta, initial_state=initial_state)
        check_alpha_values(alpha)
        o, state = linear_attention_step(
            q[:, 0], k[:, 0], v[:, 0], initial_state,
            *(None if t is None else t[:, 0] for t in (alpha, beta)), scale=scale)
        return o[:, None], (state if output_final_state else None)
    if causal and not finite_or_off_cpu(*inputs):
        # a non-finite input: step by step, so the outputs before it stay the reference's
        return linear_attention_recurrent(q, k, v, alpha=alpha, beta=beta, scale=scale,
                                          initial_state=initial_state,
                                          output_final_state=output_final_state)
    if needs_grad:
        o, state = linear_attention_autograd(q, k, v, causal=causal, alpha=alpha, beta=beta,
                                             scale=scale, initial_state=initial_state)
        return o, (state if output_final_state else None)
    return linear_attention_chunked(q, k, v, causal=causal, alpha=alpha, beta=beta, scale=scale,
                                    initial_state=initial_state,
                                    output_final_state=output_final_state)


__all__ = [
    "ALPHA_MIN", "DEFAULT_CHUNK_SIZE", "MAX_AMPLIFICATION", "LinearAttentionState", "choose_state_mode",
    "linear_attention", "linear_attention_autograd", "linear_attention_chunked",
    "linear_attention_read", "linear_attention_recurrent", "linear_attention_reference",
    "linear_attention_step",
]
