"""Typed configuration: dataclasses, YAML presets and checked `key=value` overrides.

A run is a `RunConfig` of `ModelConfig`, `DataConfig` and `TrainConfig`. Presets are YAML
files in `memattn/configs/` (also reachable as `configs/` at the repository root); any
field can be overridden from the command line as `section.field=value`, e.g.
`model.d_model=128 train.steps=200 attention=softmax`. Unknown keys and values of the
wrong type raise `ConfigError` naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from memattn.errors import ConfigError
from memattn.layers.base import parse_options
from memattn.typed import coerce, from_dict, parse_key_value, set_path

PRESET_DIR = Path(__file__).parent / "configs"
SPLIT_BASE, SPLIT_BLOCKS = 512, 64  # split positions p = SPLIT_BASE·q + r, q < SPLIT_BLOCKS


def _one_of(name: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: expected one of {', '.join(map(str, allowed))}, got {value!r}")


def _positive(name: str, value, *, zero_ok: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{name}: expected a {'non-negative' if zero_ok else 'positive'} number, got {value!r}")


@dataclass
class AttentionConfig:
    """Which mechanism (a registry string) and its own options, as written (`options`) and
    as the mechanism's typed options dataclass (`typed`, checked when the config is made)."""

    name: str = "softmax"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.typed = parse_options(self.name, self.options)  # unknown mechanism or option -> ConfigError

    @classmethod
    def from_mapping(cls, data: dict[str, Any], prefix: str) -> AttentionConfig:
        """{name, options} or {name, OPT: value, ...}: options may also sit beside `name`."""
        data = dict(data)
        name = data.pop("name", "softmax")
        options = dict(data.pop("options", None) or {})
        options.update(data)
        return cls(coerce(f"{prefix}.name", name, str), options)


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0: taken from the corpus
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ff_mult: float = 4.0
    dropout: float = 0.0
    # split: absolute p = 512·q + r as E_r[r] + E_q[q] (r < 512, q < 64), up to 32,768 tokens
    positions: Literal["rotary", "learned", "none", "split"] = "rotary"
    max_len: int = 1024  # longest sequence learned (or split) positions cover
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    tie_embeddings: bool = True
    # weights drawn N(0, init_std) (residual output projections / √(2·n_layers)); 0.02 is
    # GPT-2's, for small widths ~1/√d_model lets symmetric units (memory tokens) part sooner
    init_std: float = 0.02
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    # cross attention of an encoder-decoder's decoder (None: `attention` itself), a mechanism
    # that can serve as cross attention (memattn.layers.cross), with its own options
    cross_attention: AttentionConfig | None = None
    # self attention of an encoder-decoder's encoder (None: `attention` itself), e.g. softmax
    # in the encoder with bounded memories in the decoder, as in ABC's translation models
    encoder_attention: AttentionConfig | None = None
    # a hybrid model: layer index -> the mechanism of that layer, e.g. {0: softmax,
    # 3: {name: abc-window, window: 64}} (or model.attention_layers.0=softmax); the layers
    # not named use `attention`. Keys are kept as strings ("0"), as JSON writes them.
    attention_layers: dict[str, AttentionConfig] = field(default_factory=dict)

    def layer_attention(self, index: int) -> AttentionConfig:
        """The mechanism of layer `index` (0-based): its entry in attention_layers, else `attention`."""
        return self.attention_layers.get(str(index), self.attention)

    def __post_init__(self) -> None:
        _positive("model.vocab_size", self.vocab_size, zero_ok=True)
        for name in ("d_model", "n_layers", "n_heads", "max_len"):
            _positive(f"model.{name}", getattr(self, name))
        _positive("model.ff_mult", self.ff_mult, zero_ok=True)
        _positive("model.init_std", self.init_std)
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model: {self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.positions == "rotary" and (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"model.positions: rotary needs an even head dim, got {self.d_model // self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: expected a value in [0, 1), got {self.dropout}")
        _one_of("model.positions", self.positions, ("rotary", "learned", "none", "split"))
        if self.positions == "split" and self.max_len > SPLIT_BASE * SPLIT_BLOCKS:
            raise ConfigError(f"model.max_len: split positions cover at most {SPLIT_BASE} x {SPLIT_BLOCKS} = "
                              f"{SPLIT_BASE * SPLIT_BLOCKS} tokens, got {self.max_len}")
        _one_of("model.norm", self.norm, ("layernorm", "rmsnorm"))
        self.attention_layers = self._layer_mechanisms(self.attention_layers)

    def _layer_mechanisms(self, given) -> dict[str, AttentionConfig]:
        """attention_layers as {"i": AttentionConfig} in layer order: keys layer numbers in
        0 .. n_layers - 1, values a mechanism's name, a mapping {name, OPTION: value, ...} or an
        AttentionConfig; ConfigError naming the entry otherwise."""
        if given is None:
            return {}
        if not isinstance(given, dict):
            raise ConfigError(f"model.attention_layers: expected a mapping of layer numbers to mechanisms, "
                              f"e.g. {{0: softmax}}, got {given!r}")
        layers: dict[int, AttentionConfig] = {}
        for key, value in given.items():
            name = f"model.attention_layers.{key}"
            try:
                index = int(key) if not isinstance(key, bool) and str(key).strip().isdigit() else -1
            except ValueError:
                index = -1
            if not 0 <= index < self.n_layers:
                raise ConfigError(f"{name}: expected a layer number in 0 .. {self.n_layers - 1} "
                                  f"(model.n_layers={self.n_layers}), got {key!r}")
            if index in layers:
                raise ConfigError(f"{name}: layer {index} is given twice")
            if not isinstance(value, (str, dict, AttentionConfig)):
                raise ConfigError(f"{name}: expected a mechanism's name or a mapping {{name: ..., OPTION: value}}, "
                                  f"got {value!r}")
            try:
                if isinstance(value, str):
                    value = AttentionConfig(value)
                elif isinstance(value, dict):
                    value = AttentionConfig.from_mapping(value, name)
            except ConfigError as e:
                raise ConfigError(f"{name}: {e}") from None
            layers[index] = value
        if layers:
            from memattn.layers.base import get_mechanism

            for mech in (self.attention, *layers.values()):
                if get_mechanism(mech.name).memory_layout is not None:
                    raise ConfigError(f"model.attention_layers: {mech.name!r} places memory tokens in the "
                                      "sequence every layer reads, so it cannot be mixed with other mechanisms "
                                      "layer by layer")
        return {str(i): layers[i] for i in sorted(layers)}


@dataclass
class DataConfig:
    # parallel: translation pairs (memattn.data.parallel) for task=translation; hf: the text
    # of a Hugging Face dataset (data.name, data.split, data.text_field)
    corpus: Literal["shakespeare", "text", "enwik8", "text8", "parallel", "hf"] = "shakespeare"
    path: str | None = None  # file or folder for text / enwik8 / text8; a TSV or a folder of them for parallel
    # bpe: a byte-pair vocabulary of bpe_size tokens trained on the training split (joint
    # over source and target for parallel data)
    level: Literal["char", "byte", "bpe"] = "char"
    bpe_size: int = 8000
    # parallel data as two aligned files (one sentence a line) instead of `path`
    source: str | None = None
    target: str | None = None
    # a Hugging Face dataset (a name, or a folder saved with save_to_disk): translation pairs
    # (corpus=parallel, with the two languages to read) or text (corpus=hf: the column
    # text_field; its own train / validation / test splits, or the one named by `split` cut
    # 90 / 5 / 5)
    name: str | None = None
    source_lang: str | None = None
    target_lang: str | None = None
    split: str | None = None
    text_field: str = "text"
    # a pretrained tokenizer (a Hugging Face name or folder) as the vocabulary, instead of
    # data.level's; saved with the run
    tokenizer: str | None = None
    cache_dir: str = ".cache/memattn"

    def __post_init__(self) -> None:
        _one_of("data.corpus", self.corpus, ("shakespeare", "text", "enwik8", "text8", "parallel", "hf"))
        _one_of("data.level", self.level, ("char", "byte", "bpe"))
        if self.bpe_size < 260:
            raise ConfigError(f"data.bpe_size: a byte-level BPE vocabulary holds 4 special tokens and the "
                              f"256 bytes before any merge, so at least 260; got {self.bpe_size}")
        if self.level == "bpe" and self.corpus in ("enwik8", "text8"):
            raise ConfigError(f"data.level: {self.corpus} is read at its own level (enwik8: bytes, text8: "
                              "characters), not bpe")
        given = [f"data.{k}" for k in ("path", "source", "name") if getattr(self, k)]
        if self.corpus == "parallel":
            if len(given) != 1:
                raise ConfigError("data.corpus=parallel: give one of data.path (a TSV of pairs or a folder of "
                                  "train/val/test TSVs), data.source with data.target (two aligned files), or "
                                  f"data.name (a Hugging Face dataset); got {', '.join(given) or 'none'}")
            if bool(self.source) != bool(self.target):
                raise ConfigError("data.source, data.target: parallel files come in pairs; give both")
            if self.level != "bpe":
                raise ConfigError(f"data.level: parallel data is read with a joint subword vocabulary "
                                  f"(data.level=bpe), got {self.level!r}")
        elif self.corpus == "hf":
            if not self.name or self.path or self.source:
                raise ConfigError("data.corpus=hf: give data.name (a Hugging Face dataset name or a folder "
                                  "saved with save_to_disk), and neither data.path nor data.source")
        elif self.source or self.target or self.name:
            raise ConfigError(f"data.source / data.target / data.name: only for data.corpus=parallel or hf, "
                              f"not {self.corpus!r}")
        if self.split is not None and self.corpus != "hf":
            raise ConfigError(f"data.split: names a split of a Hugging Face dataset (data.corpus=hf), "
                              f"not of {self.corpus!r}")
        if self.tokenizer and self.corpus in ("enwik8", "text8", "parallel"):
            raise ConfigError(f"data.tokenizer: {self.corpus} is read with its own vocabulary")
        if self.corpus not in ("shakespeare", "parallel", "hf") and not self.path:
            raise ConfigError(f"data.path: corpus {self.corpus!r} needs a path to a file or folder")


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32  # sequences per step, over all processes
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr · min_lr_ratio
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # 0 disables clipping
    eval_every: int = 200
    eval_batches: int = 20  # batches of the validation split per evaluation (0: all)
    # > 0: early stopping on the evaluation figure the task selects on (its `selects`): training
    # stops once `patience` evaluations in a row fail to beat the best by more than min_delta,
    # and the run ends with the weights of its best evaluation (best.safetensors); 0: off
    patience: int = 0
    min_delta: float = 0.0
    log_every: int = 10
    save_every: int = 200
    seed: int = 0
    device: str = "cpu"
    threads: int = 0  # torch threads on CPU; 0 keeps torch's default
    # Segment-level training (Transformer-XL style): batch_size contiguous streams read in
    # consecutive segments of seq_len, each layer's bounded memory of the previous segment
    # carried (detached) into the next; evaluation reads the same way.
    segments: bool = False
    # Start from another model's weights (a memattn run or checkpoint, or an export-hf folder):
    # every tensor shared by name and shape is copied, the mechanism's own ones stay new
    # (memattn.warmstart); a shorter model's position tables are grown to model.max_len (a
    # split table's new blocks copy its last one); the corpus is read with that model's vocabulary.
    init_from: str | None = None
    # translation: the target distribution is (1 - ε) on the reference token and ε spread
    # uniformly over the vocabulary (0: plain cross-entropy)
    label_smoothing: float = 0.0
    # under torchrun: ddp (every rank a whole replica) or fsdp (parameters, gradients and
    # optimiser state sharded over the ranks, sharded checkpoints: memattn.sharded)
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # > 0: add distill_weight · KL(teacher ‖ model) per token to the loss, the teacher being
    # the init_from model, frozen (uptraining a converted model towards the original)
    distill_weight: float = 0.0
    # > 0: attention transfer (LoLCATs' first stage) before the ordinary steps of a run started
    # from a softmax model (train.init_from: a memattn softmax run, or a folder of `memattn
    # convert`, whose softmax model is the one it was converted from): transfer_steps updates of
    # the mechanism's own parameters only (those the warm start or conversion did not copy; all
    # else frozen), each layer's attention trained to give the frozen softmax layer's output on
    # that layer's input in the softmax model (mean squared error, summed over the layers);
    # memattn.transfer
    transfer_steps: int = 0
    transfer_lr: float = 0.0  # learning rate of the transfer steps (0: train.lr)
    # > 0: the ordinary steps train rank-lora_rank adapters (LoRA) on the layers' linear weights
    # copied from train.init_from, and the mechanism's own parameters, with every copied weight frozen
    lora_rank: int = 0
    out_dir: str = "runs/default"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "save_every"):
            _positive(f"train.{name}", getattr(self, name))
        for name in ("lr", "warmup", "weight_decay", "grad_clip", "eval_batches", "threads", "patience",
                     "min_delta"):
            _positive(f"train.{name}", getattr(self, name), zero_ok=name != "lr")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio: expected a value in [0, 1], got {self.min_lr_ratio}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.betas: expected two values in [0, 1), got {list(self.betas)}")
        _one_of("train.parallel", self.parallel, ("ddp", "fsdp"))
        if self.parallel == "fsdp" and self.segments:
            raise ConfigError("train.parallel=fsdp: not with train.segments (the carried memory is saved "
                              "with the replicated checkpoint only); use ddp")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"train.label_smoothing: expected a value in [0, 1), got {self.label_smoothing}")
        if not math.isfinite(self.distill_weight) or self.distill_weight < 0:
            raise ConfigError(f"train.distill_weight: expected a weight >= 0, got {self.distill_weight}")
        if self.distill_weight > 0 and not self.init_from:
            raise ConfigError("train.distill_weight: the teacher is the train.init_from model; set train.init_from")
        if self.distill_weight > 0 and self.segments:
            raise ConfigError("train.distill_weight: not with train.segments (the teacher carries no memory "
                              "from segment to segment)")
        for name in ("transfer_steps", "lora_rank"):
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"train.{name}: expected a number >= 0, got {value}")
            if value > 0 and not self.init_from:
                raise ConfigError(f"train.{name}: trains a model started from another one; set train.init_from")
            if value > 0 and (self.segments or self.parallel == "fsdp"):
                raise ConfigError(f"train.{name}: not with train.segments or train.parallel=fsdp")
        if self.min_delta and not self.patience:
            raise ConfigError(f"train.min_delta: the improvement early stopping asks for; set train.patience "
                              f"(got min_delta={self.min_delta} with patience 0)")
        if self.patience and (self.parallel == "fsdp" or self.lora_rank):
            raise ConfigError("train.patience: not with train.parallel=fsdp or train.lora_rank (the best weights "
                              "are kept whole, as the model holds them)")
        _positive("train.transfer_lr", self.transfer_lr, zero_ok=True)
        if self.transfer_lr > 0 and not self.transfer_steps:
            raise ConfigError("train.transfer_lr: the learning rate of the transfer steps; set train.transfer_steps")
        if not self.out_dir.strip():
            raise ConfigError("train.out_dir: expected a folder for the run, got an empty string")


@dataclass
class RunConfig:
    # a registered task (memattn.tasks): lm, a causal language model on a corpus; mlm, a
    # bidirectional encoder restoring masked tokens; translation, an encoder-decoder on parallel data
    task: str = "lm"
    # the task's own settings (`task_options.KEY=VALUE`), read as its class's `Options`
    # dataclass (`task_settings`, checked when the config is made); none for lm, mlm, translation
    task_options: dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        from memattn.tasks import read_task_options, task_class

        self.task_settings = read_task_options(self.task, self.task_options)
        task = task_class(self.task)
        if self.train.patience and task.selects is None:
            raise ConfigError(f"train.patience: task={self.task} names no evaluation figure to stop on "
                              "(its `selects`); leave train.patience at 0")
        task.check_config(self)


def to_dict(cfg) -> dict[str, Any]:
    """The config as plain nested dicts/lists (YAML/JSON ready)."""
    out = dataclasses.asdict(cfg)
    return _plain(out)


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


_ALIASES = {"attention": "model.attention"}


def parse_override(text: str) -> tuple[list[str], Any]:
    """'model.d_model=128' -> (['model', 'd_model'], 128), with the short forms
    `attention=NAME` (model.attention.name) and `attention.OPT=V` (model.attention.OPT)."""
    path, value = parse_key_value(text)
    if path[0] in _ALIASES:
        path = _ALIASES[path[0]].split(".") + path[1:]
    if path == ["model", "attention"]:
        path = ["model", "attention", "name"]
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `key=value` in the nested dict `data` (a copy is returned); naming a new
    mechanism starts it from its own default options, so an option given before the name in
    the same list, which that would drop, is refused."""
    data = copy.deepcopy(data)
    options: list[str] = []  # attention.OPTION overrides applied so far
    for text in overrides:
        path, value = parse_override(text)
        if path[:2] == ["model", "attention"] and path[-1] == "name":
            node = data.get("model", {}).get("attention", {})
            if isinstance(node, dict) and node.get("name") != value:
                if options:
                    raise ConfigError(f"{options[0]}: an attention option before attention={value}, which "
                                      f"starts that mechanism from its own defaults, would be dropped; "
                                      f"options follow the mechanism's name")
                node.clear()
        elif path[:2] == ["model", "attention"]:
            options.append(text)
        set_path(data, path, value)
    return data


def preset_path(name: str) -> Path:
    """A path to a YAML file or a preset name ('demo'); a folder of that name is not read."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise ConfigError(f"config: no such file {name}")
        return p
    candidate = PRESET_DIR / f"{name}.yaml"
    if not candidate.exists():
        known = ", ".join(sorted(x.stem for x in PRESET_DIR.glob("*.yaml")))
        what = "a folder, not a YAML file, and not a preset" if p.is_dir() else "an unknown preset"
        raise ConfigError(f"config: {name!r} is {what} (presets: {known})")
    return candidate


def load_config(preset: str | None = None, overrides: list[str] = (), base: dict | None = None) -> RunConfig:
    """RunConfig from a preset (name or YAML path), then `key=value` overrides."""
    data: dict[str, Any] = dict(base or {})
    if preset:
        path = preset_path(preset)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"config: {path} is not UTF-8 text") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            raise ConfigError(f"config: {path} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {preset} does not hold a mapping")
        data = loaded
    data = apply_overrides(data, list(overrides))
    return from_dict(RunConfig, data)
