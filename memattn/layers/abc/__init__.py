"""ABC layers: attention with bounded-memory control (Peng et al. 2022), one control strategy each.

Every layer here keeps a memory of M slots per head, written by control weights φ_i [M]
and read by a softmax over the slots (the ops in `memattn.ops.abc`):

    K̃_t = Σ_{i≤t} φ_i ⊗ k_i   [M, K]      Ṽ_t = Σ_{i≤t} φ_i ⊗ v_i   [M, V]
    o_t = softmax_M(K̃_t q_t / √K)ᵀ Ṽ_t

The strategies differ only in the write rule, i.e. how φ is chosen; each lives in one file:

    mlp.py        abc-mlp         φ from the input: α = act(W_φ x) [H, M] per token, normalised
                                  per slot over the prefix (causal) or the sequence (bidirectional).
    window.py     abc-window      a FIFO queue of the last n tokens (the paper's shift-matrix
                                  control): the memory is exactly those n keys / values, so it is
                                  computed as softmax attention over a window of n tokens
                                  (`memattn.ops.window`); decoding keeps an n-slot ring buffer.
                  abc-dilated     two FIFO queues: the last n tokens and the last n tokens at
                                  positions 0, d, 2d, ...
    given.py      abc-linformer   learned per-position columns φ_t = softplus(W^LF[t]) [M],
                                  W^LF [max_len, M]; causal through the recurrence.
                  abc-random      φ_t = e_{i_t}, i_t a fixed pseudo-random slot (a hash of
                                  position and head).
                  abc-meanpool    φ_t = e_{⌊t/c⌋} / c: slot j holds the mean of tokens jc .. jc+c-1.
                  abc-l2g         local-to-global: φ_t = e_{t/c} for the global tokens
                                  t = 0, c, 2c, ..., else 0.
    workspace.py  abc-workspace   bidirectional, Luna-style: slot logits k_i · P_m from the previous
                                  layer's memory P.
    cluster.py    abc-cluster     keys grouped into n clusters (k-means over the sequence; causal:
                                  online k-means centres); slot j holds the mean of the keys /
                                  values of cluster j.
    gated.py      gsa             gated slot attention (Zhang et al. 2024): no φ to normalise;
                                  each slot forgets at a rate α = σ(W_g x)^(1/τ) [H, M] and takes
                                  the rest from the token, K̃_t = α_t ⊙ K̃_{t-1} + (1 - α_t) ⊗ k_t
                                  (`memattn.ops.gsa`).

    common.py     what they share: the layer base `ABCLayer`, the decoding state
                  `ABCMemoryState`, PAD_LOGIT.

The causal ones decode with a fixed-size state (`fixed_size = True`): the M-slot memory, or
the n-slot ring buffers of the queues, never the prefix. Rotary positions (spec.positions == "rotary")
rotate q and k at their absolute positions before anything is written, as in `softmax`.

Layout: x [B, T, d] -> y [B, T, d]; q, k, v [B, T, H, D]; φ and slot logits [B, T, H, M].
attention_mask [B, T] bool (True = real token): padding writes nothing (φ = 0, or a slot
logit of PAD_LOGIT for abc-mlp, a forget gate α = 1 for gsa; abc-window / abc-dilated mask
padding keys out).

Importing this package registers every "abc-*" mechanism and "gsa".
"""

from memattn.layers.abc.cluster import ABCClusterAttention, ABCClusterOptions
from memattn.layers.abc.common import PAD_LOGIT, ABCLayer, ABCMemoryState
from memattn.layers.abc.gated import GatedSlotAttention, GSAOptions, forget_gates
from memattn.layers.abc.given import (
    ABCL2GAttention,
    ABCL2GOptions,
    ABCLinformerAttention,
    ABCLinformerOptions,
    ABCMeanPoolAttention,
    ABCMeanPoolOptions,
    ABCRandomAttention,
    ABCRandomOptions,
    GivenPhiLayer,
    random_slots,
)
from memattn.layers.abc.mlp import RELU_FLOOR, ABCMLPAttention, ABCMLPOptions, activation_logits, reset_phi
from memattn.layers.abc.window import (
    ABCDilatedAttention,
    ABCDilatedOptions,
    ABCWindowAttention,
    ABCWindowOptions,
    QueueState,
    RingBufferState,
)
from memattn.layers.abc.workspace import ABCWorkspaceAttention, ABCWorkspaceOptions, Workspace

__all__ = [
    "PAD_LOGIT",
    "RELU_FLOOR",
    "ABCClusterAttention",
    "ABCClusterOptions",
    "ABCDilatedAttention",
    "ABCDilatedOptions",
    "ABCL2GAttention",
    "ABCL2GOptions",
    "ABCLayer",
    "ABCLinformerAttention",
    "ABCLinformerOptions",
    "ABCMLPAttention",
    "ABCMLPOptions",
    "ABCMeanPoolAttention",
    "ABCMeanPoolOptions",
    "ABCMemoryState",
    "ABCRandomAttention",
    "ABCRandomOptions",
    "ABCWindowAttention",
    "ABCWindowOptions",
    "ABCWorkspaceAttention",
    "ABCWorkspaceOptions",
    "GSAOptions",
    "GatedSlotAttention",
    "GivenPhiLayer",
    "QueueState",
    "RingBufferState",
    "Workspace",
    "activation_logits",
    "forget_gates",
    "random_slots",
    "reset_phi",
]
