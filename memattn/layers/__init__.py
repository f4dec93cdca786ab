"""Attention layers: projections + a write/read rule + cache I/O, one file a mechanism.

Importing this package imports every module in it, so a mechanism's layer file registers the
mechanism (and its cross attention, where it has one) by being here; `memattn.layers.base`
holds the registry, `memattn.layers.cross` what the cross layers share.
"""

import importlib
import pkgutil

from memattn.layers.base import (AttentionLayer, AttentionState, Cross, KVCache, LayerSpec, Mechanism, StateSize,
                                 attention_layer, build_attention, get_mechanism, mechanisms, register,
                                 unregister)

for _module in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    importlib.import_module(_module.name)  # each layer file registers its mechanisms

__all__ = ["AttentionLayer", "AttentionState", "Cross", "KVCache", "LayerSpec", "Mechanism", "StateSize",
           "attention_layer", "build_attention", "get_mechanism", "mechanisms", "register", "unregister"]
