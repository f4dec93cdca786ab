"""Models compose attention layers from the registry; they never name a mechanism."""

from memattn.models.compressor import Compressor
from memattn.models.encoder import Encoder
from memattn.models.lm import CausalLM, ModelCache, Transformer

__all__ = ["CausalLM", "Compressor", "Encoder", "ModelCache", "Transformer"]
