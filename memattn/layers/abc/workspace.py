"""abc-workspace: ABC with shared-workspace (Luna-style) control, for encoders.

Slot m's logit for token i is k_i · P_m / √D, P the key memory the previous layer wrote (the
first layer reads a learned `Workspace`), normalised over the sequence as in abc-mlp. The
layers of one forward pass hand their memories on through the model's `layer_outputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memattn.errors import ConfigError, ShapeError
from memattn.layers.abc.common import PAD_LOGIT, ABCLayer, check_positive
from memattn.layers.base import LayerSpec, StateSize, register
from memattn.ops.abc import abc_attention


@dataclass
class ABCWorkspaceOptions:
    """Options of `abc-workspace`.

    num_slots: M, memory slots per head (the size of the shared workspace).
    bias: biases on the q/k/v and output projections.
    """

    num_slots: int = 32
    bias: bool = False

    def __post_init__(self) -> None:
        check_positive("num_slots", self.num_slots)


class Workspace(nn.Module):
    """The workspace the abc-workspace layers of one model share (through spec.shared).

    initial [H, M, D]: the learned workspace the first layer reads (N(0, 1) init). What a
    layer passes to the next travels in the forward pass's `layer_outputs`, not here.
    """

    def __init__(self, heads: int, slots: int, head_dim: int) -> None:
        super().__init__()
        self.initial = nn.Parameter(torch.randn(heads, slots, head_dim))


@register("abc-workspace", options=ABCWorkspaceOptions, causal=False, reads_layer_outputs=True,
          convertible=False, state_size=StateSize("num_slots"), test_options={"num_slots": 4})
class ABCWorkspaceAttention(ABCLayer):
    """ABC with shared-workspace (Luna-style) control: φ from the previous layer's memory.

    Slot m's logit for token i is s_im = k_i · P_m / √D, P [B, H, M, D] the key memory K̃
    the previous layer wrote (the first layer reads a learned P), normalised over the
    sequence like ABC_MLP (φ_i = exp(s_i) / Σ_j exp(s_j) per slot), so each slot is the
    average of the tokens that match it. Bidirectional only: the memory a layer passes on
    is that of the whole sequence. Layers run in order within one forward pass; padding
    (attention_mask False) writes nothing.
    """

    def __init__(self, spec: LayerSpec, options: ABCWorkspaceOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        key = f"abc-workspace.{options.num_slots}"
        if key not in spec.shared:
            spec.shared[key] = Workspace(spec.n_heads, options.num_slots, spec.head_dim)
        self.workspace = spec.shared[key]

    def init_state(self, batch_size: int, device=None, dtype=None):
        raise ConfigError("attention: 'abc-workspace' is bidirectional only and has no "
                          "decoding state")

    def forward(self, x: torch.Tensor, *, memory_state=None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                layer_outputs: dict[int, torch.Tensor] | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], None).

        layer_outputs: {layer_idx: key memory K̃ [B, H, M, D]} of one forward pass; this layer
        reads entry layer_idx - 1 (absent: the learned initial workspace) and writes its own.
        Keyed by layer, so a layer recomputed later (activation checkpointing) reads the same
        value as the first time.
        """
        _, q, k, v = self.project(x, attention_mask=attention_mask, positions=positions)
        B, T, _ = x.shape
        prev = (layer_outputs or {}).get(self.spec.layer_idx - 1)
        if prev is None:  # the first layer (or a layer used on its own)
            prev = self.workspace.initial.expand(B, -1, -1, -1)
        elif prev.shape[0] != B:
            raise ShapeError(f"x: batch of {B} after a workspace written for a batch of "
                             f"{prev.shape[0]}; the layers of one forward pass share its batch")
        s = torch.einsum("bthd,bhmd->bthm", k, prev.to(k.dtype)) * self.spec.head_dim ** -0.5
        if attention_mask is not None:
            s = s.masked_fill(~attention_mask[:, :, None, None], PAD_LOGIT)
        o, state = abc_attention(q, k, v, s, causal=False, output_final_state=True)
        if layer_outputs is not None:
            layer_outputs[self.spec.layer_idx] = state.k.to(k.dtype)
        return self.finish(o), None
