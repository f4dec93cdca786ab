"""What a bounded memory can recall: MQAR and passkey retrieval at matched state size.

The trade-off table users ask for: what each memory keeps and what it loses, at the same
decoding-state bytes. For every mechanism of the registry that can be used causally, a
small causal LM (`memattn.models.CausalLM`) is trained on a mix of two synthetic tasks of
our own seeded generators (`memattn.data.recall`):

- MQAR (multi-query associative recall): `pairs` key-value pairs, then queries of keys seen
  earlier; accuracy = share of the queries' values predicted right (teacher forcing).
- Passkey: a few digits after a marker, `distance` filler tokens, a query marker after which
  the digits come again; accuracy = share of passkeys with every digit right (teacher
  forcing). Trained at distances up to its rows' length (`length`, or `passkey_length` for
  rows of their own: a model that has learned to keep a passkey over 1k tokens), tested there
  and at 1k ... 64k tokens: bounded mechanisms stream through their fixed-size cache in chunks of `chunk`
  tokens (constant memory); softmax, whose KV cache grows, reads each row as one window of at
  most `max_window` tokens, and a longer one is "not read". A mechanism's own limit met while
  reading (abc-linformer's learned columns, abc-l2g's and abc-meanpool's slot positions end)
  is also "not read", with its message.

Memories: every causal mechanism of the registry at its default options (`all`), and the
options that make one stream (abc-mlp's `recency` and `forget`), each at every target.

Matched state size: each target of `state_bytes` (bytes of decoding state per layer) picks,
for each mechanism, the value of the option that sizes its state (its registration's
`state_size`) whose state is closest to the target (in ratio), the bytes measured from
`model.init_cache(1)` once it holds what it keeps (`state_bytes`: after training rows until
its bytes stop changing). Mechanisms whose state no option sizes (linear, gated-linear:
H·K·V set by d_model and n_heads) get one row at their own size; one whose state grows and
no option sizes (softmax) is a ceiling, one row, its bytes at the training length on the row.

Budget: MQAR is learned slowly at this scale. In a probe at these defaults (softmax, one CPU
thread), MQAR accuracy rose from 0.26 at 2,000 steps to 0.375 at 5,000 while the passkey was
right from about 2,500 steps on: the table compares mechanisms at one equal budget (`steps`),
not at convergence. The full run (24 models with the 14 causal mechanisms registered when it
was sized, 4,000 steps each) takes about 70 minutes with
--jobs 2 on an otherwise idle 2-core CPU, one thread a model: steps of 26 (softmax) to 245 ms
(abc-cluster, 32 clusters), evaluation 1 to 7 minutes a model (softmax's 64k-token windows);
abc-mlp's two forgetting rules at both sizes added 19 minutes of training. Passkey rows of
1,024 tokens (`passkey_length=1024`) make a step about 5 times as long: 8 models at 16 KiB,
10 to 29 minutes of training each (156 in all), took about 80 minutes with --jobs 2.

    memattn experiment recall [--quick] [--jobs N] [steps=4000 state_bytes=[4096,16384] ...]
    memattn experiment recall --out-dir results/recall-1k --jobs 2 passkey_length=1024 \
        state_bytes=[16384] "mechanisms=[softmax,abc-mlp,abc-mlp:recency=true,gsa,...]"

Each model trains through `memattn train`'s loop as task=recall (`RecallTask`, registered
here) in a run folder under runs/ (checkpoint, log.jsonl, row.json once evaluated): the command
continues what is unfinished and reuses what is done. Writes results.json,
results.md and recall.png to the output folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from memattn.config import AttentionConfig, ModelConfig
from memattn.data.recall import RecallVocab, answer_hits, answer_loss, mqar_batch, passkey_batch
from memattn.errors import ConfigError, ShapeError
from memattn.layers.base import StateSize, get_mechanism, mechanisms
from memattn.models.lm import CausalLM
from memattn.tasks import StepLoss, Task, refuse_language_model_settings, register_task
from memattn.train import step_seed
from memattn.typed import parse_key_value, parse_settings
from research.experiments._common import command_of, save_figure, torch_threads, write_results
from research.experiments._runner import Job, run_jobs

DESCRIPTION = ("recall at matched state size: MQAR and passkey (up to 64k tokens) accuracy of every "
               "causal mechanism")
NAME = "recall"


def _check_values(obj, fields, zero_ok: tuple[str, ...] = ()) -> None:
    """ConfigError naming the first of `fields` of `obj` with a value (or a list member) below
    zero, or zero unless its name is in `zero_ok`."""
    for f in fields:
        value = getattr(obj, f.name)
        values = value if isinstance(value, tuple) else (value,)
        ok = f.name in zero_ok
        if any(v < 0 or (v == 0 and not ok) for v in values):
            raise ConfigError(f"{f.name}: expected {'non-negative' if ok else 'positive'} values, got {value!r}")


def check_rows(batch: int, mqar_share: float) -> None:
    """ConfigError unless a batch of `batch` rows at `mqar_share` holds rows of both tasks."""
    if not 1 <= round(batch * mqar_share) < batch:
        raise ConfigError(f"batch: {batch} rows at mqar_share={mqar_share} leave no row to one of the two tasks")


@dataclass
class RecallOptions:
    """task_options of task=recall: the rows it trains on and how its models are tested."""

    length: int = 64  # tokens of a training row (both tasks); MQAR is tested at this length
    passkey_length: int = 0  # tokens of a passkey training row; 0: `length`
    pairs: int = 8  # MQAR key-value pairs a row; queries: (length - 2·pairs) / 2
    keys: int = 16  # MQAR key vocabulary
    values: int = 16  # MQAR value vocabulary
    digits: int = 5  # passkey digits
    filler: int = 16  # passkey filler vocabulary
    distances: tuple[int, ...] = (1024, 4096, 16384, 65536)  # passkey tests past training
    mqar_share: float = 0.75  # share of a step's rows that are MQAR (the passkey is learned sooner)
    mqar_test: int = 512  # MQAR test rows
    passkey_test: int = 16  # passkey test rows at each distance
    test_batch: int = 16  # rows read at once when streaming
    chunk: int = 512  # tokens read a call when streaming through a fixed-size state
    max_window: int = 65536  # longest window read at once by a growing state (softmax)

    def __post_init__(self) -> None:
        if not 0 < self.mqar_share < 1:
            raise ConfigError(f"mqar_share: expected a share strictly between 0 and 1, got {self.mqar_share!r}")
        _check_values(self, [f for f in dataclasses.fields(RecallOptions) if f.name != "mqar_share"],
                      zero_ok=("passkey_length",))
        queries, odd = divmod(self.length - 2 * self.pairs, 2)
        if self.pairs > self.keys or queries < 1 or odd:
            raise ConfigError(f"length: a row is {self.pairs} pairs (pairs <= keys = {self.keys}) and an "
                              f"even number >= 2 of query tokens; got length={self.length}, pairs={self.pairs}")
        if self.train_distance < 0:
            name = "passkey_length" if self.passkey_length else "length"
            raise ConfigError(f"{name}: a passkey of {self.digits} digits needs rows of at least "
                              f"{2 + 2 * self.digits} tokens, got {self.passkey_rows}")

    @property
    def passkey_rows(self) -> int:
        """Tokens of a passkey training row."""
        return self.passkey_length or self.length

    @property
    def longest(self) -> int:
        """Tokens of the longest training row (the models' max_len)."""
        return max(self.length, self.passkey_rows)

    @property
    def train_distance(self) -> int:
        """The longest passkey distance trained on (distances 0 ... this)."""
        return self.passkey_rows - 2 - 2 * self.digits

    @property
    def vocab(self) -> RecallVocab:
        return RecallVocab(digits=10, filler=self.filler, keys=self.keys, values=self.values)


@dataclass
class Settings(RecallOptions):
    """What the experiment runs; every field can be overridden as key=value (those of
    RecallOptions are each model's task_options)."""

    # the memories compared: `all` (every causal mechanism of the registry at its default
    # options), registry names, and NAME:KEY=VALUE;KEY=VALUE for a mechanism with options of its
    # own (its size option is the targets')
    mechanisms: tuple[str, ...] = ("all", "abc-mlp:recency=true", "abc-mlp:forget=true")
    state_bytes: tuple[int, ...] = (4096, 16384)  # targets: decoding-state bytes per layer
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    ff_mult: float = 2.0
    steps: int = 4000
    batch: int = 32  # rows a step: MQAR, then passkey
    lr: float = 3e-3  # AdamW, warm-up then cosine decay to a tenth
    warmup: int = 100
    weight_decay: float = 0.1
    log_every: int = 50
    save_every: int = 500
    seed: int = 0
    threads: int = 1  # torch threads of a model's worker

    def __post_init__(self) -> None:
        self.kinds  # noqa: B018 (a ConfigError for an entry it cannot read)
        options = {f.name for f in dataclasses.fields(RecallOptions)}
        own = [f for f in dataclasses.fields(self) if f.name not in options]
        _check_values(self, [f for f in own if f.name != "mechanisms"], zero_ok=("seed", "warmup", "weight_decay"))
        super().__post_init__()
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")
        check_rows(self.batch, self.mqar_share)

    @property
    def options(self) -> RecallOptions:
        return RecallOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RecallOptions)})

    @property
    def kinds(self) -> list[tuple[str, dict]]:
        """(registry name, options) of each memory `mechanisms` names, once, `all` in the
        registry's order; a ConfigError for an entry that is not a causal mechanism with options
        of its own."""
        causal = [n for n, m in mechanisms().items() if m.causal]
        out: list[tuple[str, dict]] = []
        for entry in self.mechanisms:
            name, _, rest = entry.partition(":")
            if entry == "all":
                out += [(n, {}) for n in causal if (n, {}) not in out]
                continue
            if name not in causal:
                raise ConfigError(f"mechanisms: {entry!r} is not all or a causal mechanism (one of "
                                  f"{', '.join(causal)}), optionally as NAME:KEY=VALUE;KEY=VALUE")
            options = {".".join(path): value for path, value in map(parse_key_value, filter(None, rest.split(";")))}
            size = get_mechanism(name).state_size
            if size is not None and (size.option in options or set(size.with_options) & set(options)):
                raise ConfigError(f"mechanisms: {entry!r} sets what the targets (state_bytes) set: "
                                  f"attention.{size.option}{''.join(f', {k}' for k in size.with_options)}")
            AttentionConfig(name, options)  # an unknown option or value: a ConfigError naming it
            out += [(name, options)] if (name, options) not in out else []
        return out


QUICK = {"state_bytes": (4096,), "d_model": 32, "length": 32, "pairs": 4,
         "digits": 3, "distances": (256,), "steps": 4, "batch": 8, "warmup": 2, "mqar_test": 16,
         "passkey_test": 4, "test_batch": 4, "chunk": 128, "log_every": 2, "save_every": 2}
# Settings that decide which models run, not what one model computes: left out of a job's
# settings, so that a run folder is reused whichever targets and mechanisms a command names.
PLANNING = ("mechanisms", "state_bytes")
# options added after run folders were made: a job names one only where it differs from this
# default, so that those folders (their settings.json) stay the same and are reused
LATER_OPTIONS = {"passkey_length": 0}
TEST_SEED = 1_000_003  # test rows: drawn from their own seeds, the same for every model
VALIDATION_SEED = 2_000_003  # the rows of the evaluation at the end of training
# values of a mechanism's state-size option (Mechanism.state_size) tried against the targets
SIZE_VALUES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
FILL = 2 * SIZE_VALUES[-1]  # tokens read at most to fill a fixed-size state (the longest window)


# ---------------------------------------------------------------------------------------------
# models and their state


def build_model(s: Settings, attention: AttentionConfig) -> CausalLM:
    """The experiment's causal LM with `attention` (rotary positions; weights from torch's
    global seed): the model of `model_settings(s)`."""
    cfg = ModelConfig(vocab_size=s.vocab.size, d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads,
                      ff_mult=s.ff_mult, positions="rotary", max_len=s.longest, attention=attention)
    return CausalLM(cfg)


def model_settings(s: Settings) -> list[str]:
    """`build_model`'s model as `memattn train` settings (its vocabulary comes from the task)."""
    return [f"model.d_model={s.d_model}", f"model.n_layers={s.n_layers}", f"model.n_heads={s.n_heads}",
            f"model.ff_mult={s.ff_mult}", "model.positions=rotary", f"model.max_len={s.longest}"]


@torch.no_grad()
def state_bytes(model: CausalLM, length: int) -> tuple[int, bool]:
    """(bytes of `model.init_cache(1)` once it holds what it keeps, whether every layer's state is
    fixed in size). A growing state: after one row of `length` tokens. A fixed-size one: after
    rows of `length` tokens until its bytes stop changing (a window longer than a row fills up),
    at most FILL tokens; one that cannot read further (a ShapeError: its positions end) holds
    all it ever will."""
    cache = model.init_cache(1)
    row = torch.zeros(1, length, dtype=torch.long)
    model.hidden(row, cache=cache)
    before, read = None, length
    while cache.fixed_size and cache.nbytes() != before and read < FILL:
        before = cache.nbytes()
        try:
            model.hidden(row, cache=cache)
        except ShapeError:
            break
        read += length
    return cache.nbytes(), cache.fixed_size


def plan(s: Settings) -> tuple[list[dict], list[dict]]:
    """(models, skipped). A model: {"mechanism", "options", "kind" (the mechanism and the
    options of its own that s.mechanisms gives it), "name", "targets" (the targets of
    s.state_bytes it stands for: all of them where no option sizes it), "state_bytes_per_layer",
    "size_option" (None: no option sizes it), "sizing" (how its size was chosen, in words)}; a
    skipped memory: {"mechanism", "kind", "reason"}. Every memory of `s.kinds` is in one of the
    lists."""
    planned, skipped = [], []
    for name, own in s.kinds:
        size = get_mechanism(name).state_size
        kind = " ".join([name, *(f"{k}={v}" for k, v in own.items())])
        try:
            if size is None or size.option is None:
                options = {**(size.with_options if size is not None else {}), **own}
                nbytes, fixed = state_bytes(build_model(s, AttentionConfig(name, options)), s.length)
                if not fixed:
                    sizing = "its state grows with every token and no option sizes it: the ceiling, read whole"
                else:
                    sizing = size.why if size is not None and size.why else \
                        "no option sizes its state (Mechanism.state_size): its default options"
                planned.append({"mechanism": name, "options": options, "kind": kind,
                                "name": row_name(name, options, own), "targets": list(s.state_bytes),
                                "state_bytes_per_layer": nbytes / s.n_layers, "size_option": None,
                                "sizing": sizing})
                continue
            sized = sizes_of(s, name, size, own)
        except (ConfigError, ShapeError) as e:
            skipped.append({"mechanism": name, "kind": kind, "reason": f"cannot be built or read on this task: {e}"})
            continue
        if not sized:
            skipped.append({"mechanism": name, "kind": kind, "reason": f"no value of attention.{size.option} in "
                            f"{SIZE_VALUES[0]} ... {SIZE_VALUES[-1]} gives a fixed-size state on this task"})
            continue
        chosen: dict[int, list[int]] = {}
        for target in s.state_bytes:
            value = min(sized, key=lambda v: (abs(math.log(sized[v] / target)), v))
            chosen.setdefault(value, []).append(target)
        for value, targets in sorted(chosen.items()):
            options = {**size.sized(value, s.longest), **own}
            planned.append({"mechanism": name, "options": options, "kind": kind,
                            "name": row_name(name, options, own), "targets": targets,
                            "state_bytes_per_layer": sized[value], "size_option": size.option,
                            "sizing": f"attention.{size.option} closest to the target"})
    return planned, skipped


def row_name(mechanism: str, options: dict, own: dict) -> str:
    """A model's row name: the mechanism, then its size option and the options that follow from
    it, and its options of its own (`own`)."""
    size = get_mechanism(mechanism).state_size
    return " ".join([mechanism, *(f"{k}={v}" for k, v in options.items()
                                  if k in own or (size is not None and k not in size.with_options))])


def sizes_of(s: Settings, name: str, size: StateSize, own: dict) -> dict[int, float]:
    """{value of size.option: state bytes per layer} over SIZE_VALUES, for the values whose
    model (with options `own` besides) builds, reads a training row and keeps a fixed-size state
    of some bytes; values in increasing order until one's state is 4 times the largest target."""
    out = {}
    for value in SIZE_VALUES:
        options = {**size.sized(value, s.longest), **own}
        try:
            nbytes, fixed = state_bytes(build_model(s, AttentionConfig(name, options)), s.length)
        except (ConfigError, ShapeError):
            continue
        if fixed and nbytes > 0:
            out[value] = nbytes / s.n_layers
            if out[value] > 4 * max(s.state_bytes):
                break
    return out


# ---------------------------------------------------------------------------------------------
# the task and its jobs: one run folder a model


class RecallBatch(NamedTuple):
    """A step's rows of each task, (tokens, answers): MQAR [m, length], passkeys [b - m,
    passkey rows]."""

    mqar: tuple[torch.Tensor, torch.Tensor]
    passkey: tuple[torch.Tensor, torch.Tensor]

    def to(self, device) -> RecallBatch:
        return RecallBatch(*(tuple(t.to(device) for t in part) for part in self))

    def rows(self, start: int, stop: int) -> RecallBatch:
        """Rows start:stop of the batch, counted over the MQAR rows, then the passkeys."""
        m = len(self.mqar[0])
        return RecallBatch(tuple(t[start:stop] for t in self.mqar),
                           tuple(t[max(start - m, 0):max(stop - m, 0)] for t in self.passkey))


def training_batch(o: RecallOptions, batch: int, seed: int, step: int) -> RecallBatch:
    """Step `step`'s `batch` rows (the same for every model): m = batch · mqar_share (rounded)
    MQAR rows of o.length tokens, then passkeys at distances uniform in 0 ... o.train_distance
    in rows of o.passkey_rows tokens."""
    g = torch.Generator().manual_seed(step_seed(seed, step))
    m = round(batch * o.mqar_share)
    a = mqar_batch(m, length=o.length, pairs=o.pairs, vocab=o.vocab, generator=g)
    distance = torch.randint(0, o.train_distance + 1, (batch - m,), generator=g)
    b = passkey_batch(batch - m, distance=distance, digits=o.digits, vocab=o.vocab, generator=g,
                      length=o.passkey_rows)
    return RecallBatch(a, b)


class RecallTask(Task):
    """task=recall: a causal LM (`memattn.models.CausalLM`) on rows of MQAR and passkey
    retrieval (task_options: `RecallOptions`). The loss of a step is the mean of the two
    tasks' answer losses (each the mean over its answers), the rows of each rank on their
    own; the evaluation, MQAR accuracy on train.eval_batches × test_batch rows of their own."""

    Options = RecallOptions
    logged = ("mqar_accuracy",)

    @classmethod
    def check_config(cls, cfg) -> None:
        refuse_language_model_settings(cfg)
        check_rows(cfg.train.batch_size, cfg.task_settings.mqar_share)

    @classmethod
    def build_model(cls, cfg) -> CausalLM:
        return CausalLM(cfg.model)

    @classmethod
    def prepare(cls, cfg, ddp, resume: bool, source) -> RecallTask:
        from memattn.train import with_vocab_size

        if source is not None:
            raise ConfigError("train.init_from: task=recall trains its models from their initialisation")
        return cls(with_vocab_size(cfg, cfg.task_settings.vocab.size))

    def __init__(self, cfg) -> None:
        self.cfg, self.options = cfg, cfg.task_settings

    def batch(self, step: int, rank: int, world: int) -> RecallBatch:
        tc = self.cfg.train
        share = tc.batch_size // world
        return training_batch(self.options, tc.batch_size, tc.seed, step).rows(rank * share, (rank + 1) * share)

    def tokens(self, batch: RecallBatch) -> int:
        return sum(tokens.numel() for tokens, _ in batch)

    def loss(self, model, batch: RecallBatch) -> StepLoss:
        parts = [answer_loss(model(tokens), tokens, answers) for tokens, answers in batch if len(tokens)]
        return StepLoss(sum(parts) / len(parts), 1)  # a mean already: one "position"

    def evaluate(self, model, device) -> dict[str, float]:
        tc = self.cfg.train
        was = model.training
        model.eval()
        accuracy = mqar_accuracy(model, self.options, VALIDATION_SEED + tc.seed,
                                 (tc.eval_batches or 1) * self.options.test_batch, device)
        model.train(was)
        return {"mqar_accuracy": accuracy}

    def meta(self) -> dict:
        from memattn.data import Vocab

        # the token ids, named by stand-in characters: what a checkpoint's vocabulary records
        return {"vocab": Vocab("char", [chr(0x100 + i) for i in range(self.options.vocab.size)]).to_json(),
                "corpus": NAME}


register_task(NAME, "MQAR and passkey retrieval rows (research.experiments.recall)",
              "research.experiments.recall:RecallTask")


def job_of(s: Settings, planned: dict) -> Job:
    """A model's job: the `memattn train` settings of task=recall with s's options, model and
    training, then its attention."""
    options = [f"task_options.{k}={json.dumps(list(v) if isinstance(v, tuple) else v)}"
               for k, v in dataclasses.asdict(s.options).items() if k not in LATER_OPTIONS or v != LATER_OPTIONS[k]]
    train = [f"train.steps={s.steps}", f"train.batch_size={s.batch}", f"train.seq_len={s.longest}",
             f"train.lr={s.lr}", f"train.warmup={min(s.warmup, s.steps)}", "train.min_lr_ratio=0.1",
             f"train.weight_decay={s.weight_decay}", "train.betas=[0.9,0.98]", "train.grad_clip=1.0",
             f"train.log_every={s.log_every}", f"train.save_every={s.save_every}", f"train.eval_every={s.steps}",
             "train.eval_batches=1", f"train.seed={s.seed}", f"train.threads={s.threads}"]
    attention = [f"attention.name={planned['mechanism']}",
                 *(f"attention.{k}={json.dumps(v)}" for k, v in planned["options"].items())]
    return Job(planned["name"], (f"task={NAME}", *options, *model_settings(s), *train, *attention))


def measure(model: CausalLM, cfg, run_dir: Path) -> dict:
    """A trained model's figures (`_runner.Measure`): its state, MQAR accuracy on the test
    rows, the passkey at the training distance and past it."""
    o, seed = cfg.task_settings, cfg.train.seed
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    nbytes, fixed = state_bytes(model, o.length)
    start = time.perf_counter()
    row = {"mechanism": cfg.model.attention.name, "options": dict(cfg.model.attention.options),
           "final_loss": log[-1] if log else None,
           "state_bytes": nbytes, "state_bytes_per_layer": nbytes / cfg.model.n_layers, "fixed_size": fixed,
           "mqar_accuracy": mqar_accuracy(model, o, TEST_SEED + seed, o.mqar_test),
           "passkey": [passkey_accuracy(model, o, seed, d) for d in (o.train_distance, *o.distances)]}
    row["eval_s"] = round(time.perf_counter() - start, 1)
    return row


# ---------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def mqar_accuracy(model: CausalLM, o: RecallOptions, seed: int, rows: int, device="cpu") -> float:
    """Share of the answers of `rows` fresh MQAR rows of the training length (drawn from
    `seed`) predicted right (one forward pass a batch of o.test_batch rows)."""
    g = torch.Generator().manual_seed(seed)
    hits = total = 0
    for start in range(0, rows, o.test_batch):
        tokens, answers = mqar_batch(min(o.test_batch, rows - start), length=o.length, pairs=o.pairs,
                                     vocab=o.vocab, generator=g)
        hits += int(answer_hits(model(tokens.to(device)).cpu(), tokens, answers).sum())
        total += int(answers.sum())
    return hits / total


class NotRead(Exception):
    """A row the model cannot read (a window too long, a limit of the mechanism)."""


WINDOW_TOKENS = 131_072  # tokens a window read takes at once (rows × length), to bound memory


@torch.no_grad()
def read_tail(model: CausalLM, tokens: torch.Tensor, keep: int, o: RecallOptions) -> tuple[torch.Tensor, str, int]:
    """Logits [B, keep, V] of the last `keep` positions of tokens [B, T], how they were read
    ("stream" or "window") and the decoding state's bytes per row at the end.

    stream (every layer's state fixed in size): the first T - keep tokens in calls of o.chunk
    tokens through one cache, then the last `keep`. window (a growing state): each group of rows
    in one call, if T <= o.max_window. Raises NotRead otherwise, or when the mechanism meets a
    limit of its own (ShapeError) while reading.
    """
    B, T = tokens.shape
    stream = model.init_cache(1).fixed_size
    try:
        if stream:
            cache = model.init_cache(B)
            for start in range(0, T - keep, o.chunk):
                model.hidden(tokens[:, start:min(start + o.chunk, T - keep)], cache=cache)
            return model.head(model.hidden(tokens[:, T - keep:], cache=cache)), "stream", cache.nbytes() // B
        if T > o.max_window:
            raise NotRead(f"a window of {T:,} tokens exceeds max_window={o.max_window:,}")
        rows = max(1, WINDOW_TOKENS // T)
        out, nbytes = [], 0
        for start in range(0, B, rows):
            cache = model.init_cache(min(rows, B - start))
            hidden = model.hidden(tokens[start:start + rows], cache=cache)
            out.append(model.head(hidden[:, T - keep:]))
            nbytes = cache.nbytes() // len(out[-1])
        return torch.cat(out), "window", nbytes
    except ShapeError as e:
        raise NotRead(str(e)) from None


def passkey_accuracy(model: CausalLM, o: RecallOptions, seed: int, distance: int) -> dict:
    """{"distance", "tokens" (a row's length), "accuracy" (share of o.passkey_test rows with every
    digit right), "digit_accuracy", "read", "state_bytes" (per row, at the end), "note"}; a row
    that cannot be read gives accuracy None, read None and the reason in "note"."""
    g = torch.Generator().manual_seed(TEST_SEED + seed + 7 * distance)
    keep = o.digits + 1  # the query marker and the digits: the logits that predict the answers
    result = {"distance": distance, "tokens": 2 + 2 * o.digits + distance, "accuracy": None,
              "digit_accuracy": None, "read": None, "state_bytes": None, "note": ""}
    right = digits = 0
    for start in range(0, o.passkey_test, o.test_batch):
        tokens, answers = passkey_batch(min(o.test_batch, o.passkey_test - start), distance=distance,
                                        digits=o.digits, vocab=o.vocab, generator=g)
        try:
            logits, read, nbytes = read_tail(model, tokens, keep, o)
        except NotRead as e:
            return {**result, "note": f"not read: {e}"}
        hits = answer_hits(logits, tokens[:, -keep:], answers[:, -keep:])  # [b, keep]
        right += int((hits.sum(1) == o.digits).sum())
        digits += int(hits.sum())
        result.update(read=read, state_bytes=nbytes)
    return {**result, "accuracy": right / o.passkey_test, "digit_accuracy": digits / (o.passkey_test * o.digits)}


# ---------------------------------------------------------------------------------------------
# the experiment


def run(out_dir: Path, *, quick: bool = False, overrides: list[str] = (), jobs: int = 1) -> dict:
    """Size, train (or reuse, or resume) and evaluate a model per mechanism and state size,
    `jobs` at a time; write the results under out_dir."""
    s = parse_settings(Settings, list(overrides), QUICK if quick else {}, name=NAME)
    out_dir = Path(out_dir)
    with torch_threads(s.threads):
        planned, skipped = plan(s)
    if not planned:
        raise ConfigError("mechanisms: no mechanism left to train: " + "; ".join(
            f"{p['kind']}: {p['reason']}" for p in skipped))
    job_list = [job_of(s, p) for p in planned]

    def report(rows: dict[str, dict]) -> dict:
        done = [{**rows[p["name"]], "kind": p["kind"], "targets": p["targets"], "size_option": p["size_option"], "sizing": p["sizing"],
                 "streams": mechanisms()[p["mechanism"]].streams(
                     AttentionConfig(p["mechanism"], p["options"]).typed)}
                for p in planned if p["name"] in rows]
        results = {"experiment": NAME, "quick": quick, "command": command_of(out_dir, NAME, quick, overrides),
                   "settings": dataclasses.asdict(s), "train_distance": s.train_distance,
                   "passkey_rows": s.passkey_rows,
                   "vocab_size": s.vocab.size, "finished": len(done), "runs_planned": len(planned),
                   "rows": done, "skipped": skipped,
                   "environment": {"torch": torch.__version__, "threads": s.threads,
                                   "machine": platform.machine()}}
        write_results(out_dir, results, render_markdown(results))
        plot(results, out_dir / "recall.png")
        return results

    rows = run_jobs(out_dir, job_list, measure, workers=jobs, label=NAME, on_rows=report)
    return report({row["model"]: row for row in rows})


# ---------------------------------------------------------------------------------------------
# the table and the figure


def kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def cell(p: dict, notes: list[str]) -> str:
    """A passkey figure: accuracy, or "not read" with a footnote number."""
    if p["accuracy"] is not None:
        return f"{p['accuracy']:.2f}"
    if p["note"] not in notes:
        notes.append(p["note"])
    return f"not read [{notes.index(p['note']) + 1}]"


def rows_text(results: dict) -> str:
    """The training rows' length, in words."""
    length, passkey = results["settings"]["length"], results["passkey_rows"]
    return (f"rows of {length:,} tokens" if passkey == length else
            f"MQAR rows of {length:,} tokens, passkey rows of {passkey:,}")


def render_markdown(results: dict) -> str:
    s, rows = results["settings"], results["rows"]
    distances = [results["train_distance"], *s["distances"]]
    queries = (s["length"] - 2 * s["pairs"]) // 2
    train_s = sum(r["train_s"] for r in rows)
    lines = [
        "# Recall at matched state size: what each memory keeps",
        "",
        f"Command: `{results['command']}`",
        "",
        f"**Seeds:** one per model, seed {s['seed']} (weights, training rows); test rows from their own "
        f"seeds, the same for every model. **Budget:** {s['steps']:,} steps × {s['batch']} rows per model "
        f"({s['mqar_share']:.0%} MQAR, the rest passkey; {rows_text(results)}), AdamW lr {s['lr']:g} (warm-up "
        f"{s['warmup']}, cosine to a tenth), {s['threads']} thread(s) a model; {results['finished']} of "
        f"{results['runs_planned']} models trained, {train_s / 60:,.1f} min of training in all.",
        "",
        f"Models: causal LMs, d_model {s['d_model']}, {s['n_layers']} layers, {s['n_heads']} heads, "
        f"feed-forward ×{s['ff_mult']:g}, rotary positions, vocabulary {results['vocab_size']}. "
        f"MQAR: {s['pairs']} key-value pairs (keys distinct, of {s['keys']}; values of {s['values']}) then "
        f"{queries} queries in rows of {s['length']} tokens; accuracy over the queries' values of "
        f"{s['mqar_test']} test rows (chance {1 / s['values']:.3f}). Passkey: {s['digits']} digits, "
        f"filler of {s['filler']} tokens, trained at distances 0 … {results['train_distance']}; accuracy = "
        f"share of {s['passkey_test']} test rows per distance with every digit right (teacher forcing). "
        f"Bounded states stream in calls of {s['chunk']} tokens; softmax reads one window of up to "
        f"{s['max_window']:,} tokens. State bytes: `model.init_cache(1)` once it holds what it keeps (a growing "
        "cache: after one training row), per layer; targets (bytes per layer) pick each mechanism's size "
        "option closest to them.",
        "",
    ]
    if results["quick"]:
        lines.insert(2, "**Quick smoke run: too small for its numbers to mean anything.**\n")
    notes: list[str] = []
    head = ["mechanism", "options", "state / layer", "targets", "streams (registry)", "MQAR",
            *(f"passkey {d:,}" + (" (trained)" if i == 0 else "") for i, d in enumerate(distances))]
    lines += ["## Accuracy against distance", "", "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["kind"], r["state_bytes"])):
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items()) or "defaults"
        size = kib(r["state_bytes_per_layer"])
        if not r["fixed_size"]:
            longest = max((p for p in r["passkey"] if p["state_bytes"]), key=lambda p: p["tokens"], default=None)
            size += f" at {s['length']} tokens, growing" + (
                f" ({kib(longest['state_bytes'] / s['n_layers'])} at {longest['tokens']:,})"
                if longest and longest["tokens"] > s["length"] else "")
        targets = ", ".join(kib(t) for t in r["targets"]) if r["size_option"] else "its one size"
        lines.append(f"| {r['mechanism']} | {opts} | {size} | {targets} | "
                     f"{'yes' if r['streams'] else 'no'} | {r['mqar_accuracy']:.3f} | "
                     + " | ".join(cell(p, notes) for p in r["passkey"]) + " |")
    for k in results["skipped"]:
        lines.append(f"| {k['kind']} | skipped: {k['reason']} |" + " |" * (len(head) - 2))
    lines += ["", *(f"[{i + 1}] {note}" for i, note in enumerate(notes)), ""]

    targets = s["state_bytes"]
    lines += ["## MQAR accuracy against state bytes", "",
              "Each cell: accuracy (state bytes per layer) of the model sized for the target.", "",
              "| mechanism | " + " | ".join(f"target {kib(t)}" for t in targets) + " |",
              "|---|" + "---|" * len(targets)]
    for name in sorted({r["kind"] for r in rows}):
        cells = []
        for t in targets:
            r = next((r for r in rows if r["kind"] == name and t in r["targets"]), None)
            cells.append("—" if r is None else f"{r['mqar_accuracy']:.3f} ({kib(r['state_bytes_per_layer'])})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", *findings(results), "",
              "Figure: `recall.png` (passkey accuracy against distance, the largest state of each "
              "mechanism; MQAR accuracy against state bytes per layer). Every row's figures, losses and "
              "state bytes per distance in `results.json`; each model's run folder under `runs/`.", ""]
    return "\n".join(lines)


def findings(results: dict) -> list[str]:
    """What the literature reports next to what this run measured (only what was measured)."""
    rows, s = results["rows"], results["settings"]
    lines = ["## The literature found / we measured", ""]
    ceiling = [r for r in rows if not r["fixed_size"]]
    bounded = [r for r in rows if r["fixed_size"]]
    if ceiling and bounded:
        base = max(ceiling, key=lambda r: r["mqar_accuracy"])
        per_target = []
        for t in s["state_bytes"]:
            at = [r for r in bounded if t in r["targets"]]
            if at:
                best = max(at, key=lambda r: r["mqar_accuracy"])
                per_target.append(f"at {kib(t)} per layer the best bounded memory is {best['model']} "
                                  f"({best['mqar_accuracy']:.3f}, {len(at)} compared)")
        lines.append("- **Recall needs state.** Arora et al. (Zoology, 2023; Based, 2024) report that "
                     "softmax attention solves MQAR where fixed-state mechanisms fall behind, and that "
                     "their recall grows with their state size. We measured: "
                     f"{base['model']} (growing cache, {kib(base['state_bytes_per_layer'])} per layer at "
                     f"{s['length']} tokens) {base['mqar_accuracy']:.3f}; " + "; ".join(per_target) + ".")
    grown = {}
    for r in bounded:
        grown.setdefault(r["kind"], []).append(r)
    pairs = [sorted(v, key=lambda r: r["state_bytes"]) for v in grown.values() if len(v) > 1]
    if pairs:
        up = [v for v in pairs if v[-1]["mqar_accuracy"] > v[0]["mqar_accuracy"]]
        lines.append(f"- **More state, more recall.** We measured MQAR higher at the larger state for "
                     f"{len(up)} of the {len(pairs)} memories (a mechanism with its options) with several sizes"
                     + (f" (not for {', '.join(v[0]['kind'] for v in pairs if v not in up)})"
                        if len(up) < len(pairs) else "") + ".")
    far = max(s["distances"]) if s["distances"] else None
    if far is not None:
        held, lost, unread = [], [], []
        for r in rows:
            p = next(p for p in r["passkey"] if p["distance"] == far)
            (unread if p["accuracy"] is None else held if p["accuracy"] >= 0.9 else lost).append((r, p))
        text = (f"- **Passkey at {far:,} tokens** (trained up to {results['train_distance']:,}). We measured: "
                f"{len(held)} of {len(rows)} models keep it (accuracy ≥ 0.9)"
                + (f": {', '.join(r['model'] for r, _ in held)}" if held else "")
                + f"; {len(lost)} lose it; {len(unread)} cannot read that far.")
        declared = [(r, p) for r, p in held + lost if r["streams"]]
        if declared:
            text += (" Declared streaming in the registry: " + ", ".join(
                f"{r['model']} {p['accuracy']:.2f}" for r, p in declared) + ".")
        lines.append(text)
    return lines


def plot(results: dict, path: Path) -> None:
    """recall.png: passkey accuracy against distance (log x, one line per mechanism, its largest
    state) and MQAR accuracy against state bytes per layer (log x, one line per mechanism)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = results["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["kind"], []).append(r)
    colors = plt.get_cmap("tab20").colors
    for i, (name, group) in enumerate(sorted(by.items())):
        group.sort(key=lambda r: r["state_bytes"])
        largest = group[-1]
        style = {"color": colors[i % len(colors)], "marker": "*" if not largest["fixed_size"] else "osD^v"[i % 5],
                 "linestyle": "-" if i < len(colors) else "--"}
        points = [(max(p["distance"], 1), p["accuracy"]) for p in largest["passkey"] if p["accuracy"] is not None]
        if points:
            x, y = zip(*points)
            left.plot(x, y, label=f"{largest['model']}", **style)
        right.plot([r["state_bytes_per_layer"] for r in group], [r["mqar_accuracy"] for r in group],
                   label=name, **style)
    left.axvline(max(results["train_distance"], 1), color="gray", linestyle="--", linewidth=1)
    left.set_xscale("log")
    left.set(title="passkey (dashed: longest distance trained)", xlabel="distance (filler tokens)",
             ylabel="accuracy (every digit right)", ylim=(-0.05, 1.05))
    right.set_xscale("log")
    right.set(title="MQAR at the training length", xlabel="decoding state, bytes per layer",
              ylabel="accuracy", ylim=(-0.05, 1.05))
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=6, ncol=2)
    right.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)
