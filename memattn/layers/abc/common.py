"""What the ABC layers share: the layer base, the slot-memory decoding state, option checks.

`ABCLayer` is the base of every abc-* layer: the projections of `AttentionLayer` plus the
slot-logit memory of ABC_MLP (`abc_attention`), which abc-mlp, abc-cluster (causal) and
abc-workspace write with their own slot logits. `ABCMemoryState` wraps the op's state with
the tokens seen, for the strategies that decode with a slot memory.
"""

from __future__ import annotations

import torch

from memattn.errors import ConfigError
from memattn.layers.base import AttentionLayer, AttentionState, LayerSpec
from memattn.ops.abc import ABCState, BoundedMemoryState, abc_attention
from memattn.ops.abc.recurrent import memory_step_

# Slot logit given to padding: exp(PAD_LOGIT - s) underflows to exactly 0 next to a real
# token's logit s > -9000 (abc-mlp's relu / sigmoid give s ≥ log(RELU_FLOOR) ≈ -27.6), and
# the op handles logits of ±1e4 without overflow, unlike -inf on a prefix with no real token.
PAD_LOGIT = -1e4


def state_dtype(dtype: torch.dtype | None, weight: torch.Tensor) -> torch.dtype:
    """The ops keep states in float32, float64 for float64 models."""
    return torch.float64 if (dtype or weight.dtype) == torch.float64 else torch.float32


def check_positive(name: str, value: int) -> None:
    """ConfigError naming attention.`name` unless `value` is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"attention.{name}: expected a positive integer, got {value!r}")


class ABCMemoryState(AttentionState):
    """Fixed-size decoding state of an ABC layer: the op's state and the tokens seen.

    inner: an ABCState (log_z [B, H, M], k [B, H, M, K], v [B, H, M, V]) for abc-mlp, a
    BoundedMemoryState (k [B, H, M, K], v [B, H, M, V]) for the given-φ strategies, a
    GSAState (k [B, H, M, K], v [B, H, M, V]) for gsa.
    """

    fixed_size = True

    def __init__(self, inner: ABCState | BoundedMemoryState) -> None:
        self.inner = inner
        self.seen = 0

    def update(self, inner: ABCState | BoundedMemoryState, steps: int) -> None:
        self.inner = inner
        self.seen += steps

    def tensors(self) -> list[torch.Tensor]:
        return list(self.inner)

    def map_tensors(self, fn) -> None:
        self.inner = type(self.inner)(*(fn(t, True) for t in self.inner))


class ABCLayer(AttentionLayer):
    """The ABC layers: the shared projections plus the slot-logit memory and its read."""

    def __init__(self, spec: LayerSpec, bias: bool) -> None:
        super().__init__(spec, bias=bias)

    def empty_abc_state(self, batch_size: int, slots: int, device=None,
                        dtype=None) -> ABCMemoryState:
        """An empty slot-logit memory: log_z = -inf [B, H, M], zeros [B, H, M, D]."""
        w = self.qkv.weight
        D = self.spec.head_dim
        return ABCMemoryState(ABCState.empty(
            batch_size, self.spec.n_heads, slots, D, D,
            device=device if device is not None else w.device, dtype=state_dtype(dtype, w)))

    def step_in_place(self, memory_state: ABCMemoryState | None, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """Decoding without autograd: one token (q, k, v [B, 1, H, D], w [B, 1, H, M] its slot
        logits or φ) written into the slot memory in place, as a KVCache grows, and read ->
        y [B, 1, d]; None when this call is not such a step."""
        if memory_state is None or q.shape[1] != 1 or torch.is_grad_enabled():
            return None
        inner = memory_state.inner
        if not all(t.is_contiguous() for t in inner):
            inner = type(inner)(*(t.contiguous() for t in inner))
        o = memory_step_(q[:, 0], k[:, 0], v[:, 0], w[:, 0], inner)
        memory_state.update(inner, 1)
        return self.finish(o[:, None])

    def attend_logits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
                      memory_state: ABCMemoryState | None,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
        """`abc_attention` with slot logits s [B, T, H, M]; padding writes nothing -> y [B, T, d]."""
        if attention_mask is not None:
            s = s.masked_fill(~attention_mask[:, :, None, None], PAD_LOGIT)
        y = self.step_in_place(memory_state, q, k, v, s)
        if y is not None:
            return y
        initial = memory_state.inner if memory_state is not None else None
        o, state = abc_attention(q, k, v, s, causal=self.spec.causal, initial_state=initial,
                                 output_final_state=memory_state is not None)
        if memory_state is not None:
            memory_state.update(state, q.shape[1])
        return self.finish(o)
