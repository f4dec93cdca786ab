"""memattn: attention over a memory, for PyTorch.

Notation used in every shape comment and docstring of the package:

    B  batch size            T  sequence length (Tq / Tk when queries and keys differ)
    H  attention heads       K  key / query head dim      V  value head dim
    D  a head dim where K = V  d  model width              M  memory slots
    C  chunk length          N  persistent vectors         L  main sequence (GMAT)

Activations are laid out [B, T, H, D]; recurrent states [B, H, K, V] (or [B, H, M, D]).
"""

from memattn.errors import ConfigError, MemattnError, ShapeError

__version__ = "0.1.0"

__all__ = ["ConfigError", "MemattnError", "ShapeError", "__version__"]
