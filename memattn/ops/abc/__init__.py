"""ABC: attention with bounded-memory control (Peng et al. 2022), as pure tensor functions.

A memory of M slots is written by control weights φ and read by a softmax over the slots:

    K̃_t = Σ_{i≤t} φ_i ⊗ k_i   [M, K]      Ṽ_t = Σ_{i≤t} φ_i ⊗ v_i   [M, V]
    o_t = softmax_M(scale · K̃_t q_t)ᵀ Ṽ_t                              scale = K^-0.5

`bounded_memory_attention` takes φ as given (non-negative, no normalisation); the control
strategies (Linformer columns, one-hot slots of random / window / mean-pool control,
clustering...) are choices of φ. `abc_attention` is ABC_MLP: slot logits s, α = exp(s),
φ_i = α_i / Σ_{j≤t} α_j per slot (over the whole sequence when not causal), computed in
log space so that any finite s, ±1e4 included, gives finite results.

Three forms give one answer (tests hold them to it):

    reference   reference.py   the equations as written, a loop over time, O(T²); ground truth
    recurrent   recurrent.py   one token at a time with a fixed-size state (decoding)
    chunked     chunked.py     chunks of C tokens for training; closed form when not causal

`abc_attention` / `bounded_memory_attention` pick one with `mode`: "auto" (the default) takes
the recurrent step for a single causal token that continues a state, the chunked form for
other causal inputs and the closed form when not causal. `backend` (memattn.ops.contract)
picks the code: abc_attention has Triton kernels (memattn.kernels.abc_chunk, abc_decode),
bounded_memory_attention the torch forms only.

Layout [B, T, H, D]; states [B, H, M, D]. fp16 / bf16 inputs are computed in float32 and o
comes back in q's dtype; states are float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from memattn.errors import ConfigError
from memattn.kernels import use_kernels
from memattn.ops.abc.chunked import abc_chunked, bounded_memory_chunked
from memattn.ops.abc.common import ABCState, BoundedMemoryState, check_inputs
from memattn.ops.contract import check_packed, check_state_type, finite_or_off_cpu, outside_autocast, public_op
from memattn.ops.abc.recurrent import (
    abc_attention_step,
    abc_recurrent,
    bounded_memory_attention_step,
    bounded_memory_recurrent,
)
from memattn.ops.abc.reference import abc_reference, bounded_memory_reference

MODES = ("auto", "chunked", "recurrent", "reference")


def _pick(mode: str, causal: bool, T: int, initial_state) -> str:
    if mode not in MODES:
        raise ConfigError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == "recurrent" and not causal:
        raise ConfigError("mode: 'recurrent' is a causal form; use 'auto' or 'chunked' "
                          "with causal=False")
    if mode == "auto":
        return "step" if causal and T == 1 and initial_state is not None else "chunked"
    return mode


@public_op("torch", "triton")
@outside_autocast
def abc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, *,
                  causal: bool = True, scale: float | None = None,
                  initial_state: ABCState | None = None, output_final_state: bool = False,
                  mode: str = "auto", cu_seqlens: torch.Tensor | None = None,
                  backend: str = "auto") -> tuple[torch.Tensor, ABCState | None]:
    """ABC_MLP attention.

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], s [B, T, H, M] slot logits (α = exp(s)).
    Causal (Tq = T): o_t reads K̃_t = Σ_{i≤t} α_i ⊗ k_i / Σ_{i≤t} α_i, likewise Ṽ_t.
    Not causal: every query reads the memory of the whole sequence (Tq may differ from T).
    scale defaults to K^-0.5.

    initial_state: an ABCState (log_z [B, H, M], k [B, H, M, K], v [B, H, M, V]) from an
    earlier call: log_z = log Σ exp(s_i) per slot over the tokens seen, k / v the memories
    K̃, Ṽ after them. Running x[:a] then x[a:] from its state equals running x whole; not
    causal, the queries read the memory of the state's tokens and the whole sequence.
    Returns (o [B, Tq, H, V] in q's dtype, the ABCState after the last token if
    output_final_state else None). mode: "auto", "chunked", "recurrent" or "reference".

    cu_seqlens: [N + 1] integer boundaries 0 = c_0 < ... < c_N = T of N sequences packed
    into one row (B = 1, causal only); each sequence starts from its own initial state
    (batch N) and the final state has batch N. Taken by the chunked form (mode "auto" or
    "chunked").
    backend: which code runs the chunked causal form. "auto": the Triton kernels
    (memattn.kernels.abc_chunk) for CUDA inputs they take (fp32 / fp16 / bf16, K, V, M ≤
    128), else torch; never on the CPU. "torch": the torch forms. "triton": the kernels,
    also on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1). A single token
    continuing a state takes the decoding step, with the same choice of backend.
    """
    T = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    check_packed(cu_seqlens, causal, mode)
    check_state_type(initial_state, ABCState)
    form = "chunked" if cu_seqlens is not None else _pick(mode, causal, T, initial_state)
    if backend == "triton" and (form not in ("chunked", "step") or not causal):
        raise ConfigError(f"backend: 'triton' runs the causal chunked form, got "
                          f"{'causal=False' if not causal else f'mode={mode!r}'}; "
                          f"use backend='torch'")
    if form == "step":
        check_inputs(q, k, v, s, "s", causal, initial_state, ABCState)
        o, state = abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0], initial_state,
                                      scale=scale, backend=backend)
        return o[:, None], (state if output_final_state else None)
    kwargs = {"scale": scale, "initial_state": initial_state,
              "output_final_state": output_final_state}
    if form == "chunked" and causal and use_kernels(backend, (q, k, v, s, *(initial_state or ()))):
        from memattn.kernels.abc_chunk import MAX_DIM, abc_chunk_triton
        if backend == "triton" or max(k.shape[-1], v.shape[-1], s.shape[-1]) <= MAX_DIM:
            return abc_chunk_triton(q, k, v, s, cu_seqlens=cu_seqlens, **kwargs)
    if cu_seqlens is not None:
        from memattn.ops.abc.varlen import abc_varlen
        return abc_varlen(q, k, v, s, cu_seqlens, **kwargs)
    if form == "recurrent" or (mode == "auto" and causal and not finite_or_off_cpu(q, k, v, s, initial_state)):
        return abc_recurrent(q, k, v, s, **kwargs)
    if form == "reference":
        return abc_reference(q, k, v, s, causal=causal, **kwargs)
    return abc_chunked(q, k, v, s, causal=causal, **kwargs)


@public_op("torch")
@outside_autocast
def bounded_memory_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             phi: torch.Tensor, *, causal: bool = True,
                             scale: float | None = None,
                             initial_state: BoundedMemoryState | None = None,
                             output_final_state: bool = False, mode: str = "auto",
                             backend: str = "auto"
                             ) -> tuple[torch.Tensor, BoundedMemoryState | None]:
    """General ABC attention with given write weights.

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], φ [B, T, H, M] non-negative (a negative
    weight is an error on the CPU; on a GPU it is not checked, which would synchronise).
    Causal (Tq = T): K̃_t = Σ_{i≤t} φ_i ⊗ k_i, Ṽ_t likewise, no normalisation; a slot
    nothing was written to has K̃ = 0 and scores 0. Not causal: sums over the whole sequence.

    initial_state: a BoundedMemoryState (k [B, H, M, K], v [B, H, M, V]), the memories
    K̃, Ṽ after the tokens seen. Returns (o [B, Tq, H, V] in q's dtype, the state after the
    last token if output_final_state else None). mode as in `abc_attention`.
    backend: "auto" or "torch", both the torch forms (no Triton kernel runs the whole op;
    "triton" is a ConfigError).
    """
    T = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    check_state_type(initial_state, BoundedMemoryState)
    form = _pick(mode, causal, T, initial_state)
    if form == "step":
        check_inputs(q, k, v, phi, "phi", causal, initial_state, BoundedMemoryState,
                     nonnegative=True)
        o, state = bounded_memory_attention_step(q[:, 0], k[:, 0], v[:, 0], phi[:, 0],
                                                 initial_state, scale=scale)
        return o[:, None], (state if output_final_state else None)
    kwargs = {"scale": scale, "initial_state": initial_state,
              "output_final_state": output_final_state}
    if form == "recurrent" or (mode == "auto" and causal and not finite_or_off_cpu(q, k, v, phi, initial_state)):
        return bounded_memory_recurrent(q, k, v, phi, **kwargs)
    if form == "reference":
        return bounded_memory_reference(q, k, v, phi, causal=causal, **kwargs)
    return bounded_memory_chunked(q, k, v, phi, causal=causal, **kwargs)


__all__ = [
    "MODES",
    "ABCState",
    "BoundedMemoryState",
    "abc_attention",
    "abc_attention_step",
    "abc_chunked",
    "abc_recurrent",
    "abc_reference",
    "bounded_memory_attention",
    "bounded_memory_attention_step",
    "bounded_memory_chunked",
    "bounded_memory_recurrent",
    "bounded_memory_reference",
]
