"""Pure tensor functions, no parameters. Layout [B, T, H, D] everywhere.

Op signature shared by the mechanisms:
    op(q, k, v, ..., causal, scale=None, initial_state=None, output_final_state=False)
        -> (o, final_state)
"""

from memattn.ops.abc import abc_attention, bounded_memory_attention
from memattn.ops.gmat import gmat_attention
from memattn.ops.gsa import gated_slot_attention
from memattn.ops.linear import linear_attention, linear_attention_read, linear_attention_step
from memattn.ops.persistent import persistent_attention, persistent_attention_reference
from memattn.ops.softmax import softmax_attention
from memattn.ops.window import counted_softmax, local_window_attention, local_window_reference

__all__ = ["abc_attention", "bounded_memory_attention", "counted_softmax", "gated_slot_attention",
           "gmat_attention", "linear_attention", "linear_attention_read", "linear_attention_step",
           "local_window_attention", "local_window_reference", "persistent_attention",
           "persistent_attention_reference", "softmax_attention"]
