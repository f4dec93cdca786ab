"""What every attention layer shares: its build spec, its decoding state, and the registry.

A mechanism is a write rule (how the memory is built from the sequence) and a read rule
(how a query reads it). A layer registers under a config string; models look the string up
and never change when a mechanism is added.

Layer interface (all mechanisms)::

    layer = build_attention(config, spec)
    y, state = layer(x, memory_state=None, attention_mask=None)   # x, y [B, T, d]
    state = layer.init_state(batch_size, device=..., dtype=...)    # empty decoding state

With `memory_state` given, the layer continues after the tokens the state has seen and
returns the updated state; token-by-token decoding must equal one full forward pass.

Padding (one convention for every layer): `attention_mask` is bool [B, T] over the tokens
of x only, True for real tokens, at prefill and at every decoding step alike (a state keeps
what it needs of earlier masks). Padding writes nothing into any memory, and its own outputs
are defined (finite) but meaningless. `positions` [B, T] int64 (optional) gives each token's
position counted over its row's real tokens, as a model derives it from the mask; without
it tokens sit at seen, seen + 1, ... of the state. Left-padded rows then give exactly the
result of each row alone.

`register` also declares what the mechanism can do (the fields of `Mechanism`: causal,
bidirectional, cross attention, convertible, streaming, a fixed state, ...). Memory tokens
(optional): a mechanism that reads learned tokens placed in the sequence (GMAT's global
memory) declares `memory_layout(options, causal)` returning a `MemoryLayout`. The model then
inserts those tokens into the sequence every layer sees (and strips them from its output); a
layer without it sees only the tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from memattn.errors import ConfigError, ShapeError, check_tensor
from memattn.layers.positions import Rotary
from memattn.typed import coerce


@dataclass
class LayerSpec:
    """Everything a model tells an attention layer about where it sits."""

    d_model: int
    n_heads: int
    causal: bool = True
    layer_idx: int = 0
    n_layers: int = 1
    max_len: int = 1024
    positions: str = "none"  # "rotary" rotates q/k inside the layer; others are the model's
    dropout: float = 0.0
    # Parameters shared between the layers of one model (e.g. a tied φ-MLP), keyed by name.
    shared: dict[str, nn.Module] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.n_heads < 1 or self.d_model < 1 or self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model: {self.d_model} is not divisible by model.n_heads={self.n_heads} "
                              "(every head gets d_model / n_heads channels)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def check_mask(mask: torch.Tensor | None, B: int, T: int, name: str = "attention_mask") -> None:
    """ShapeError unless `mask` (called `name` in the message) is None or bool [B, T]."""
    if mask is None:
        return
    check_tensor(name, mask, "[B, T]", B, T)
    if mask.dtype != torch.bool:
        raise ShapeError(f"{name}: expected dtype torch.bool, got {mask.dtype}")


class AttentionLayer(nn.Module):
    """What every self-attention layer builds the same way: one q/k/v projection (`qkv`, q
    rows first, then k, then v), the output projection (`out`), rotary positions when
    spec.positions == "rotary", output dropout, and the checks of its inputs.

    kv_heads (default n_heads): heads of keys and values, each head_dim wide (fewer than
    n_heads when some heads read something else, e.g. persistent memory's head-split).
    """

    def __init__(self, spec: LayerSpec, *, bias: bool = False, kv_heads: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.kv_heads = spec.n_heads if kv_heads is None else kv_heads
        D = spec.head_dim
        self.qkv = nn.Linear(spec.d_model, spec.d_model + 2 * self.kv_heads * D, bias=bias)
        self.out = nn.Linear(spec.d_model, spec.d_model, bias=bias)
        self.rotary = Rotary(D) if spec.positions == "rotary" else None
        self.dropout = nn.Dropout(spec.dropout)
        # Optional per-head norms of queries and keys before positions (e.g. a converted
        # Qwen3's), each over the head dim; None: none.
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None

    def project(self, x: torch.Tensor, memory_state: AttentionState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                *, rotate: bool = True) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Check x [B, T, d] and attention_mask [B, T]; return (offset, q [B, T, H, D],
        k, v [B, T, kv_heads, D]).

        offset: the tokens `memory_state` has seen. With `rotate`, q and k are rotated at
        `positions` [B, T] when given, else at offset, offset + 1, ... (see `rotate`).
        """
        check_tensor("x", x, "[B, T, d]", None, None, self.spec.d_model)
        w = self.qkv.weight
        if x.device != w.device:
            raise ShapeError(f"x: expected a tensor on the layer's device ({w.device}), got one on {x.device}")
        if not x.is_floating_point() or (x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type)):
            raise ShapeError(f"x: expected the layer's dtype ({w.dtype}), got {x.dtype}; convert the "
                             "input or the layer (layer.to(dtype))")
        B, T, _ = x.shape
        check_mask(attention_mask, B, T)
        if memory_state is not None:
            self.check_state(memory_state)
        offset = memory_state.seen if memory_state is not None else 0
        H, Hk, D = self.spec.n_heads, self.kv_heads, self.spec.head_dim
        q, k, v = self.qkv(x).split([H * D, Hk * D, Hk * D], dim=-1)
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hk, D), v.view(B, T, Hk, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotate:
            q, k = self.rotate(q, k, positions if positions is not None else offset)
        return offset, q, k, v

    def check_state(self, memory_state: AttentionState) -> None:
        """ShapeError naming memory_state unless it is of the class this layer's `init_state`
        makes (found once, on the meta device): another mechanism's state is a caller's slip."""
        want = getattr(self, "_state_class", None)
        if want is None:
            try:
                want = type(self.init_state(1, device="meta"))
            except Exception:  # a state that cannot be made without data: checked by its op
                want = AttentionState
            self._state_class = want
        if not isinstance(memory_state, want):
            raise ShapeError(f"memory_state: expected a {want.__name__} (what this layer's init_state "
                             f"makes), got {type(memory_state).__name__}")

    def rotate(self, q: torch.Tensor, k: torch.Tensor, at: torch.Tensor | int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated at positions `at` ([B, T], or the first token's position); as they
        are without rotary positions."""
        if self.rotary is None:
            return q, k
        q, k = self.rotary.rotate((q, k), at)
        return q, k

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, D] -> y [B, T, d]: output projection and dropout."""
        B, T = o.shape[:2]
        return self.dropout(self.out(o.reshape(B, T, -1)))


def real_positions(before: torch.Tensor | None, offset: int, attention_mask: torch.Tensor | None,
                   B: int, T: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The padding contract's positions: (positions [B, T] of T new tokens counted over each
    row's real tokens, real tokens per row [B] after them), both None while no row was ever
    padded (tokens then sit at offset, offset + 1, ...).

    before [B]: each row's real tokens so far (None: `offset` each, or no mask yet);
    attention_mask [B, T] bool over the new tokens (None: all real). Padding before a row's
    first real token sits at 0.
    """
    if attention_mask is None and before is None:
        return None, None
    if before is None:
        before = torch.full((B,), offset, dtype=torch.long, device=device)
    if attention_mask is None:
        counted = torch.arange(1, T + 1, device=before.device).expand(B, T)
    else:
        counted = attention_mask.long().cumsum(1)  # [B, T] real tokens up to each token
    return (before[:, None] + counted - 1).clamp_min(0), before + counted[:, -1]


class AttentionState:
    """A layer's decoding state. `fixed_size` says whether it stays the same size as it reads."""

    fixed_size: ClassVar[bool] = True
    seen: int = 0  # tokens consumed so far

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def map_tensors(self, fn: Callable[[torch.Tensor, bool], torch.Tensor]) -> None:
        """Replace each tensor t of the state by fn(t, batched), in place; batched says whether
        dim 0 of t is the batch (row b of t belongs to sequence b). Every state implements it:
        reordering, selecting and moving caches build on it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement map_tensors")

    @property
    def can_crop(self) -> bool:
        """Whether `crop` can forget the last tokens: only a state that keeps every token apart
        (a bounded memory has mixed them into its summary)."""
        return False

    def crop(self, length: int) -> None:
        """Forget every token after the first `length` (0 <= length <= seen)."""
        if not self.can_crop:
            raise ConfigError(f"crop: {type(self).__name__} holds a summary of its tokens and cannot "
                              "forget the last ones")
        if not 0 <= length <= self.seen:
            raise ConfigError(f"crop: expected a length in 0 .. {self.seen} (the tokens held), got {length}")
        self.seen = length

    def nbytes(self) -> int:
        """Bytes held by the state now (for a growing cache: its used part)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # Segment-level training (train.segments) carries one state from a step to the next. A
    # state that can be carried keeps only detached tensors, is bounded (fixed_size), sets
    # `carries_segments` and round-trips through state_dict / load_state_dict (checkpoints).
    carries_segments: ClassVar[bool] = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} cannot be carried between training segments")

    def load_state_dict(self, tensors: dict[str, torch.Tensor], seen: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be carried between training segments")


class KVCache(AttentionState):
    """Every key and value seen, [B, T, H, D] each, and which of them are real tokens: the
    memory of softmax attention (and of persistent memory's context).

    limit None: every token is kept, storage grows by doubling (appending one token is
    amortised O(1)). limit L: at most the last L tokens are kept, so the state has a fixed
    size. Tensors are stored detached, so a bounded cache can be carried from one training
    segment to the next.
    """

    carries_segments = True  # when bounded (fixed_size)

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.seen = 0
        self._t: dict[str, torch.Tensor] = {}  # "k", "v", "real" ([B, capacity] bool), kept alike
        self._len = 0
        self.masked = False  # whether any token came with a mask (then keys may be padding)

    @property
    def fixed_size(self) -> bool:  # type: ignore[override]
        return self.limit is not None

    def update(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append k [B, T, H, K], v [B, T, H, V] and which of them are real tokens (real [B, T]
        bool, None: all) to an unbounded cache; return every key and value so far and the mask
        of real keys [B, Tk] (None while every key is real). The new keys and values keep
        their gradient (the stored copies are detached)."""
        if self.limit is not None:
            raise ConfigError("KVCache.update: a bounded cache drops tokens; read it with past() and append()")
        before = self.past()
        self.append(k, v, real=real)
        mask = self.real() if self.masked else None
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            if before is not None:
                k, v = torch.cat([before[0], k], 1), torch.cat([before[1], v], 1)
            return k, v, mask
        return (*self.past(), mask)

    def past(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept keys and values, ([B, T0, H, K], [B, T0, H, V]), or None when empty."""
        if not self._t:
            return None
        return self._t["k"][:, :self._len], self._t["v"][:, :self._len]

    def real(self) -> torch.Tensor | None:
        """[B, T0] bool: which kept keys are real tokens (not padding); None when empty."""
        return self._t["real"][:, :self._len] if self._t else None

    def append(self, k: torch.Tensor, v: torch.Tensor, keep: int | None = None,
               real: torch.Tensor | None = None) -> None:
        """Add the newest k [B, T, H, K], v [B, T, H, V] (real [B, T] bool, None: all real);
        keep the last min(keep, limit)."""
        self.masked = self.masked or real is not None
        new = {"k": k.detach(), "v": v.detach(),
               "real": real if real is not None else torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)}
        self.seen += k.shape[1]
        if self.limit is not None:
            keep = self.limit if keep is None else min(keep, self.limit)
        if keep is None and not torch.is_grad_enabled():
            self._write_in_place(new)
            return
        if self._t:
            new = {name: torch.cat([self._t[name][:, :self._len], t], 1) for name, t in new.items()}
        if keep is not None:
            start = max(0, new["k"].shape[1] - keep)
            new = {name: t[:, start:].contiguous() for name, t in new.items()}
        self._t, self._len = new, new["k"].shape[1]

    def grows_in_place(self, keep: int | None) -> bool:
        """Whether `append(.., keep)` writes into the storage without copying it (unbounded
        decoding, no gradient)."""
        keep = self.limit if keep is None else keep
        return keep is None and not torch.is_grad_enabled()

    def _write_in_place(self, new: dict[str, torch.Tensor]) -> None:
        """Unbounded decoding: amortised O(1) per token (the storage doubles when full)."""
        need = self._len + new["k"].shape[1]
        if not self._t:
            self._t = {name: _storage(t, t.shape[1]) for name, t in new.items()}
        elif need > self._t["k"].shape[1]:
            cap = max(need, 2 * self._t["k"].shape[1])
            self._t = {name: _grow(t, cap, self._len) for name, t in self._t.items()}
        for name, t in new.items():
            self._t[name][:, self._len:need] = t
        self._len = need

    def tensors(self) -> list[torch.Tensor]:
        past = self.past()
        return [] if past is None else list(past)

    def map_tensors(self, fn) -> None:
        # keys and values through their [B, H, T, D] view (fn picks rows or acts elementwise),
        # so that a reordered or moved cache stays heads first in memory (`_storage`)
        self._t = {name: fn(t.transpose(1, 2), True).transpose(1, 2) if t.dim() == 4 else fn(t, True)
                   for name, t in self._t.items()}

    @property
    def can_crop(self) -> bool:  # type: ignore[override]
        return self._len == self.seen  # a window that dropped tokens would need them again

    def crop(self, length: int) -> None:
        super().crop(length)
        self._len = length

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t[:, :self._len] for name, t in self._t.items()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], seen: int) -> None:
        self._t = dict(tensors)
        if self._t and "real" not in self._t:  # saved before padding was kept
            self._t["real"] = torch.ones(self._t["k"].shape[:2], dtype=torch.bool, device=self._t["k"].device)
        self._len = 0 if not self._t else self._t["k"].shape[1]
        self.seen = seen
        self.masked = True


def _storage(like: torch.Tensor, capacity: int) -> torch.Tensor:
    """Empty storage for `capacity` tokens of `like` [B, T, ...]. Keys and values [B, T, H, D]
    are laid out heads first ([B, H, T, D] in memory, seen as [B, T, H, D]): a head's
    tokens are then one matrix, which attention reads for every (row, head) without a copy."""
    if like.dim() == 4:
        B, _, H, D = like.shape
        return like.new_empty((B, H, capacity, D)).transpose(1, 2)
    return like.new_empty((like.shape[0], capacity, *like.shape[2:]))


def _grow(t: torch.Tensor, capacity: int, used: int) -> torch.Tensor:
    out = _storage(t, capacity)
    out[:, :used] = t[:, :used]
    return out


@dataclass(frozen=True)
class MemoryLayout:
    """Learned memory tokens a model inserts into the sequence for its attention layers.

    `tokens` (M > 0) memory embeddings form a block, which carries no position. every = 0:
    one block before the sequence (a prefix). every = C > 0: a fresh block before main
    tokens 0, C, 2C, … (inserted when that token arrives, so decoding sees the same layout).
    The model keeps the memory rows through every block and drops them from its output.
    """

    tokens: int
    every: int = 0

    def __post_init__(self) -> None:
        if self.tokens <= 0 or self.every < 0:
            raise ConfigError(f"MemoryLayout: expected tokens > 0 and every >= 0, got "
                              f"tokens={self.tokens}, every={self.every}")


@dataclass
class NoOptions:
    """A mechanism with no options of its own."""


@dataclass(frozen=True)
class Cross:
    """How a mechanism serves as cross attention: queries of one sequence reading a memory
    written by another (`memattn.layers.cross`)."""

    # built as layer(spec, options) with the mechanism's typed options; memory(src, src_mask)
    # writes the source's memory once, forward(x, memory) reads it
    layer: Callable[..., nn.Module]
    memory: str  # how the source's memory is written, in words


@dataclass(frozen=True)
class StateSize:
    """The option that sets the size of a mechanism's memory (its decoding state, in a causal
    model), and what goes with it."""

    option: str | None = None  # None: no option does (`why` says what does)
    with_options: dict[str, Any] = field(default_factory=dict)  # set with every size (e.g. context=window)
    # (size, length) -> options that let a memory of that size hold `length` tokens, where the
    # write depends on positions (slots times their stride must reach the last token)
    cover: Callable[[int, int], dict[str, Any]] | None = None
    why: str = ""  # option None: what sets the size

    def __post_init__(self) -> None:
        if self.option is None and not self.why:
            raise ValueError("StateSize: no option sizes this memory; say what sets its size (why=...)")

    def sized(self, size: int, length: int) -> dict[str, Any]:
        """The options of a memory of `size` that holds `length` tokens."""
        return {**self.with_options, self.option: size, **(self.cover(size, length) if self.cover else {})}


@dataclass(frozen=True)
class Mechanism:
    """A registry entry: the layer class, its typed options and what it can do.

    Every capability a model, the converter, the benchmarks, the experiments or the generic
    tests act on is a field here, declared in `register`; the methods that do the work
    (`aux_loss()`, `project_parameters()`, a `layer_outputs` argument) stay on the layer, and
    a generic test holds each declaration to the layer (tests/layers/test_registry.py).
    """

    name: str
    layer: Callable[..., nn.Module]
    options: type = NoOptions
    summary: str = ""  # the first line of the layer's docstring
    causal: bool = True  # usable in a causal model
    bidirectional: bool = True  # usable in an encoder
    # its cross attention, or None: the mechanism cannot serve as cross attention
    cross: Cross | None = None
    # whether `memattn convert` can put it in the place of a transformers attention module:
    # not for a mechanism that needs memattn's own models (memory_layout, reads_layer_outputs)
    convertible: bool = True
    # Whether a causal model keeps its quality when it reads past its training length with a
    # state of one size (measured: README's long-stream table): a bool, or options -> bool
    # where an option decides (abc-mlp streams with a write rule that forgets).
    streaming: bool | Callable[[Any], bool] = False
    # whether its decoding state keeps one size whatever it reads: a bool, or options -> bool
    fixed_state: bool | Callable[[Any], bool] = True
    # the option that sizes its memory (None: it declares none)
    state_size: StateSize | None = None
    # whether a causal model with left-padded rows gives each row its result alone at every
    # option; False: some padding is refused with a ConfigError that says how to pad
    left_padding: bool = True
    aux_loss: bool = False  # the layer has `aux_loss()`: a term for the training objective, or None
    project_parameters: bool = False  # the layer has `project_parameters()`, called after each optimizer step
    # the layer's forward takes `layer_outputs`, a dict one forward pass hands from layer to layer
    reads_layer_outputs: bool = False
    # (options, causal) -> the MemoryLayout of learned tokens a model inserts into the sequence
    # for it, or None; a mechanism without it sees only the tokens
    memory_layout: Callable[[Any, bool], MemoryLayout | None] | None = None
    replaces_feedforward: bool = False  # the block drops its feed-forward sublayer
    # (spec, options) -> a module of the mechanism's own for the block's feed-forward slot
    # (pre-norm and residual kept), or None; it takes precedence over the model's MLP.
    feedforward: Callable[[LayerSpec, Any], nn.Module | None] | None = None
    # options for tests: windows, slots and pools small enough that a sequence of a few dozen
    # tokens fills them and runs past, while a memory written by position holds 64 tokens
    test_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"register({self.name!r})"
        if not (self.causal or self.bidirectional):
            raise ValueError(f"{where}: a mechanism serves causally, bidirectionally or both")
        if self.convertible and (self.memory_layout is not None or self.reads_layer_outputs):
            raise ValueError(f"{where}: convertible=True, but a mechanism with memory tokens or layer "
                             "outputs needs memattn's own models around it")
        if self.streaming is True and self.fixed_state is False:
            raise ValueError(f"{where}: streaming=True needs a decoding state of a fixed size")
        names = {f.name for f in dataclasses.fields(self.options)}
        named = [*self.test_options, *((self.state_size.option,) if self.state_size and self.state_size.option
                                       else ()), *(self.state_size.with_options if self.state_size else ())]
        unknown = [key for key in named if key not in names]
        if unknown:
            raise ValueError(f"{where}: {', '.join(unknown)} not among the options of "
                             f"{self.options.__name__} ({', '.join(names) or 'none'})")

    def streams(self, options: Any) -> bool:
        """Whether this mechanism with these (parsed) options streams past its training length."""
        return self.streaming(options) if callable(self.streaming) else self.streaming

    def fixed_size(self, options: Any) -> bool:
        """Whether its decoding state with these (parsed) options keeps one size."""
        return self.fixed_state(options) if callable(self.fixed_state) else self.fixed_state


_REGISTRY: dict[str, Mechanism] = {}


def register(name: str, *, options: type = NoOptions, **capabilities: Any):
    """Class decorator: make a layer available under the config string `name`, with its typed
    `options` and its capabilities as keywords (the fields of `Mechanism`: causal,
    bidirectional, cross, convertible, streaming, fixed_state, state_size, ...). Declare
    `streaming` only with a measurement past the training length behind it."""

    def wrap(cls):
        if name in _REGISTRY:
            raise ValueError(f"attention mechanism {name!r} is registered twice")
        declared = {f.name for f in dataclasses.fields(Mechanism)} - {"name", "layer", "options", "summary"}
        unknown = sorted(set(capabilities) - declared)
        if unknown:
            raise TypeError(f"register({name!r}): {', '.join(unknown)} is not a field of Mechanism")
        doc = (cls.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = Mechanism(name, cls, options, doc[0] if doc else "", **capabilities)
        return cls

    return wrap


def unregister(name: str) -> Mechanism:
    """Remove mechanism `name` from the registry; return its entry."""
    if name not in _REGISTRY:
        raise ConfigError(f"attention: unknown mechanism {name!r}")
    return _REGISTRY.pop(name)


def mechanisms() -> dict[str, Mechanism]:
    """All registered mechanisms by name (importing memattn.layers registers the built-ins)."""
    import memattn.layers  # noqa: F401  (registration happens on import)

    return dict(sorted(_REGISTRY.items()))


def mechanism_of(module: nn.Module) -> Mechanism | None:
    """The registered mechanism whose layer `module` is (its class or a subclass of it), or None."""
    return _mechanism_of(module, {m.layer: m for m in _REGISTRY.values()})


def _mechanism_of(module: nn.Module, by_layer: dict) -> Mechanism | None:
    return next((by_layer[cls] for cls in type(module).__mro__ if cls in by_layer), None)


def attention_layers(model: nn.Module) -> list[tuple[nn.Module, Mechanism]]:
    """Every layer of a registered mechanism within `model` (memattn's or a converted
    transformers model), with its registry entry."""
    by_layer = {m.layer: m for m in _REGISTRY.values()}
    found = ((m, _mechanism_of(m, by_layer)) for m in model.modules())
    return [(m, mech) for m, mech in found if mech is not None]


def layers_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the auxiliary losses of `model`'s attention layers whose mechanism declares
    one (`Mechanism.aux_loss`, e.g. adaptive-span penalties), to add to the training
    objective; None if none gives one."""
    losses = [m.aux_loss() for m, mech in attention_layers(model) if mech.aux_loss]
    losses = [loss for loss in losses if loss is not None]
    return torch.stack(losses).sum() if losses else None


def get_mechanism(name: str) -> Mechanism:
    known = mechanisms()
    if name not in known:
        raise ConfigError(f"attention: unknown mechanism {name!r}; known: {', '.join(known)}")
    return known[name]


def parse_options(name: str, options: dict[str, Any] | Any) -> Any:
    """Turn a dict of options into the mechanism's typed options dataclass, checking keys."""
    mech = get_mechanism(name)
    if isinstance(options, mech.options):
        return options
    known = {f.name: f for f in dataclasses.fields(mech.options)}
    values = {}
    for key, value in dict(options or {}).items():
        if key not in known:
            listed = ", ".join(known) or "none"
            raise ConfigError(f"attention.{key}: not an option of {name!r} (its options: {listed})")
        values[key] = coerce(f"attention.{key}", value, known[key].type, mech.options)
    try:
        return mech.options(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"attention ({name}): {e}") from None


def memory_layout(name: str, options: dict[str, Any] | Any, *, causal: bool) -> MemoryLayout | None:
    """The memory tokens mechanism `name` with `options` needs in a causal or bidirectional
    model, or None (most mechanisms): its registration's `memory_layout(options, causal)`."""
    layout = get_mechanism(name).memory_layout
    return None if layout is None else layout(parse_options(name, options), causal)


def build_feedforward(name: str, options: dict[str, Any] | Any, spec: LayerSpec) -> nn.Module | None:
    """The mechanism's own module for the block's feed-forward slot, or None (most mechanisms)."""
    mech = get_mechanism(name)
    return None if mech.feedforward is None else mech.feedforward(spec, parse_options(name, options))


def build_attention(name: str, options: dict[str, Any] | Any, spec: LayerSpec) -> nn.Module:
    """Build the registered layer `name` for the position described by `spec`."""
    mech = get_mechanism(name)
    if spec.causal and not mech.causal:
        raise ConfigError(f"attention: {name!r} is bidirectional only and cannot be used causally")
    if not spec.causal and not mech.bidirectional:
        raise ConfigError(f"attention: {name!r} is causal only and cannot be used in an encoder")
    return mech.layer(spec, parse_options(name, options))


def attention_layer(name: str, d_model: int, n_heads: int, *, causal: bool = True,
                    positions: str = "none", max_len: int = 1024, dropout: float = 0.0,
                    **options: Any) -> nn.Module:
    """A standalone attention layer of mechanism `name`, for use in any model.

    d_model / n_heads: width and heads; causal: a decoder's layer (False: an encoder's);
    positions: "rotary" rotates q and k inside the layer, "none" (default) leaves positions to
    the model around it; max_len: the longest sequence position-based options cover;
    dropout: on the output. Further keywords are the mechanism's own options
    (`memattn info --mechanisms` lists them), e.g.
    ``attention_layer("abc-mlp", 256, 4, num_slots=32)``. The layer keeps its own init
    (PyTorch's for the projections); memattn's models re-initialise their linear weights
    N(0, model.init_std) around it.
    """
    if positions not in ("rotary", "none"):
        raise ConfigError(f"positions: a standalone layer takes 'rotary' or 'none', got {positions!r}")
    spec = LayerSpec(d_model, n_heads, causal=causal, max_len=max_len, positions=positions, dropout=dropout)
    return build_attention(name, options, spec)

