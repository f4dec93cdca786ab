"""Models compose attention layers from the registry; they never name a mechanism."""

from memattn.models.compressor import Compressor
from memattn.models.encoder import Encoder
from memattn.models.lm import CausalLM, ModelCache, Transformer
from memattn.models.seq2seq import EncoderDecoder

__all__ = ["CausalLM", "Compressor", "Encoder", "EncoderDecoder", "ModelCache", "Transformer"]
