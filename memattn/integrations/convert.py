"""A pretrained Hugging Face model with its attention replaced by a memattn mechanism.

    from memattn.integrations.convert import convert
    model = AutoModelForCausalLM.from_pretrained("...")          # Llama, Mistral, Qwen2/3, GPT-2
    convert(model, "abc-mlp", {"num_slots": 32}, layers=None)   # in place; returns the model
    model.generate(ids, attention_mask=mask, num_beams=4)       # decodes with bounded states

Every self-attention module of a Llama-family model (Llama, Mistral, Qwen2, Qwen3: rotary
positions, grouped-query attention, Qwen2's biases, Qwen3's per-head q/k norms), GPT-2, or a
BERT / RoBERTa encoder (bidirectional) becomes a memattn layer of the chosen mechanism
(`layers`: which layer indices; the others keep their attention — hybrid models). The
q/k/v and output weights and biases are copied (grouped key/value heads repeated over their
query heads, as the model's own attention reads them), positions stay as the model had them
(rotary inside the layer with the model's base, learned ones outside it), and everything
else — embeddings, norms, MLPs, head — is left untouched. The mechanism's own parameters
(ABC's φ, persistent vectors, gates) start from its own initialisation, so a converted model
reads like the original only with `softmax`; the others are meant to be trained on.

Decoding keeps each converted layer's memattn state in the transformers cache (a
`StateLayer` in the place of that layer's key/value layer), so beam search reorders it and
bounded mechanisms stay fixed in size under `generate`.

A converted model is of its family's converted class (`MemattnLlamaForCausalLM`, a
`LlamaForCausalLM`; `MemattnBertForMaskedLM`, ...: FAMILIES) with its own model type
("memattn-llama", ...) and the conversion recorded in its config, so the folder it saves
(`save_pretrained`, `save_converted`, `memattn convert`) loads as the converted model and as
nothing else: `AutoModelForCausalLM.from_pretrained(folder)` once this module (or
memattn.integrations.hf) is imported, or with `trust_remote_code=True` through the folder's
copy of `modeling_memattn.py`; `load_converted` does the same. The folder also carries a model
card and memattn's folder format (`memattn.integrations.folders`). PEFT's LoRA targets by
default what it targets in the source family plus every converted layer's `qkv`.

The mechanisms it converts to are those the registry declares `convertible` (`targets()`).
Refused with an error: rotary scaling other than the default, sliding-window layers,
mechanisms that need memattn's own models around them (not declared convertible: memory
tokens placed in the sequence, memories handed from layer to layer; options that bring a
feed-forward sublayer of their own), cross attention, a head dim times heads other than
the hidden size, and a static (preallocated key/value) cache.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memattn.errors import ConfigError
from memattn.layers.base import (AttentionState, LayerSpec, build_attention, build_feedforward,
                                 get_mechanism, layers_aux_loss, mechanisms, parse_options, real_positions)
from memattn.layers.positions import Rotary

try:
    import transformers
    from transformers import AutoConfig
    from transformers.cache_utils import EncoderDecoderCache
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("memattn.integrations.convert needs transformers 5: pip install 'memattn[hf]'") from e

from memattn.integrations.folders import (FORMAT, check_format, config_file, read_config,  # noqa: E402
                                          write_card, write_remote_code)
from memattn.integrations.hf_cache import STATIC_CACHE, StatefulLayer, refuse_static_cache, tell_peft  # noqa: E402
from memattn.warmstart import CONVERSION_KEY as CONFIG_KEY  # noqa: E402

LLAMA_LIKE = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
GPT2 = ("GPT2Attention",)
BERT_LIKE = ("BertSelfAttention", "RobertaSelfAttention")


class StateLayer(StatefulLayer):
    """A converted layer's place in a transformers cache: its memattn state, the tokens seen
    and each row's count of real tokens (for positions under left padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.state: AttentionState | None = None
        self.seen = 0
        self.real: torch.Tensor | None = None  # [B] real tokens read per row, once a mask was given

    def get_seq_length(self) -> int:
        return self.seen

    def _rows(self, pick) -> None:
        if self.state is not None:
            self.state.map_tensors(lambda t, batched: pick(t) if batched else t)
        if self.real is not None:
            self.real = pick(self.real)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, 0))

    def crop(self, max_length: int) -> None:
        length = max_length if max_length >= 0 else self.seen + max_length
        if self.state is not None:
            self.state.crop(length)  # ConfigError for a state that summarises its tokens
        self.seen = length

    def reset(self) -> None:
        self.state, self.seen, self.real = None, 0, None


def _key_padding(mask: torch.Tensor | None, T: int, causal: bool) -> torch.Tensor | None:
    """Which of the T new tokens are real [B, T] bool, read off the mask transformers gives an
    attention module: None, bool [B, 1, Tq, Tk] (True: attend) or additive float (0: attend).
    The last query of a causal mask (the first of a bidirectional one) sees every real key."""
    if mask is None:
        return None
    if mask.dim() != 4:
        raise ConfigError(f"attention_mask: expected the model's 4D mask [B, 1, Tq, Tk], got shape "
                          f"{tuple(mask.shape)}")
    row = mask[:, 0, -1 if causal else 0, -T:]
    real = row if row.dtype == torch.bool else row == 0
    return None if bool(real.all()) else real


class ConvertedAttention(nn.Module):
    """A memattn layer in the place of a transformers attention module, with its call
    signature: (hidden_states, attention_mask, position_ids, past_key_values, ...) ->
    (output [B, T, hidden], None)."""

    def __init__(self, layer: nn.Module, layer_idx: int) -> None:
        super().__init__()
        self.layer = layer
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, position_ids: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, **kwargs: Any):
        if encoder_hidden_states is not None:
            raise ConfigError("a converted memattn layer is self-attention; cross attention is not converted")
        if isinstance(past_key_values, EncoderDecoderCache):
            raise ConfigError("past_key_values: an encoder-decoder cache cannot hold a converted layer's state")
        B, T, _ = hidden_states.shape
        causal = self.layer.spec.causal
        real = _key_padding(attention_mask, T, causal)
        slot = None
        if past_key_values is not None and causal:
            while len(past_key_values.layers) <= self.layer_idx:  # a cache that adds layers lazily
                past_key_values.layers.append(StateLayer())
            slot = past_key_values.layers[self.layer_idx]
            if getattr(slot, "is_compileable", False):
                raise ConfigError(f"past_key_values: {STATIC_CACHE}")
            if not isinstance(slot, StateLayer):
                slot = past_key_values.layers[self.layer_idx] = StateLayer()
            if slot.state is None:
                slot.state = self.layer.init_state(B, device=hidden_states.device, dtype=hidden_states.dtype)
        positions = position_ids  # the model's own, when it passes them
        if positions is None:  # counted over each row's real tokens, the count kept in the cache
            positions, counted = real_positions(slot.real if slot is not None else None,
                                                slot.seen if slot is not None else 0, real, B, T,
                                                hidden_states.device)
            if slot is not None and counted is not None:
                slot.real = counted
        state = slot.state if slot is not None else None
        if slot is not None and real is None and slot.real is not None:
            real = torch.ones(B, T, dtype=torch.bool, device=hidden_states.device)
        y, state = self.layer(hidden_states, memory_state=state, attention_mask=real, positions=positions)
        if slot is not None:
            slot.state, slot.seen = state, slot.seen + T
        return y, None


# The parts of a converted layer that hold the source attention's weights (`_memattn_layer`
# copies q/k/v and the output projection and shares Qwen3's q/k norms); the rest of the layer
# is the mechanism's own, as initialised.
SOURCE_PARTS = ("qkv", "out", "q_norm", "k_norm")


def new_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters of a converted model (or a module holding one) that the conversion
    did not copy from the source: each converted layer's mechanism's own (φ, gates, ...). Every
    other parameter is the source model's."""
    return [f"{path}.layer.{name}" for path, m in model.named_modules() if isinstance(m, ConvertedAttention)
            for name, _ in m.layer.named_parameters() if name.split(".", 1)[0] not in SOURCE_PARTS]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of each layer of a transformers model, converted
    (`ConvertedAttention`) or as it was, in layer order."""
    return [m for m in model.modules() if isinstance(m, ConvertedAttention) or _kind(m) is not None]


def _linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias or None) of an nn.Linear or a GPT-2 Conv1D ([in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    return module.weight.detach().t(), module.bias.detach()


def _projections(attn: nn.Module, kind: str, n_heads: int, head_dim: int):
    """[(q, k, v) weights [H·D, d] and biases (None where absent)], output (weight, bias) or None."""
    if kind == "gpt2":
        w, b = _linear_weights(attn.c_attn)
        (wq, wk, wv), (bq, bk, bv) = w.chunk(3, 0), b.chunk(3, 0)
        return (wq, wk, wv), (bq, bk, bv), _linear_weights(attn.c_proj)
    if kind == "bert":
        parts = [_linear_weights(getattr(attn, n)) for n in ("query", "key", "value")]
        return tuple(w for w, _ in parts), tuple(b for _, b in parts), None  # output dense stays outside
    parts = [_linear_weights(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")]
    groups = n_heads // (parts[1][0].shape[0] // head_dim)  # query heads per key/value head

    def repeat(t):  # [Hkv·D, ...] -> [H·D, ...]: each key/value head serves `groups` query heads
        return None if t is None else t.view(-1, head_dim, *t.shape[1:]).repeat_interleave(groups, 0).flatten(0, 1)

    weights = (parts[0][0], repeat(parts[1][0]), repeat(parts[2][0]))
    biases = (parts[0][1], repeat(parts[1][1]), repeat(parts[2][1]))
    return weights, biases, _linear_weights(attn.o_proj)


def _kind(attn: nn.Module) -> str | None:
    name = type(attn).__name__
    return "llama" if name in LLAMA_LIKE else "gpt2" if name in GPT2 else "bert" if name in BERT_LIKE else None


def _check_model(config, kind: str, index: int) -> None:
    if kind == "llama":
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"convert: rotary scaling {rope.get('rope_type')!r} is not supported "
                              "(the default rotary positions are)")
        layer_types = getattr(config, "layer_types", None) or []
        mistral = isinstance(config, transformers.MistralConfig)
        sliding = (getattr(config, "sliding_window", None) is not None and mistral) \
            or (index < len(layer_types) and layer_types[index] == "sliding_attention")
        if sliding:
            raise ConfigError(f"convert: layer {index} is sliding-window attention; set config.sliding_window "
                              "to None first, or keep it with layers=")
    if kind == "gpt2" and getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ConfigError("convert: GPT-2's scale_attn_by_inverse_layer_idx is not supported")
    if kind == "bert" and getattr(config, "is_decoder", False):
        raise ConfigError("convert: a BERT-style decoder is not supported (encoders are)")


def _memattn_layer(attn: nn.Module, kind: str, config, name: str, options: Any, index: int,
                   n_layers: int) -> nn.Module:
    """The memattn layer of mechanism `name` holding `attn`'s weights."""
    _check_model(config, kind, index)
    d, H = config.hidden_size, config.num_attention_heads
    D = getattr(attn, "head_dim", None) or getattr(attn, "attention_head_size", None) or d // H
    if H * D != d:
        raise ConfigError(f"convert: heads x head dim = {H} x {D} differs from the hidden size {d}; "
                          "memattn layers read the whole width")
    (wq, wk, wv), (bq, bk, bv), out = _projections(attn, kind, H, D)
    has_bias = any(b is not None for b in (bq, bk, bv)) or (out is not None and out[1] is not None)
    if has_bias and not hasattr(options, "bias"):
        raise ConfigError(f"convert: the model's attention has biases and {name!r} has no bias option")
    if has_bias:
        options = dataclasses.replace(options, bias=True)
    spec = LayerSpec(d, H, causal=kind != "bert", layer_idx=index, n_layers=n_layers,
                     max_len=getattr(config, "max_position_embeddings", 1024),
                     positions="rotary" if kind == "llama" else "none")
    if build_feedforward(name, options, spec) is not None:
        raise ConfigError(f"convert: {name!r} with these options brings its own feed-forward sublayer; "
                          "only attention is converted")
    layer = build_attention(name, options, spec)
    if getattr(layer, "kv_heads", H) != H:
        raise ConfigError(f"convert: {name!r} with these options reads {layer.kv_heads} key/value heads, "
                          f"the model's attention {H}")
    if kind == "llama":
        layer.rotary = Rotary(D, base=float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
        if hasattr(attn, "q_norm"):
            layer.q_norm, layer.k_norm = attn.q_norm, attn.k_norm
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.cat([wq, wk, wv], 0))
        if layer.qkv.bias is not None:
            layer.qkv.bias.copy_(torch.cat([b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
                                            for w, b in ((wq, bq), (wk, bk), (wv, bv))]))
        if out is None:
            layer.out = nn.Identity()  # BERT's output projection sits outside its self-attention
        else:
            layer.out.weight.copy_(out[0])
            if layer.out.bias is not None:
                layer.out.bias.copy_(out[1] if out[1] is not None else torch.zeros_like(layer.out.bias))
    weight = wq
    return layer.to(device=weight.device, dtype=weight.dtype)


def targets() -> list[str]:
    """The mechanisms `convert` puts in the place of a transformers attention module: those
    the registry declares convertible."""
    return [name for name, mech in mechanisms().items() if mech.convertible]


def convert(model: nn.Module, attention: str, options: dict[str, Any] | None = None, *,
            layers: list[int] | None = None) -> nn.Module:
    """Replace the self-attention of `model` (a transformers model) by memattn mechanism
    `attention` with `options`, in the layers `layers` (None: all), in place; returns it."""
    mech = get_mechanism(attention)
    if not mech.convertible:
        needs = [what for what, needed in (
            ("its memory tokens are placed in the sequence", mech.memory_layout is not None),
            ("each layer reads the memory the layer before it wrote", mech.reads_layer_outputs)) if needed]
        raise ConfigError(f"convert: {attention!r} cannot replace one attention module: it needs memattn's "
                          f"own models around it{' (' + '; '.join(needs) + ')' if needs else ''}; "
                          f"mechanisms that convert: {', '.join(targets())}")
    typed = parse_options(attention, options or {})
    if any(isinstance(m, ConvertedAttention) for m in model.modules()):
        raise ConfigError("convert: the model was converted already; convert the original once, "
                          "choosing its layers with layers=")
    config = model.config
    recorded = getattr(config, CONFIG_KEY, None)  # a folder being loaded: its record stands
    found = [(name, m, _kind(m)) for name, m in model.named_modules() if _kind(m) is not None]
    if not found:
        raise ConfigError(f"convert: no supported attention module in {type(model).__name__} (supported: "
                          f"{', '.join(LLAMA_LIKE + GPT2 + BERT_LIKE)})")
    n = len(found)
    chosen = set(range(n)) if layers is None else set(layers)
    unknown = sorted(chosen - set(range(n)))
    if unknown:
        raise ConfigError(f"convert: layers {unknown} do not exist (the model has {n} attention layers)")
    for index, (path, attn, kind) in enumerate(found):
        if index not in chosen:
            continue
        causal = kind != "bert"
        if (causal and not mech.causal) or (not causal and not mech.bidirectional):
            raise ConfigError(f"convert: {attention!r} cannot serve as {'causal' if causal else 'bidirectional'} "
                              "attention")
        layer_idx = getattr(attn, "layer_idx", None)
        converted = ConvertedAttention(_memattn_layer(attn, kind, config, attention, typed, index, n),
                                       index if layer_idx is None else layer_idx)
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, converted)
    source = recorded.get("source") if isinstance(recorded, dict) else getattr(config, "_name_or_path", None)
    record = {"attention": attention, "options": dict(options or {}), "layers": sorted(chosen),
              "source": source or None, "causal": all(kind != "bert" for _, _, kind in found)}
    converted_config = CONFIG_BY_SOURCE.get(type(config))
    if converted_config is not None:  # it saves as what it now is (own model_type, auto_map, card)
        config.__class__ = converted_config
        config.memattn_format = FORMAT
        tell_peft(config.model_type, lora_targets(config.model_type))
    converted_model = CONVERTED_BY_SOURCE.get(type(model))
    if converted_model is not None:
        model.__class__ = converted_model
    setattr(config, CONFIG_KEY, record)
    return model


class ConvertedLM(nn.Module):
    """A transformers causal LM (a converted one, or its original as a teacher) called the way
    memattn's training loop and evaluation call a model: ids [B, T] -> logits [B, T, V].
    Whole windows only: it keeps no memattn cache (no train.segments, no --stream)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ConfigError("a converted transformers model reads whole windows: no memattn cache "
                              "(train.segments, eval --stream)")
        return self.hf(input_ids=idx, use_cache=False).logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def aux_loss(self) -> torch.Tensor | None:
        """The converted layers' auxiliary losses (of the mechanisms that declare one), or None."""
        return layers_aux_loss(self)


def save_converted(model: nn.Module, folder: str | Path) -> None:
    """`save_pretrained` of a converted model: a folder of its converted family (FAMILIES) that
    records the conversion and loads as nothing else."""
    if not hasattr(model.config, CONFIG_KEY):
        raise ConfigError("save_converted: the model was not converted by memattn")
    if not isinstance(model, ConvertedModel):
        raise ConfigError(f"save_converted: memattn saves converted {', '.join(sorted(SOURCE_NAMES))}; a "
                          f"converted {type(model).__name__} would not load back as converted")
    model.save_pretrained(folder)


def load_converted(folder: str | Path, auto_class=None) -> nn.Module:
    """A converted model saved by memattn, in eval mode: its converted family's class through
    `auto_class` (default: AutoModelForMaskedLM for a masked LM, else AutoModelForCausalLM).
    A folder of an earlier memattn (the source's model_type and the recorded conversion) is
    rebuilt: the original architecture from the config, converted as recorded, then every
    weight loaded (strictly)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    folder = Path(folder)
    raw = read_config(folder)
    masked = any("MaskedLM" in a for a in raw.get("architectures") or [])
    auto = auto_class or (AutoModelForMaskedLM if masked else AutoModelForCausalLM)
    if str(raw.get("model_type", "")).startswith("memattn-"):
        return auto.from_pretrained(folder).eval()
    return _load_earlier_folder(folder, auto)


def _load_earlier_folder(folder: Path, auto) -> nn.Module:
    from safetensors.torch import load_file

    config = AutoConfig.from_pretrained(folder)
    recorded = getattr(config, CONFIG_KEY, None)
    if not isinstance(recorded, dict):
        raise ConfigError(f"load_converted: {folder}/config.json records no memattn conversion")
    model = auto.from_config(config)
    convert(model, recorded["attention"], recorded["options"], layers=recorded["layers"])
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(file))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(f"load_converted: {folder} does not fit its recorded conversion: missing "
                          f"{missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    return model.eval()


def conversion_of(config) -> dict[str, Any]:
    """The conversion a converted config records, its keys checked (ConfigError naming the file)."""
    where = config_file(config)
    record = getattr(config, CONFIG_KEY, None)
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: model_type {config.model_type!r} is a model converted by memattn, but "
                          f"{CONFIG_KEY} is {'missing' if record is None else 'not a mapping'}")
    unknown = sorted(set(record) - {"attention", "options", "layers", "source", "causal"})
    layers = record.get("layers")
    problem = (f"unknown keys {unknown}" if unknown
               else "attention: expected a mechanism name" if not isinstance(record.get("attention"), str)
               else "options: expected a mapping" if not isinstance(record.get("options", {}), dict)
               else "layers: expected a list of layer numbers" if layers is not None and not (
                   isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers))
               else None)
    if problem:
        raise ConfigError(f"{where}: {CONFIG_KEY}.{problem}")
    return record


def lora_targets(model_type: str) -> list[str]:
    """PEFT LoRA's default target modules of a converted family: the source family's (kept in
    the layers left as they were) and every converted layer's q/k/v projection."""
    family = model_type.removeprefix("memattn-")
    source = {"gpt2": ["c_attn"], "bert": ["query", "value"], "roberta": ["query", "value"]}
    return [*source.get(family, ["q_proj", "v_proj"]), "qkv"]


def cache_nbytes(cache) -> int:
    """Bytes a transformers cache holds: converted layers' states and the other layers' keys and values."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, StateLayer):
            total += layer.state.nbytes() if layer.state is not None else 0
        else:
            total += sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None),
                                                                 getattr(layer, "values", None))
                         if torch.is_tensor(t))
    return total


def decoding_state(model: nn.Module, lengths: tuple[int, int] = (8, 16)) -> tuple[int, float]:
    """(fixed bytes, bytes per token) of a converted decoder's cache, batch of one, its dtype."""
    from transformers import DynamicCache

    sizes = []
    device = next(model.parameters()).device
    for n in lengths:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.zeros(1, n, dtype=torch.long, device=device), past_key_values=cache, use_cache=True)
        sizes.append(cache_nbytes(cache))
    per_token = (sizes[1] - sizes[0]) / (lengths[1] - lengths[0])
    return int(sizes[0] - per_token * lengths[0]), per_token


def context_length(config) -> int | None:
    """The context length a config declares (what lm-evaluation-harness reads windows of)."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def converted_card_facts(model: nn.Module) -> dict[str, Any]:
    """What a model card can say of a converted model by itself."""
    record = conversion_of(model.config)
    n = len(attention_modules(model))
    source = record.get("source") or "a pretrained model"
    family = model.config.model_type.removeprefix("memattn-")
    facts: dict[str, Any] = {
        "title": f"{Path(str(source)).name} with memattn {record['attention']} attention",
        "what": (f"A {family} model ({source}) whose self-attention memattn replaced by its "
                 f"{record['attention']!r} mechanism ({'causal' if record.get('causal', True) else 'bidirectional'}): "
                 "the q/k/v and output weights copied, everything else as it was, the mechanism's own "
                 "parameters new (a conversion reads like the original only with softmax; the others are "
                 "meant to be trained on). Converting it again is refused: convert the original."),
        "mechanism": record["attention"], "options": record.get("options") or {},
        "layers": f"{', '.join(map(str, record['layers']))} of {n}" if record.get("layers") is not None else None,
        "source": source, "context_length": context_length(model.config),
        "load": type(model)._memattn_auto}
    if isinstance(model, ConvertedDecoder):
        facts["state"] = decoding_state(model)
    return facts


class ConvertedModel:
    """What a converted family's class adds to its transformers class (`MemattnLlamaForCausalLM`
    is a `LlamaForCausalLM`): built from a config that records a conversion, it converts itself
    as recorded, so that `from_pretrained` loads every weight in its place; saved, its folder
    says what it is (auto_map and `modeling_memattn.py`, memattn_format, a model card)."""

    _memattn_auto = "AutoModel"  # the Auto class that loads this class, set per class

    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        record = conversion_of(config)
        try:
            convert(self, record["attention"], record.get("options") or {}, layers=record.get("layers"))
        except ConfigError as e:
            raise ConfigError(f"{config_file(config)}: {CONFIG_KEY} does not convert this model: {e}") from None
        tell_peft(config.model_type, lora_targets(config.model_type))

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any) -> None:
        """transformers' save_pretrained, then auto_map and `modeling_memattn.py`, memattn_format
        and a model card (unless the folder has one)."""
        self._auto_class = None  # memattn writes its own auto_map (not a copy of this module)
        self.config._auto_class = None
        self.config.memattn_format = FORMAT
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            family = FAMILIES[self.config.model_type.removeprefix("memattn-")]
            base = CONVERTED_CLASSES[f"Memattn{family[1]['AutoModel']}"]
            write_remote_code(save_directory, {"AutoConfig": type(self.config).__name__,
                                               "AutoModel": base.__name__,
                                               type(self)._memattn_auto: type(self).__name__})
            if not (Path(save_directory) / "README.md").exists():
                write_card(save_directory, converted_card_facts(self))


class ConvertedDecoder(ConvertedModel):
    """A converted decoder: `generate` refuses a static cache (STATIC_CACHE) up front."""

    def generate(self, *args: Any, **kwargs: Any):
        refuse_static_cache(self, kwargs)
        return super().generate(*args, **kwargs)


# The families memattn converts, by the source's model_type: its config class and, by Auto
# class, the model classes whose converted folders load.
FAMILIES = {
    "llama": ("LlamaConfig", {"AutoModel": "LlamaModel", "AutoModelForCausalLM": "LlamaForCausalLM"}),
    "mistral": ("MistralConfig", {"AutoModel": "MistralModel", "AutoModelForCausalLM": "MistralForCausalLM"}),
    "qwen2": ("Qwen2Config", {"AutoModel": "Qwen2Model", "AutoModelForCausalLM": "Qwen2ForCausalLM"}),
    "qwen3": ("Qwen3Config", {"AutoModel": "Qwen3Model", "AutoModelForCausalLM": "Qwen3ForCausalLM"}),
    "gpt2": ("GPT2Config", {"AutoModel": "GPT2Model", "AutoModelForCausalLM": "GPT2LMHeadModel"}),
    "bert": ("BertConfig", {"AutoModel": "BertModel", "AutoModelForMaskedLM": "BertForMaskedLM"}),
    "roberta": ("RobertaConfig", {"AutoModel": "RobertaModel", "AutoModelForMaskedLM": "RobertaForMaskedLM"}),
}


def _converted_config_class(model_type: str) -> type:
    base = getattr(transformers, FAMILIES[model_type][0])

    class Converted(base):
        memattn_conversion: dict | None = None
        memattn_format: int | None = None

        def __post_init__(self, **kwargs: Any) -> None:
            super().__post_init__(**kwargs)
            check_format(self.memattn_format, config_file(self))

    Converted.model_type = f"memattn-{model_type}"
    Converted.__name__ = Converted.__qualname__ = f"Memattn{base.__name__}"
    Converted.__doc__ = f"A {base.__name__} that records a memattn conversion (model_type {Converted.model_type!r})."
    return Converted


def _register_families() -> tuple[dict[str, type], dict[type, type], dict[type, type]]:
    """Build every converted class and register it with its Auto class: (classes by name,
    converted config class by source config class, converted model class by source class)."""
    by_name: dict[str, type] = {}
    configs: dict[type, type] = {}
    models: dict[type, type] = {}
    for model_type, (_, heads) in FAMILIES.items():
        config_class = _converted_config_class(model_type)
        configs[config_class.__mro__[1]] = by_name[config_class.__name__] = config_class
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        tell_peft(config_class.model_type, lora_targets(config_class.model_type))
        for auto_name, source_name in heads.items():
            source = getattr(transformers, source_name)
            mixin = ConvertedDecoder if auto_name == "AutoModelForCausalLM" else ConvertedModel
            cls = type(f"Memattn{source_name}", (mixin, source),
                       {"config_class": config_class, "_memattn_auto": auto_name, "__module__": __name__,
                        "__doc__": f"A {source_name} converted by memattn (its folder: model_type "
                                   f"{config_class.model_type!r})."})
            models[source] = by_name[cls.__name__] = cls
            getattr(transformers, auto_name).register(config_class, cls, exist_ok=True)
    return by_name, configs, models


CONVERTED_CLASSES, CONFIG_BY_SOURCE, CONVERTED_BY_SOURCE = _register_families()
SOURCE_NAMES = {source.__name__ for source in CONVERTED_BY_SOURCE}
globals().update(CONVERTED_CLASSES)  # each class importable by its name, as auto_map names it


# Files one of which a folder with a tokenizer holds (transformers' names)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def source_tokenizer(name: str | Path):
    """The tokenizer of a model folder or hub name, or None when it has none (a folder without
    tokenizer files, or one that transformers reads as empty)."""
    from transformers import AutoTokenizer

    folder = Path(name)
    if folder.is_dir() and not any((folder / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return tokenizer if len(tokenizer) > 0 else None


def convert_pretrained(name: str | Path, attention: str, options: dict[str, Any], layers: list[int] | None,
                       out: Path) -> bool:
    """`memattn convert`: the model `name` (folder or hub name) converted and saved in `out`
    with its tokenizer, if it has one (returns whether it had). A folder memattn wrote already
    (converted, or exported from a memattn run) is refused: converting it again would read its
    converted layers as the source's attention, and a memattn model starts another mechanism
    with train.init_from."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    local = Path(name) / "config.json"
    raw = read_config(Path(name)) if local.is_file() else {}
    config = AutoConfig.from_pretrained(name)
    record = raw.get(CONFIG_KEY, getattr(config, CONFIG_KEY, None))
    if str(raw.get("model_type", config.model_type)).startswith("memattn-") or record is not None:
        record = record if isinstance(record, dict) else {}
        source = record.get("source")
        raise ConfigError(f"convert: {name} was converted by memattn already ({record.get('attention')!r} in layers "
                          f"{record.get('layers')}); convert the original{' ' + source if source else ''} once, "
                          f"choosing its layers with --layers, or train this one on with "
                          f"`memattn train train.init_from={name}`")
    if config.model_type == "memattn":
        raise ConfigError(f"convert: {name} is a memattn model already; start another mechanism from it "
                          f"with `memattn train attention=NAME train.init_from={name}`")
    masked = any("MaskedLM" in a for a in (getattr(config, "architectures", None) or []))
    model = (AutoModelForMaskedLM if masked else AutoModelForCausalLM).from_pretrained(name)
    convert(model, attention, options, layers=layers)
    save_converted(model, out)
    tokenizer = source_tokenizer(name)
    if tokenizer is not None:  # the tokenizer `memattn train train.init_from=OUT` reads with
        tokenizer.save_pretrained(out)
    return tokenizer is not None
