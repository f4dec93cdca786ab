"""Attention layers: projections + a write/read rule + cache I/O, one file a mechanism.

Importing this package registers every built-in mechanism.
"""

from memattn.layers import abc  # noqa: F401  (registers the "abc-*" mechanisms and "gsa")
from memattn.layers import gmat  # noqa: F401  (registers "gmat")
from memattn.layers import linear  # noqa: F401  (registers "linear" and "gated-linear")
from memattn.layers import persistent  # noqa: F401  (registers "persistent")
from memattn.layers import softmax  # noqa: F401  (registers "softmax")
from memattn.layers import cross  # noqa: F401  (registers the cross attention of softmax and abc-mlp)
from memattn.layers.base import (AttentionLayer, AttentionState, KVCache, LayerSpec, Mechanism,
                                 attention_layer, build_attention, get_mechanism, mechanisms, register)

__all__ = ["AttentionLayer", "AttentionState", "KVCache", "LayerSpec", "Mechanism", "attention_layer",
           "build_attention", "get_mechanism", "mechanisms", "register"]
