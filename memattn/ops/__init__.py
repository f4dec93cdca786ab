"""Pure tensor functions, no parameters. Layout [B, T, H, D] everywhere.

Op signature shared by the mechanisms:
    op(q, k, v, ..., causal, scale=None, initial_state=None, output_final_state=False)
        -> (o, final_state)
"""

from memattn.ops.linear import linear_attention, linear_attention_read, linear_attention_step
from memattn.ops.softmax import softmax_attention

__all__ = ["linear_attention", "linear_attention_read", "linear_attention_step", "softmax_attention"]
