"""memattn: attention over a memory, for PyTorch.

Notation used in every shape comment and docstring of the package:

    B  batch size            T  sequence length (Tq / Tk when queries and keys differ)
    H  attention heads       K  key / query head dim      V  value head dim
    D  a head dim where K = V  d  model width              M  memory slots
    C  chunk length          N  persistent vectors         L  main sequence (GMAT)

Activations are laid out [B, T, H, D]; the ops' states [B, H, ...] (e.g. [B, H, K, V],
[B, H, M, D], or [B, H, T, D] for keys and values).
"""

import importlib

from memattn.errors import ConfigError, MemattnError, ShapeError

__version__ = "0.1.0"

# The entry points, by the module that defines them: imported on first use, so that
# `import memattn` stays light and needs no optional extra (`convert`: memattn[hf]).
ENTRY_POINTS = {
    "attention_layer": "memattn.layers",
    "AttentionConfig": "memattn.config", "ModelConfig": "memattn.config",
    "CausalLM": "memattn.models", "Encoder": "memattn.models", "EncoderDecoder": "memattn.models",
    "convert": "memattn.integrations.convert",
}

__all__ = ["ConfigError", "MemattnError", "ShapeError", "__version__", *ENTRY_POINTS]


def __getattr__(name: str):
    if name in ENTRY_POINTS:
        return getattr(importlib.import_module(ENTRY_POINTS[name]), name)
    raise AttributeError(f"module 'memattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *ENTRY_POINTS})
