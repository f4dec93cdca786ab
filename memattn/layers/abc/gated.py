"""gsa: gated slot attention (Zhang et al. 2024), an ABC memory written by forget gates.

Each head keeps M slots. Token t's forget gates α_t [H, M] come from the input,

    g_t = log σ(W_g x_t) / τ     (α_t = σ(W_g x_t)^(1/τ), τ = gate_logit_normalizer)

and each slot keeps α_t of what it holds and takes the rest from the token
(`memattn.ops.gsa`): K̃_t = α_t ⊙ K̃_{t-1} + (1 - α_t) ⊗ k_t, Ṽ_t likewise, read as ABC
reads, o_t = softmax_M(K̃_t q_t / √D)ᵀ Ṽ_t. τ = 8 (flash-linear-attention's choice) keeps
α ≈ σ(0)^(1/8) ≈ 0.92 at init, when W_g x ≈ 0: long memories to start from. Unlike
flash-linear-attention's GSA layer there is no feature map on q / k and no output norm:
the projections and read are those of memattn's ABC layers.

The state is the M-slot memory, fixed in size; since old tokens fade at each slot's own rate
a stream of any length stays a convex mix of what was written. Padding writes nothing: its
gate is g = 0 (α = 1, write weight 1 - α = 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError
from memattn.layers.abc.common import ABCLayer, ABCMemoryState, check_positive, state_dtype
from memattn.layers.base import Cross, LayerSpec, StateSize, register
from memattn.layers.cross import SlotCrossAttention
from memattn.ops.contract import compute_dtype
from memattn.ops.gsa import GSAState, gated_slot_attention, gsa_memory
from memattn.ops.gsa.recurrent import gsa_step_


@dataclass
class GSAOptions:
    """Options of `gsa`.

    num_slots: M, memory slots per head in self-attention.
    cross_slots: memory slots per head of cross attention (None: num_slots), used by
        models that attend to another sequence (`GSACrossAttention`).
    bias: biases on the q/k/v, output and forget-gate projections.
    gate_logit_normalizer: τ in g = log σ(W_g x) / τ, i.e. α = σ(W_g x)^(1/τ); a larger τ
        puts the gates nearer 1 (longer memories). 8, as flash-linear-attention's GSA.
    read: how a query reads the slots: "softmax" over them, the paper's (the only one).
    """

    num_slots: int = 64
    cross_slots: int | None = None
    bias: bool = False
    gate_logit_normalizer: float = 8.0
    read: Literal["softmax"] = "softmax"

    def __post_init__(self) -> None:
        check_positive("num_slots", self.num_slots)
        if self.cross_slots is None:
            self.cross_slots = self.num_slots
        check_positive("cross_slots", self.cross_slots)
        if not (isinstance(self.gate_logit_normalizer, (int, float))
                and math.isfinite(self.gate_logit_normalizer) and self.gate_logit_normalizer > 0):
            raise ConfigError(f"attention.gate_logit_normalizer: expected a finite number > 0, "
                              f"got {self.gate_logit_normalizer!r}")
        if self.read != "softmax":
            raise ConfigError(f"attention.read: expected softmax, got {self.read!r}")


def forget_gates(gate: nn.Linear, x: torch.Tensor, heads: int, normalizer: float,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, d] -> g [B, T, H, M] = log σ(W_g x) / τ (≤ 0); 0 where mask [B, T] is False
    (α = 1: padding keeps the memory as it is and writes nothing)."""
    B, T, _ = x.shape
    g = F.logsigmoid(gate(x)).view(B, T, heads, -1) / normalizer
    if mask is not None:
        g = g.masked_fill(~mask[:, :, None, None], 0.0)
    return g


class GSACrossAttention(SlotCrossAttention):
    """gsa cross attention: `cross_slots` slots per head written by the source through its
    forget gates, in order; fixed size."""

    def __init__(self, spec: LayerSpec, options: GSAOptions) -> None:
        super().__init__(spec, options)
        self.gate = nn.Linear(spec.d_model, spec.n_heads * options.cross_slots, bias=options.bias)

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> GSAState:
        """src [B, S, d] -> GSAState (k [B, H, M, D], v [B, H, M, D]): the memory after the
        source. Padding (src_mask False) has α = 1 and writes nothing; fp32 for fp16 / bf16."""
        k, v = self.source_kv(src, src_mask)
        g = forget_gates(self.gate, src, self.spec.n_heads, self.options.gate_logit_normalizer,
                         src_mask)
        dt = compute_dtype(src)
        return gsa_memory(k.to(dt), v.to(dt), g.to(dt))


# streams: read at 16x and 64x its training length, 0.8 % and 0.6 % below the same text read in
# windows of it, where softmax loses 88 % (results/long-stream-300)
@register("gsa", options=GSAOptions, streaming=True, state_size=StateSize("num_slots"),
          cross=Cross(GSACrossAttention, "cross_slots slots per head written in source order, each "
                      "keeping α_s = σ(W_g h_s)^(1/τ) of what it holds and taking the rest from token s "
                      "(GSAState)"),
          test_options={"num_slots": 8, "cross_slots": 3})
class GatedSlotAttention(ABCLayer):
    """Gated slot attention: M slots per head that forget at rates α = σ(W_g x)^(1/τ); fixed-size state.

    Forget gates g = log α [B, T, H, M] go to `gated_slot_attention` with q, k, v; the
    state is an ABCMemoryState holding the op's GSAState (k, v [B, H, M, D]).
    """

    def __init__(self, spec: LayerSpec, options: GSAOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        self.gate = nn.Linear(spec.d_model, spec.n_heads * options.num_slots, bias=options.bias)

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """An empty memory: zeros [B, H, M, D] for keys and values."""
        w = self.qkv.weight
        D = self.spec.head_dim
        return ABCMemoryState(GSAState.empty(
            batch_size, self.spec.n_heads, self.options.num_slots, D, D,
            device=device if device is not None else w.device, dtype=state_dtype(dtype, w)))

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], state)."""
        _, q, k, v = self.project(x, memory_state, attention_mask, positions)
        g = forget_gates(self.gate, x, self.spec.n_heads, self.options.gate_logit_normalizer,
                         attention_mask)
        if memory_state is not None and x.shape[1] == 1 and not torch.is_grad_enabled():
            # decoding: the token written into the memory in place, as a KVCache grows
            inner = memory_state.inner
            if not all(t.is_contiguous() for t in inner):
                inner = GSAState(*(t.contiguous() for t in inner))
            o = gsa_step_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], inner)
            memory_state.update(inner, 1)
            return self.finish(o[:, None]), memory_state
        initial = memory_state.inner if memory_state is not None else None
        o, state = gated_slot_attention(q, k, v, g, causal=self.spec.causal, initial_state=initial,
                                        output_final_state=memory_state is not None)
        if memory_state is not None:
            memory_state.update(state, x.shape[1])
        return self.finish(o), memory_state
