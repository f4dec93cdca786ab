"""memattn models inside Hugging Face transformers (`pip install "memattn[hf]"`).

Importing this module registers the model type "memattn" with `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` and `AutoModelForMaskedLM`:

    from memattn.integrations.hf import MemattnForCausalLM
    model = MemattnForCausalLM.from_memattn(causal_lm)          # a memattn CausalLM
    model.save_pretrained("out")                                # config.json + model.safetensors
    model = AutoModelForCausalLM.from_pretrained("out")         # after importing this module
    model.generate(ids, attention_mask=mask, num_beams=4)       # greedy, sampling, beams

The classes wrap memattn's own models, so a checkpoint keeps memattn's parameter names under
`model.net.`. `generate` decodes through `MemattnCache`, a transformers `Cache` holding the
model's `ModelCache`: bounded mechanisms keep their fixed-size state, beam search reorders
every layer's state, and left-padded prompts read as each prompt alone (positions count a
row's real tokens). The attention mask transformers passes (over every token so far) is cut
to the new tokens, the convention of every memattn layer.

`tokenizer_of(vocab)` is a memattn vocabulary as a transformers tokenizer with the same ids
(what `memattn export-hf` saves beside the model).

Not supported (refused with an error): `inputs_embeds`, cropping a bounded state (assisted
generation, which `_is_stateful` turns off), and `position_ids` other than the ones memattn
derives from the mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

try:
    from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,
                              GenerationMixin, PreTrainedConfig, PreTrainedModel)
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.modeling_outputs import (BaseModelOutputWithPast, CausalLMOutputWithPast,
                                               MaskedLMOutput)
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("memattn.integrations.hf needs transformers 5: pip install 'memattn[hf]'") from e

from memattn.config import ModelConfig, from_dict, to_dict
from memattn.errors import ConfigError
from memattn.models import CausalLM, Encoder
from memattn.models.lm import ModelCache

MODEL_TYPE = "memattn"
MASK_TOKEN = "<mask>"  # a masked-LM encoder's mask token in its exported tokenizer
PAD_TOKEN = "<pad>"  # the pad token of an exported character vocabulary without an unknown symbol


class MemattnConfig(PreTrainedConfig):
    """A memattn model config for transformers: `memattn` holds memattn's `ModelConfig` as a
    mapping and `architecture` says which model it builds ("causal-lm" or "encoder"); the
    usual transformers names mirror it (vocab_size, hidden_size, ...)."""

    model_type = MODEL_TYPE
    memattn: dict | None = None
    architecture: str = "causal-lm"
    vocab_size: int = 0
    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, *, architecture: str = "causal-lm",
                          **kwargs: Any) -> MemattnConfig:
        """The transformers config of a memattn ModelConfig (kwargs: e.g. eos_token_id)."""
        return cls(memattn=to_dict(cfg), architecture=architecture, vocab_size=cfg.vocab_size,
                   hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                   num_attention_heads=cfg.n_heads, tie_word_embeddings=cfg.tie_embeddings, **kwargs)

    def model_config(self) -> ModelConfig:
        """memattn's ModelConfig, every key and type checked."""
        if not isinstance(self.memattn, dict):
            raise ConfigError("MemattnConfig.memattn: expected memattn's model config as a mapping "
                              "(build the config with MemattnConfig.from_model_config)")
        if self.architecture not in ("causal-lm", "encoder"):
            raise ConfigError(f"MemattnConfig.architecture: expected 'causal-lm' or 'encoder', "
                              f"got {self.architecture!r}")
        return from_dict(ModelConfig, self.memattn, "model")


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


def _new_tokens_mask(attention_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """transformers' mask over every token so far [B, past + T] -> memattn's over the new
    tokens [B, T] bool (None when every new token is real and no row was padded)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ConfigError(f"attention_mask: expected a 2D padding mask [B, T], got shape "
                          f"{tuple(attention_mask.shape)}")
    mask = attention_mask[:, -T:].bool()
    return None if bool(mask.all()) else mask


class MemattnPreTrainedModel(PreTrainedModel):
    config_class = MemattnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # bounded states cannot be cropped: no assisted generation

    def _init_weights(self, module: nn.Module) -> None:
        """memattn's models initialise their own weights when built (model.init_std), and
        `from_pretrained` loads every tensor they hold: nothing to do here."""


class MemattnModel(MemattnPreTrainedModel):
    """The memattn network (`net`: a CausalLM or an Encoder) returning hidden states."""

    def __init__(self, config: MemattnConfig) -> None:
        super().__init__(config)
        cfg = config.model_config()
        self.net = CausalLM(cfg) if config.architecture == "causal-lm" else Encoder(cfg)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.net.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.net.embed = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> BaseModelOutputWithPast:
        if inputs_embeds is not None or input_ids is None:
            raise ConfigError("memattn models read token ids (input_ids); inputs_embeds is not supported")
        B, T = input_ids.shape
        causal = self.config.architecture == "causal-lm"
        use_cache = causal and (use_cache if use_cache is not None else self.config.use_cache) and not self.training
        if use_cache and not isinstance(past_key_values, MemattnCache):
            if past_key_values is not None and past_key_values.get_seq_length() > 0:
                raise ConfigError(f"past_key_values: a {type(past_key_values).__name__} that already holds "
                                  "tokens cannot continue a memattn model; pass a MemattnCache")
            past_key_values = MemattnCache(self.net.init_cache(B, device=input_ids.device))
        elif use_cache and past_key_values.model_cache is None:
            past_key_values.model_cache = self.net.init_cache(B, device=input_ids.device)
        mask = _new_tokens_mask(attention_mask, T)
        cache = past_key_values.model_cache if use_cache else None
        if cache is not None and mask is None and cache.real is not None:
            mask = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # rows were padded before
        hidden = self.net.hidden(input_ids, cache=cache, attention_mask=mask)
        return BaseModelOutputWithPast(last_hidden_state=hidden,
                                       past_key_values=past_key_values if use_cache else None)


class MemattnForCausalLM(MemattnPreTrainedModel, GenerationMixin):
    """A memattn causal LM with transformers' `generate`, `save_pretrained` and Auto classes."""

    _tied_weights_keys = {"model.net.head.weight": "model.net.embed.weight"}

    def __init__(self, config: MemattnConfig) -> None:
        super().__init__(config)
        if config.architecture != "causal-lm":
            raise ConfigError(f"MemattnForCausalLM: the config builds an {config.architecture!r}, "
                              "expected architecture='causal-lm'")
        self.model = MemattnModel(config)
        self.post_init()

    @classmethod
    def from_memattn(cls, net: CausalLM, **config_kwargs: Any) -> MemattnForCausalLM:
        """Wrap a memattn CausalLM (its weights copied, bit for bit)."""
        model = cls(MemattnConfig.from_model_config(net.cfg, **config_kwargs))
        model.model.net.load_state_dict(net.state_dict())
        return model.to(next(net.parameters()).dtype).train(net.training)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.net.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.net.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.net.head

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits of the next token at each position (the last `logits_to_keep` when > 0);
        with labels, the mean cross entropy of predicting labels shifted by one."""
        out = self.model(input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                         use_cache=use_cache, inputs_embeds=inputs_embeds)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.model.net.head(hidden).float()
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


class MemattnForMaskedLM(MemattnPreTrainedModel):
    """A memattn encoder with its masked-LM head."""

    _tied_weights_keys = {"model.net.mlm_head.weight": "model.net.embed.weight"}

    def __init__(self, config: MemattnConfig) -> None:
        super().__init__(config)
        if config.architecture != "encoder":
            raise ConfigError(f"MemattnForMaskedLM: the config builds a {config.architecture!r}, "
                              "expected architecture='encoder'")
        self.model = MemattnModel(config)
        self.post_init()

    @classmethod
    def from_memattn(cls, net: Encoder, **config_kwargs: Any) -> MemattnForMaskedLM:
        """Wrap a memattn Encoder (its weights copied, bit for bit)."""
        model = cls(MemattnConfig.from_model_config(net.cfg, architecture="encoder", **config_kwargs))
        weights = {k: v for k, v in net.state_dict().items() if not k.startswith("tag_head.")}
        model.model.net.load_state_dict(weights)  # a tagging head stays behind
        return model.to(next(net.parameters()).dtype).train(net.training)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.net.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.net.mlm_head

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> MaskedLMOutput:
        """Logits of every position; with labels (-100 = not scored), their cross entropy."""
        out = self.model(input_ids, attention_mask=attention_mask, use_cache=False, inputs_embeds=inputs_embeds)
        logits = self.model.net.mlm_logits(out.last_hidden_state).float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)


def byte_chars() -> list[str]:
    """The character `tokenizers`' ByteLevel pre-tokenizer writes for each byte 0..255 (GPT-2's
    table): printable Latin-1 bytes stand for themselves, the others for U+0100, U+0101, ...
    in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def tokenizer_of(vocab: Any, masked: bool = False) -> Any:
    """A transformers tokenizer with the ids of a memattn vocabulary (characters, bytes, BPE or
    a pretrained tokenizer, `memattn.data`): `tokenizer(text, add_special_tokens=False)`
    gives `vocab.encode(text)`, and `decode` writes the text back. `masked`: with the mask
    token of a masked-LM encoder, MASK_TOKEN at id vocab.size (`memattn.masked`). `memattn
    export-hf` saves it beside the model, so that `AutoTokenizer.from_pretrained` reads the
    folder.

    Prompts are padded on the left for a causal LM (`padding=True` then `generate`), on the
    right for an encoder. The pad token is BPE's `<pad>`, the unknown symbol of a character
    vocabulary that has one, byte 0 of a byte vocabulary, and for a character vocabulary
    without an unknown symbol PAD_TOKEN at the first id past the model's vocabulary (memattn's
    models never read a padded position's id, so any id will do; `decode(...,
    skip_special_tokens=True)` drops it). A pretrained tokenizer keeps its own."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from memattn.data.bpe import SPECIALS, BPEVocab, TokenizerVocab
    from memattn.data.vocab import UNK

    each_char = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    special: dict[str, Any] = {}
    if isinstance(vocab, TokenizerVocab):  # already a tokenizers tokenizer: as it is
        tok = Tokenizer.from_str(vocab.tokenizer_json)
        if isinstance(vocab, BPEVocab):
            special = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), SPECIALS),
                           split_special_tokens=True)  # as BPEVocab: "<s>" in a text is text
    elif vocab.kind == "byte":  # id = byte value, through the ByteLevel table
        chars = byte_chars()
        tok = Tokenizer(models.WordLevel({c: b for b, c in enumerate(chars)}, unk_token=chars[0]))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), each_char])
        tok.decoder = decoders.ByteLevel()
        special["pad_token"] = chars[0]
    else:  # characters: one token each, an unknown one as U+FFFD where the vocabulary has it
        tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(vocab.symbols)}, unk_token=UNK))
        tok.pre_tokenizer = each_char
        tok.decoder = decoders.Fuse()
        if vocab.unk_id is not None:
            special["unk_token"] = special["pad_token"] = UNK
    if masked:
        tok.add_special_tokens([MASK_TOKEN])
        assert tok.token_to_id(MASK_TOKEN) == vocab.size, "the mask token is the id after the vocabulary"
        special["mask_token"] = MASK_TOKEN
    if "pad_token" not in special and not isinstance(vocab, TokenizerVocab):  # characters, no unknown
        tok.add_special_tokens([PAD_TOKEN])
        special["pad_token"] = PAD_TOKEN
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   padding_side="right" if masked else "left", **special)


AutoConfig.register(MODEL_TYPE, MemattnConfig, exist_ok=True)
AutoModel.register(MemattnConfig, MemattnModel, exist_ok=True)
AutoModelForCausalLM.register(MemattnConfig, MemattnForCausalLM, exist_ok=True)
AutoModelForMaskedLM.register(MemattnConfig, MemattnForMaskedLM, exist_ok=True)
