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

Also there, as transformers' own models have them: `output_hidden_states` (the embeddings,
then each block's output, the last after the final norm), `resize_token_embeddings`,
`gradient_checkpointing_enable()` (each block recomputed in the backward pass: the same
gradients), PEFT's LoRA with its default target modules (the q/k/v projection `qkv` of every
layer; registered with peft when the model is built or this module imported, whichever finds
peft imported).

A folder these classes save (`save_pretrained`, `memattn export-hf`) says what it is
(`memattn.integrations.folders`): model_type "memattn", `auto_map` and a copy of
`modeling_memattn.py` for `trust_remote_code=True`, a model card; `memattn export-hf` adds
the context length trained at (`max_position_embeddings`, the tokenizer's
`model_max_length`) and a bos/eos token, the document separator: an id past the vocabulary
that the model reads as `separator_token_id`, the text that joined documents in training
("\n"), so that lm-evaluation-harness has a prefix token and `generate` never emits it.

Importing this module also registers the folders `memattn convert` writes
(`memattn.integrations.convert`: "memattn-llama", "memattn-gpt2", ...).

Not supported (refused with an error): `inputs_embeds`; cropping a bounded state (assisted
generation, which `_is_stateful` turns off); a static or other preallocated key/value cache
(`cache_implementation="static"`): a memattn layer keeps its own state, of a fixed size for
the bounded mechanisms already, which no key/value buffer can hold; and `position_ids` other
than the ones memattn derives from the mask (each token placed by counting its row's real
tokens), which are accepted as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,
                              GenerationMixin, PreTrainedConfig, PreTrainedModel)
    from transformers.cache_utils import Cache
    from transformers.modeling_outputs import (BaseModelOutputWithPast, CausalLMOutputWithPast,
                                               MaskedLMOutput)
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("memattn.integrations.hf needs transformers 5: pip install 'memattn[hf]'") from e

from memattn.config import ModelConfig, from_dict, to_dict
from memattn.errors import ConfigError
from memattn.integrations.folders import FORMAT, check_format, config_file, write_card, write_remote_code
from memattn.integrations.hf_cache import STATIC_CACHE, MemattnCache, refuse_static_cache, tell_peft
from memattn.models import CausalLM, Encoder
from memattn.models.lm import ModelCache

MODEL_TYPE = "memattn"
MASK_TOKEN = "<mask>"  # a masked-LM encoder's mask token in its exported tokenizer
PAD_TOKEN = "<pad>"  # the pad token of an exported character vocabulary without an unknown symbol
# bos/eos of an exported causal LM: a token past the vocabulary that the model reads as the
# document separator (`separator_token_id`), so that it is never generated
DOC_TOKEN = "<|endoftext|>"
SEPARATORS = ("\n", " ")  # what joined documents in training: "\n", or " " where no newline was seen
LORA_TARGETS = ["qkv"]  # PEFT LoRA's default target modules: every attention layer's q/k/v projection
class MemattnConfig(PreTrainedConfig):
    """A memattn model config for transformers: `memattn` holds memattn's `ModelConfig` as a
    mapping and `architecture` says which model it builds ("causal-lm" or "encoder"); the
    usual transformers names mirror it (vocab_size, hidden_size, ...)."""

    model_type = MODEL_TYPE
    memattn: dict | None = None
    architecture: str = "causal-lm"
    memattn_format: int | None = None
    # the context length the model was trained at (what lm-evaluation-harness reads windows of)
    max_position_embeddings: int | None = None
    # the id bos/eos stand for when they lie past the vocabulary (the document separator)
    separator_token_id: int | None = None
    vocab_size: int = 0
    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        check_format(self.memattn_format, config_file(self))

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, *, architecture: str = "causal-lm",
                          **kwargs: Any) -> MemattnConfig:
        """The transformers config of a memattn ModelConfig (kwargs: e.g. eos_token_id)."""
        return cls(memattn=to_dict(cfg), architecture=architecture, vocab_size=cfg.vocab_size,
                   hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, memattn_format=FORMAT,
                   num_attention_heads=cfg.n_heads, tie_word_embeddings=cfg.tie_embeddings, **kwargs)

    def model_config(self) -> ModelConfig:
        """memattn's ModelConfig, every key and type checked (ConfigError naming the file)."""
        where = config_file(self)
        if not isinstance(self.memattn, dict):
            raise ConfigError(f"{where}: 'memattn' should hold memattn's model config as a mapping "
                              "(build the config with MemattnConfig.from_model_config)")
        if self.architecture not in ("causal-lm", "encoder"):
            raise ConfigError(f"{where}: architecture: expected 'causal-lm' or 'encoder', "
                              f"got {self.architecture!r}")
        try:
            cfg = from_dict(ModelConfig, self.memattn, "memattn")
        except (ConfigError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
        if cfg.vocab_size != self.vocab_size:
            raise ConfigError(f"{where}: vocab_size {self.vocab_size} differs from memattn.vocab_size "
                              f"{cfg.vocab_size}")
        return cfg


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
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]  # a block's attention keeps its state with it

    def __init__(self, config: MemattnConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        tell_peft(MODEL_TYPE, LORA_TARGETS)

    def _init_weights(self, module: nn.Module) -> None:
        """memattn's models initialise their own weights when built (model.init_std), and
        `from_pretrained` loads every tensor they hold: nothing to do here."""

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any) -> None:
        """transformers' save_pretrained, then what makes the folder say what it is: auto_map
        and `modeling_memattn.py` (trust_remote_code=True), memattn_format, a model card."""
        self._auto_class = None  # memattn writes its own auto_map (not a copy of this module)
        self.config._auto_class = None
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            auto_map = {"AutoConfig": "MemattnConfig", "AutoModel": "MemattnModel"}
            if not isinstance(self, MemattnModel):
                auto_map[_head_auto(self.config)] = type(self).__name__
            write_remote_code(save_directory, auto_map)
            if not (Path(save_directory) / "README.md").exists():
                write_card(save_directory, card_facts(self))


def _head_auto(config: MemattnConfig) -> str:
    return "AutoModelForCausalLM" if config.architecture == "causal-lm" else "AutoModelForMaskedLM"


def card_facts(model: MemattnPreTrainedModel) -> dict[str, Any]:
    """What a model card can say of a model by itself (`memattn export-hf` adds the run's data,
    steps and scores)."""
    net = model.net if isinstance(model, MemattnModel) else model.model.net
    cfg = net.cfg
    causal = model.config.architecture == "causal-lm"
    facts: dict[str, Any] = {
        "title": f"memattn {cfg.attention.name} {'causal LM' if causal else 'masked-LM encoder'}",
        "what": (f"A memattn {'causal language model' if causal else 'masked-LM encoder'}: {cfg.n_layers} "
                 f"layers, width {cfg.d_model}, {cfg.n_heads} heads, {cfg.positions} positions, a vocabulary "
                 f"of {cfg.vocab_size}, {sum(p.numel() for p in model.parameters()):,} parameters; its "
                 f"attention is memattn's {cfg.attention.name!r} mechanism"
                 + (", with " + ", ".join(f"{a.name!r} in layer {i}" for i, a in cfg.attention_layers.items())
                    if cfg.attention_layers else "") + "."),
        "mechanism": cfg.attention.name, "options": cfg.attention.options,
        "context_length": model.config.max_position_embeddings,
        "load": "AutoModel" if isinstance(model, MemattnModel) else _head_auto(model.config)}
    if causal:
        facts["state"] = state_bytes(net)
    return facts


def state_bytes(net: CausalLM) -> tuple[int, float]:
    """(fixed bytes, bytes per token) of a CausalLM's decoding state, batch of one, fp32."""
    n = max(2, min(64, net.cfg.max_len // 2))
    sizes = []
    for length in (n // 2, n):
        cache = net.init_cache(1)
        with torch.no_grad():
            net.hidden(torch.zeros(1, length, dtype=torch.long, device=net.embed.weight.device), cache=cache)
        sizes.append(cache.nbytes())
    per_token = (sizes[1] - sizes[0]) / (n - n // 2)
    return int(sizes[0] - per_token * (n // 2)), per_token


def _check_position_ids(position_ids: torch.Tensor, mask: torch.Tensor | None, cache: ModelCache | None,
                        B: int, T: int) -> None:
    """position_ids [B, T] are accepted when they are memattn's own (each real token placed by
    counting its row's real tokens); ConfigError otherwise."""
    if position_ids.shape[-1] != T or position_ids.numel() not in (T, B * T):
        raise ConfigError(f"position_ids: expected shape [B, T] = {[B, T]}, got {list(position_ids.shape)}")
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=position_ids.device)
    if cache is None:
        before = torch.zeros(B, dtype=torch.long, device=real.device)
    elif cache.real is not None:
        before = cache.real.to(real.device)
    else:
        before = torch.full((B,), cache.position, dtype=torch.long, device=real.device)
    own = before[:, None] + real.long().cumsum(-1) - 1
    given = position_ids.to(real.device).reshape(-1, T).expand(B, T)
    if not bool((given == own)[real].all()):
        raise ConfigError("position_ids: memattn places each token by counting its row's real tokens (left "
                          "padding reads as the row alone) and cannot take other positions (packed "
                          "sequences, offsets); pass none, or the ones attention_mask gives")


class MemattnModel(MemattnPreTrainedModel):
    """The memattn network (`net`: a CausalLM or an Encoder) returning hidden states."""

    def __init__(self, config: MemattnConfig) -> None:
        super().__init__(config)
        cfg = config.model_config()
        self.net = CausalLM(cfg) if config.architecture == "causal-lm" else Encoder(cfg)
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable()
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.net.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.net.embed = value

    def _read_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """bos/eos past the vocabulary read as the document separator they stand for."""
        sep, V = self.config.separator_token_id, self.net.cfg.vocab_size
        for special in {self.config.bos_token_id, self.config.eos_token_id}:
            if sep is not None and isinstance(special, int) and special >= V:
                input_ids = input_ids.masked_fill(input_ids == special, sep)
        return input_ids

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, output_hidden_states: bool | None = None,
                **kwargs: Any) -> BaseModelOutputWithPast:
        if inputs_embeds is not None or input_ids is None:
            raise ConfigError("memattn models read token ids (input_ids); inputs_embeds is not supported")
        if getattr(past_key_values, "is_compileable", False):
            raise ConfigError(f"past_key_values: {STATIC_CACHE}")
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
        if kwargs.get("position_ids") is not None:
            _check_position_ids(kwargs["position_ids"], mask, cache, B, T)
        if cache is not None and mask is None and cache.real is not None:
            mask = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # rows were padded before
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        layer_inputs: list | None = [] if output_hidden_states else None
        run_block = None
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            run_block = self._gradient_checkpointing_func
        hidden = self.net.hidden(self._read_ids(input_ids), cache=cache, attention_mask=mask,
                                 layer_inputs=layer_inputs, run_block=run_block)
        return BaseModelOutputWithPast(last_hidden_state=hidden,
                                       past_key_values=past_key_values if use_cache else None,
                                       hidden_states=(*layer_inputs, hidden) if layer_inputs is not None
                                       else None)


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

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.net.head = value

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """transformers' resize, with memattn's own config told the new vocabulary size."""
        embed = super().resize_token_embeddings(*args, **kwargs)
        _resized(self, embed.num_embeddings)
        return embed

    def generate(self, *args: Any, **kwargs: Any):
        refuse_static_cache(self, kwargs)
        return super().generate(*args, **kwargs)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, output_hidden_states: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits of the next token at each position (the last `logits_to_keep` when > 0);
        with labels, the mean cross entropy of predicting labels shifted by one."""
        out = self.model(input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                         use_cache=use_cache, inputs_embeds=inputs_embeds,
                         output_hidden_states=output_hidden_states, position_ids=kwargs.pop("position_ids", None))
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.model.net.head(hidden).float()
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)


def _resized(model: MemattnPreTrainedModel, size: int) -> None:
    """After resize_token_embeddings: memattn's config (in memory and in the saved config) holds
    the new vocabulary size, so that the folder builds the model it holds."""
    import dataclasses

    net = model.model.net
    net.cfg = dataclasses.replace(net.cfg, vocab_size=size)
    model.config.memattn = to_dict(net.cfg)
    model.config.vocab_size = size


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

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.net.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.net.mlm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.net.mlm_head = value

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """transformers' resize, with memattn's own config told the new vocabulary size."""
        embed = super().resize_token_embeddings(*args, **kwargs)
        _resized(self, embed.num_embeddings)
        return embed

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                output_hidden_states: bool | None = None, **kwargs: Any) -> MaskedLMOutput:
        """Logits of every position; with labels (-100 = not scored), their cross entropy."""
        out = self.model(input_ids, attention_mask=attention_mask, use_cache=False, inputs_embeds=inputs_embeds,
                         output_hidden_states=output_hidden_states, position_ids=kwargs.get("position_ids"))
        logits = self.model.net.mlm_logits(out.last_hidden_state).float()
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


def byte_chars() -> list[str]:
    """The character `tokenizers`' ByteLevel pre-tokenizer writes for each byte 0..255 (GPT-2's
    table): printable Latin-1 bytes stand for themselves, the others for U+0100, U+0101, ...
    in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def separator_of(vocab: Any) -> int | None:
    """The id of the text that joined documents in memattn's corpora ("\\n"; " " for a vocabulary
    without a newline, e.g. text8's), where it is one known token; else None."""
    for text in SEPARATORS:
        try:
            ids = vocab.encode(text).tolist()
        except (ValueError, KeyError):
            continue
        if len(ids) == 1 and ids[0] != getattr(vocab, "unk_id", None):
            return int(ids[0])
    return None


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
    skip_special_tokens=True)` drops it). A pretrained tokenizer keeps its own.

    A causal LM's tokenizer has a bos/eos token, DOC_TOKEN, at the first free id past the
    vocabulary (and pad), where the vocabulary has a document separator (`separator_of`):
    the exported model reads it as that separator (`MemattnConfig.separator_token_id`), so
    clients that start from bos (lm-evaluation-harness) read what the model saw between two
    documents, and no text ever decodes to it."""
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
    if not masked and separator_of(vocab) is not None:
        tok.add_special_tokens([DOC_TOKEN])
        special["bos_token"] = special["eos_token"] = DOC_TOKEN
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   padding_side="right" if masked else "left", **special)


def folder_class(name: str) -> type:
    """The class a folder's auto_map names (`modeling_memattn.py` looks them up here): memattn's
    own models, or a converted family's (`memattn.integrations.convert`)."""
    own = {c.__name__: c for c in (MemattnConfig, MemattnModel, MemattnForCausalLM, MemattnForMaskedLM)}
    if name in own:
        return own[name]
    from memattn.integrations.convert import CONVERTED_CLASSES

    if name in CONVERTED_CLASSES:
        return CONVERTED_CLASSES[name]
    raise AttributeError(f"memattn has no class {name!r} for a model folder; the folder's auto_map "
                         "comes from another version of memattn")


AutoConfig.register(MODEL_TYPE, MemattnConfig, exist_ok=True)
AutoModel.register(MemattnConfig, MemattnModel, exist_ok=True)
AutoModelForCausalLM.register(MemattnConfig, MemattnForCausalLM, exist_ok=True)
AutoModelForMaskedLM.register(MemattnConfig, MemattnForMaskedLM, exist_ok=True)
tell_peft(MODEL_TYPE, LORA_TARGETS)

import memattn.integrations.convert  # noqa: E402,F401  (registers the converted families too)
