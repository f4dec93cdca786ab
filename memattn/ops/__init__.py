"""Pure tensor functions, no parameters. Layout [B, T, H, D] everywhere; states [B, H, ...].

Op signature shared by the mechanisms (memattn.ops.contract):
    op(q, k, v, ..., causal, scale=None, initial_state=None, output_final_state=False,
       backend="auto") -> (o, state)
state: None unless output_final_state, else the op's NamedTuple (ABCState, KVState, ...).
`OP_BACKENDS` says which backends exist for which op (each op declares its own: `public_op`).
"""

from memattn.ops.abc import ABCState, BoundedMemoryState, abc_attention, bounded_memory_attention
from memattn.ops.contract import OP_BACKENDS
from memattn.ops.gmat import gmat_attention
from memattn.ops.gsa import GSAState, gated_slot_attention
from memattn.ops.linear import (LinearAttentionState, linear_attention, linear_attention_read,
                                linear_attention_step)
from memattn.ops.persistent import persistent_attention, persistent_attention_reference
from memattn.ops.softmax import KVState, softmax_attention
from memattn.ops.window import (WindowState, counted_softmax, local_window_attention,
                                local_window_reference)

__all__ = ["OP_BACKENDS", "ABCState", "BoundedMemoryState", "GSAState", "KVState",
           "LinearAttentionState", "WindowState", "abc_attention", "bounded_memory_attention",
           "counted_softmax", "gated_slot_attention", "gmat_attention", "linear_attention",
           "linear_attention_read", "linear_attention_step", "local_window_attention",
           "local_window_reference", "persistent_attention", "persistent_attention_reference",
           "softmax_attention"]
