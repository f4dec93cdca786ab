"""What a transformers model of memattn's keeps between generate steps, shared by the exported
(memattn.integrations.hf) and the converted (memattn.integrations.convert) models: a cache
whose layers hold no keys and values (each memattn layer keeps its own state), and the
refusal of preallocated caches; PEFT told of each model type's LoRA targets."""

from __future__ import annotations

import sys

import torch
from torch import nn

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("memattn.integrations needs transformers 5: pip install 'memattn[hf]'") from e

from memattn.errors import ConfigError
from memattn.models.lm import ModelCache

STATIC_CACHE = ("a static (preallocated key/value) cache cannot hold a memattn layer's state: each layer "
                "keeps its own, of a fixed size for the bounded mechanisms already; generate without "
                "cache_implementation (the default cache is memattn's own)")


class StatefulLayer(CacheLayerMixin):
    """A layer of a transformers cache that holds no keys and values: a memattn layer writes
    its own state. Subclasses say how many tokens were seen (`get_seq_length`)."""

    is_compileable = False
    is_croppable = False

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("a memattn layer writes its own state, not keys and values")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class _Position(StatefulLayer):
    """One layer's entry in a MemattnCache: transformers asks layers how many tokens were seen;
    the states themselves live in the cache's ModelCache."""

    def __init__(self, cache: MemattnCache) -> None:
        super().__init__()
        self.cache = cache

    def get_seq_length(self) -> int:
        return self.cache.model_cache.position if self.cache.model_cache is not None else 0

    # The cache reorders, selects and resets its ModelCache once for all layers.
    def reorder_cache(self, beam_idx) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices) -> None:
        pass

    def reset(self) -> None:
        pass


class MemattnCache(Cache):
    """A transformers Cache over memattn's ModelCache (one state per layer, each mechanism's own)."""

    def __init__(self, model_cache: ModelCache | None = None, n_layers: int | None = None) -> None:
        n = len(model_cache.states) if model_cache is not None else n_layers
        if n is None:
            raise ConfigError("MemattnCache: give the model cache or the number of layers")
        self.model_cache = model_cache
        super().__init__(layers=[_Position(self) for _ in range(n)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.model_cache.position if self.model_cache is not None else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.model_cache is not None:
            self.model_cache.reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.model_cache is not None:
            self.model_cache.batch_select(torch.as_tensor(indices).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.model_cache is not None:
            self.model_cache.repeat_interleave(repeats)

    def crop(self, max_length: int) -> None:
        if self.model_cache is not None:
            position = self.model_cache.position
            self.model_cache.crop(max_length if max_length >= 0 else position + max_length)

    def reset(self) -> None:
        self.model_cache = None

    def nbytes(self) -> int:
        """Bytes held by every layer's state now."""
        return self.model_cache.nbytes() if self.model_cache is not None else 0


def tell_peft(model_type: str, targets: list[str]) -> None:
    """Give PEFT's LoRA the default target modules of `model_type`, when peft is imported (it
    looks them up by model type; memattn does not import peft for it)."""
    constants = sys.modules.get("peft.utils.constants")
    if constants is not None:
        constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault(model_type, list(targets))


def refuse_static_cache(model: nn.Module, kwargs: dict) -> None:
    """ConfigError when generate is asked for a preallocated key/value cache (STATIC_CACHE)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    wanted = kwargs.get("cache_implementation") or getattr(config, "cache_implementation", None)
    if wanted not in (None, "dynamic"):
        raise ConfigError(f"cache_implementation={wanted!r}: {STATIC_CACHE}")
    if getattr(kwargs.get("past_key_values"), "is_compileable", False):
        raise ConfigError(f"past_key_values: {STATIC_CACHE}")
