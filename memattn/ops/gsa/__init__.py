"""Gated slot attention (GSA): M slots per head that forget at learned rates.

Zhang et al. 2024, *Gated Slot Attention for Efficient Linear-Time Sequence Modeling*
(arXiv:2409.07146). An ABC-style memory of M slots (Peng et al. 2022) whose write rule is
a gated recurrence: each slot keeps a share α_t of what it holds and takes the rest from the
new token. The forget gate α_t ∈ (0, 1] comes from the token; the op takes it in log space,
g_t = log α_t ≤ 0, [B, T, H, M]:

    K̃_t = α_t ⊙ K̃_{t-1} + (1 - α_t) ⊗ k_t      [M, K]   (α_t broadcast over K)
    Ṽ_t = α_t ⊙ Ṽ_{t-1} + (1 - α_t) ⊗ v_t      [M, V]
    o_t = softmax_M(scale · K̃_t q_t)ᵀ Ṽ_t        scale = K^-0.5 by default

Empty memories are zeros. Not causal (an encoder, cross attention), every query reads the
memory after the whole sequence (Tq may differ from T). The read is ABC's softmax over the
slots; the write forgets, so the state has one size and old tokens fade at each slot's own
rate: a stream of any length stays a convex mix of what was written.

Three forms give one answer (tests hold them to it):

    reference   reference.py   the recurrence as written, a loop over time; the ground truth
    recurrent   recurrent.py   one token at a time from the fixed-size state (decoding):
                               `gated_slot_attention_step`
    chunked     chunked.py     chunks of C tokens for training, the memory carried between
                               them; the closed form (`gsa_memory`) when not causal
                varlen.py      packed sequences of different lengths (`cu_seqlens`), each alone

`gated_slot_attention` picks one with `mode`: "auto" (the default) takes the recurrent step
for a single causal token that continues a state, the chunked form for other causal inputs
and the closed form when not causal.

Backends (the `backend` argument, memattn.ops.contract): the causal chunked form and the
decoding step have Triton kernels, ABC's run with other logits (GSA's memory is ABC's
normalised one for s_i = log(1 - α_i) - Σ_{j≤i} g_j: memattn.kernels.gsa_chunk and
abc_decode.gsa_step_triton), forward and backward, initial and final state, packed
sequences. "auto" takes them for CUDA inputs, "triton" insists (on CPU tensors under
Triton's interpreter), "torch" runs the torch forms above.

Layout [B, T, H, D]; states [B, H, M, D]. fp16 / bf16 inputs are computed in float32 and o
comes back in q's dtype; states are float32 (float64 for float64 inputs).

Usage (the op, then the layer `gsa`, whose gates are g = log σ(W_g x) / 8 by default)::

    from memattn.ops import gated_slot_attention
    o, state = gated_slot_attention(q, k, v, g, output_final_state=True)      # a prefix
    o, state = gated_slot_attention(q2, k2, v2, g2, initial_state=state,      # and on
                                    output_final_state=True)
    layer = memattn.attention_layer("gsa", 256, 4, num_slots=64)
"""

from __future__ import annotations

import torch

from memattn.errors import ConfigError
from memattn.kernels import use_kernels
from memattn.ops.contract import check_packed, check_state_type, finite_or_off_cpu, outside_autocast, public_op
from memattn.ops.gsa.chunked import DEFAULT_CHUNK_SIZE, gsa_chunked, gsa_memory
from memattn.ops.gsa.common import GSAState, check_gsa_inputs
from memattn.ops.gsa.recurrent import gated_slot_attention_step, gsa_recurrent
from memattn.ops.gsa.reference import gsa_reference
from memattn.ops.gsa.varlen import gsa_varlen

MODES = ("auto", "chunked", "recurrent", "reference")


@public_op("torch", "triton")
@outside_autocast
def gated_slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                         causal: bool = True, scale: float | None = None,
                         initial_state: GSAState | None = None, output_final_state: bool = False,
                         mode: str = "auto", cu_seqlens: torch.Tensor | None = None,
                         backend: str = "auto") -> tuple[torch.Tensor, GSAState | None]:
    """Gated slot attention.

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], g [B, T, H, M] log forget gates
    (g = log α ≤ 0, finite; checked on the CPU). Causal (Tq = T): o_t reads the memory
    after token t. Not causal: every query reads the memory after the whole sequence.
    scale defaults to K^-0.5.

    initial_state: a GSAState (k [B, H, M, K], v [B, H, M, V]), the memories K̃, Ṽ after
    the tokens of an earlier call; running x[:a] then x[a:] from its state equals running
    x whole. Returns (o [B, Tq, H, V] in q's dtype, the GSAState after the last token if
    output_final_state else None).
    mode: "auto", "chunked", "recurrent" (causal only) or "reference".

    cu_seqlens: [N + 1] integer boundaries 0 = c_0 < ... < c_N = T of N sequences packed
    into one row (B = 1, causal only, mode "auto" or "chunked"); each sequence starts from
    its own initial state (batch N) and the final state has batch N.
    backend: which code runs the causal chunked form and the decoding step. "auto": the
    Triton kernels (memattn.kernels.gsa_chunk) for CUDA inputs they take (fp32 / fp16 /
    bf16, K, V, M ≤ 128), else torch; never on the CPU. "torch": the torch forms.
    "triton": the kernels, also on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).
    """
    if mode not in MODES:
        raise ConfigError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == "recurrent" and not causal:
        raise ConfigError("mode: 'recurrent' is a causal form; use 'auto' or 'chunked' "
                          "with causal=False")
    check_packed(cu_seqlens, causal, mode)
    if backend == "triton" and (not causal or mode not in ("auto", "chunked")):
        raise ConfigError(f"backend: 'triton' runs the causal chunked form, got "
                          f"{'causal=False' if not causal else f'mode={mode!r}'}; "
                          f"use backend='torch'")
    check_state_type(initial_state, GSAState)
    T = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    kwargs = {"scale": scale, "initial_state": initial_state,
              "output_final_state": output_final_state}
    if mode == "auto" and causal and T == 1 and initial_state is not None and cu_seqlens is None:
        check_gsa_inputs(q, k, v, g, causal, initial_state)
        o, state = gated_slot_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], initial_state,
                                             scale=scale, backend=backend)
        return o[:, None], (state if output_final_state else None)
    if causal and mode in ("auto", "chunked") and use_kernels(backend, (q, k, v, g, *(initial_state or ()))):
        from memattn.kernels.abc_chunk import MAX_DIM
        from memattn.kernels.gsa_chunk import gsa_chunk_triton
        if backend == "triton" or max(k.shape[-1], v.shape[-1], g.shape[-1]) <= MAX_DIM:
            return gsa_chunk_triton(q, k, v, g, cu_seqlens=cu_seqlens, **kwargs)
    if cu_seqlens is not None:
        return gsa_varlen(q, k, v, g, cu_seqlens, **kwargs)
    if mode == "recurrent" or (mode == "auto" and causal
                               and not finite_or_off_cpu(q, k, v, initial_state)):
        # a NaN or infinity in q, k, v: step by step, so the outputs before it stay exact
        return gsa_recurrent(q, k, v, g, **kwargs)
    if mode == "reference":
        return gsa_reference(q, k, v, g, causal=causal, **kwargs)
    return gsa_chunked(q, k, v, g, causal=causal, **kwargs)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MODES",
    "GSAState",
    "gated_slot_attention",
    "gated_slot_attention_step",
    "gsa_chunked",
    "gsa_memory",
    "gsa_recurrent",
    "gsa_reference",
    "gsa_varlen",
]
