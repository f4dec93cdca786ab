"""ABC layers: attention with bounded-memory control (Peng et al. 2022), one control strategy each.

Every layer here keeps a memory of M slots per head, written by control weights φ_i [M]
and read by a softmax over the slots (the ops in `memattn.ops.abc`):

    K̃_t = Σ_{i≤t} φ_i ⊗ k_i   [M, K]      Ṽ_t = Σ_{i≤t} φ_i ⊗ v_i   [M, V]
    o_t = softmax_M(K̃_t q_t / √K)ᵀ Ṽ_t

The strategies differ only in the write rule, i.e. how φ is chosen:

    abc-mlp         φ from the input: α = act(W_φ x) [H, M] per token, normalised per slot
                    over the prefix (causal) or the sequence (bidirectional).
    abc-window      a FIFO queue of the last n tokens (the paper's shift-matrix control): the
                    memory is exactly those n keys / values, so it is computed as softmax
                    attention over a window of n tokens; decoding keeps an n-slot ring buffer.
    abc-linformer   learned per-position columns φ_t = softplus(W^LF[t]) [M], W^LF [max_len, M];
                    causal through the recurrence.
    abc-random      φ_t = e_{i_t}, i_t a fixed pseudo-random slot (a hash of position and head).
    abc-meanpool    φ_t = e_{⌊t/c⌋} / c: slot j holds the mean of tokens jc .. jc+c-1.
    abc-l2g         local-to-global: φ_t = e_{t/c} for the global tokens t = 0, c, 2c, ..., else 0.

All decode with a fixed-size state (`fixed_size = True`): the M-slot memory (or the n-slot
ring buffer), never the prefix. Rotary positions (spec.positions == "rotary") rotate q and k
at their absolute positions before anything is written, as in `softmax`.

Layout: x [B, T, d] -> y [B, T, d]; q, k, v [B, T, H, D]; φ and slot logits [B, T, H, M].
attention_mask [B, T] bool (True = real token): padding writes nothing (φ = 0, or a slot
logit of PAD_LOGIT for abc-mlp; for abc-window padding keys are masked out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError, ShapeError, check_tensor
from memattn.layers.base import AttentionState, LayerSpec, register
from memattn.layers.positions import Rotary
from memattn.ops.abc import (
    ABCState,
    BoundedMemoryState,
    abc_attention,
    bounded_memory_attention,
)

# Slot logit given to padding in abc-mlp: exp(PAD_LOGIT - s) is exactly 0 next to any real
# token's logit (real logits from relu / sigmoid are ≥ log(RELU_FLOOR) ≈ -27.6), and the op
# handles logits of ±1e4 without overflow, unlike -inf on a prefix with no real token.
PAD_LOGIT = -1e4
# abc-mlp with activation=relu: α = 0 becomes log(RELU_FLOOR) as a logit, so a slot whose
# prefix has only zero α averages those tokens uniformly instead of dividing 0 by 0.
RELU_FLOOR = 1e-12


def _state_dtype(dtype: torch.dtype | None, weight: torch.Tensor) -> torch.dtype:
    """The ops keep states in float32, float64 for float64 models."""
    return torch.float64 if (dtype or weight.dtype) == torch.float64 else torch.float32


def _check_slots(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"attention.{name}: expected a positive integer, got {value!r}")


def _check_mask(mask: torch.Tensor | None, B: int, T: int) -> None:
    if mask is None:
        return
    check_tensor("attention_mask", mask, "[B, T]", B, T)
    if mask.dtype != torch.bool:
        raise ShapeError(f"attention_mask: expected dtype torch.bool, got {mask.dtype}")


class ABCMemoryState(AttentionState):
    """Fixed-size decoding state of an ABC layer: the op's state and the tokens seen.

    inner: an ABCState (log_z [B, H, M], k [B, H, M, K], v [B, H, M, V]) for abc-mlp, a
    BoundedMemoryState (k [B, H, M, K], v [B, H, M, V]) for the given-φ strategies.
    """

    fixed_size = True

    def __init__(self, inner: ABCState | BoundedMemoryState) -> None:
        self.inner = inner
        self.seen = 0

    def update(self, inner: ABCState | BoundedMemoryState, steps: int) -> None:
        self.inner = inner
        self.seen += steps

    def tensors(self) -> list[torch.Tensor]:
        return list(self.inner)


class _ABCBase(nn.Module):
    """q, k, v and output projections, rotary positions and dropout shared by the ABC layers."""

    def __init__(self, spec: LayerSpec, bias: bool) -> None:
        super().__init__()
        if spec.d_model % spec.n_heads:
            raise ConfigError(f"model.d_model={spec.d_model} is not divisible by "
                              f"model.n_heads={spec.n_heads}")
        self.spec = spec
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=bias)
        self.out = nn.Linear(spec.d_model, spec.d_model, bias=bias)
        self.rotary = Rotary(spec.head_dim) if spec.positions == "rotary" else None
        self.dropout = nn.Dropout(spec.dropout)

    def project(self, x: torch.Tensor, offset: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> q, k, v [B, T, H, D], q and k rotated at positions offset.."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.spec.n_heads, self.spec.head_dim).unbind(2)
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        return q, k, v

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, D] -> y [B, T, d]."""
        B, T = o.shape[:2]
        return self.dropout(self.out(o.reshape(B, T, -1)))


# --------------------------------------------------------------------------- abc-mlp


@dataclass
class ABCMLPOptions:
    """Options of `abc-mlp`.

    num_slots: M, memory slots per head in self-attention.
    cross_slots: memory slots for cross attention (None: num_slots); kept for models that
        attend to another sequence, validated here.
    activation: α = act(W_φ x). "exp" (the op's own control, α = exp(s)), "relu" or
        "sigmoid"; α is normalised per slot over the prefix (causal) or the sequence.
    tie_phi: one W_φ shared by every layer of the model (through spec.shared).
    bias: biases on the q/k/v, output and φ projections.
    """

    num_slots: int = 32
    cross_slots: int | None = None
    activation: Literal["exp", "relu", "sigmoid"] = "exp"
    tie_phi: bool = False
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("num_slots", self.num_slots)
        if self.cross_slots is None:
            self.cross_slots = self.num_slots
        _check_slots("cross_slots", self.cross_slots)
        if self.activation not in ("exp", "relu", "sigmoid"):
            raise ConfigError(f"attention.activation: expected one of exp, relu, sigmoid, "
                              f"got {self.activation!r}")


@register("abc-mlp", options=ABCMLPOptions)
class ABCMLPAttention(_ABCBase):
    """ABC_MLP: slot weights α = act(W_φ x) per head, normalised over the prefix; fixed-size state.

    Slot logits s [B, T, H, M] go to `abc_attention`, which uses α = exp(s) and
    φ_i = α_i / Σ_j α_j per slot, computed in log space. The other activations enter as
    logits of the same form: sigmoid as s = log σ(W_φ x) (exact, stable), relu as
    s = log max(relu(W_φ x), RELU_FLOOR), so φ = α / Σ α as the paper writes it.
    """

    def __init__(self, spec: LayerSpec, options: ABCMLPOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        M, H = options.num_slots, spec.n_heads
        if options.tie_phi:
            key = f"abc-mlp.phi.{M}.{options.bias}"
            if key not in spec.shared:
                spec.shared[key] = nn.Linear(spec.d_model, H * M, bias=options.bias)
            self.phi = spec.shared[key]
        else:
            self.phi = nn.Linear(spec.d_model, H * M, bias=options.bias)

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """An empty memory: log_z = -inf [B, H, M], zeros [B, H, M, D] for keys and values."""
        w = self.qkv.weight
        D = self.spec.head_dim
        return ABCMemoryState(ABCState.empty(
            batch_size, self.spec.n_heads, self.options.num_slots, D, D,
            device=device if device is not None else w.device, dtype=_state_dtype(dtype, w)))

    def slot_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> s [B, T, H, M], log α for the chosen activation."""
        B, T, _ = x.shape
        z = self.phi(x).view(B, T, self.spec.n_heads, self.options.num_slots)
        if self.options.activation == "sigmoid":
            return F.logsigmoid(z)
        if self.options.activation == "relu":
            return torch.log(F.relu(z).clamp_min(RELU_FLOOR))
        return z

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real) -> (y [B, T, d], state)."""
        check_tensor("x", x, "[B, T, d]", None, None, self.spec.d_model)
        B, T, _ = x.shape
        _check_mask(attention_mask, B, T)
        offset = memory_state.seen if memory_state is not None else 0
        q, k, v = self.project(x, offset)
        s = self.slot_logits(x)
        if attention_mask is not None:
            s = s.masked_fill(~attention_mask[:, :, None, None], PAD_LOGIT)
        initial = memory_state.inner if memory_state is not None else None
        o, state = abc_attention(q, k, v, s, causal=self.spec.causal, initial_state=initial,
                                 output_final_state=memory_state is not None)
        if memory_state is not None:
            memory_state.update(state, T)
        return self.finish(o), memory_state


# --------------------------------------------------------------------------- abc-window


@dataclass
class ABCWindowOptions:
    """Options of `abc-window`.

    window: n, the memory size: causal, token t reads tokens t-n+1 .. t; bidirectional,
        tokens within n // 2 on either side (|t - i| ≤ n // 2).
    bias: biases on the q/k/v and output projections.
    """

    window: int = 64
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("window", self.window)


class RingBufferState(AttentionState):
    """The n-slot FIFO memory of `abc-window`: the last n keys and values, slot = position mod n.

    k [B, n, H, D], v [B, n, H, D]; real [B, n] bool, False for slots never written or
    written by padding.
    """

    fixed_size = True

    def __init__(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor) -> None:
        self.k, self.v, self.real = k, v, real
        self.seen = 0

    def positions(self) -> torch.Tensor:
        """[n] the absolute position held by each slot (negative: empty)."""
        n = self.k.shape[1]
        j = torch.arange(n, device=self.k.device)
        return (self.seen - 1) - torch.remainder(self.seen - 1 - j, n)

    def write(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor) -> None:
        """Append k, v [B, T, H, D] and real [B, T]; only the last n stay."""
        n, T = self.k.shape[1], k.shape[1]
        keep = min(T, n)
        pos = torch.arange(self.seen + T - keep, self.seen + T, device=k.device)
        slots = torch.remainder(pos, n)
        self.k = self.k.index_copy(1, slots, k[:, T - keep:].to(self.k.dtype))
        self.v = self.v.index_copy(1, slots, v[:, T - keep:].to(self.v.dtype))
        self.real = self.real.index_copy(1, slots, real[:, T - keep:])
        self.seen += T

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.real]


def windowed_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Softmax attention with a mask. q [B, Tq, H, D], k [B, Tk, H, D], v [B, Tk, H, V],
    allowed [B, Tq, Tk] bool -> o [B, Tq, H, V]; a query with no allowed key reads zeros."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = scale * torch.einsum("bqhd,bkhd->bhqk", q, k)
    scores = scores.masked_fill(~allowed[:, None], -torch.inf)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhv->bqhv", p, v)


@register("abc-window", options=ABCWindowOptions)
class ABCWindowAttention(_ABCBase):
    """ABC with sliding-window control: a FIFO memory of the last n tokens; n-slot ring buffer.

    The paper's shift-matrix control φ_t = e_n with K̃_t = U K̃_{t-1} + e_n ⊗ k_t holds
    exactly the last n keys (values) in its n slots, so the read softmax_n(K̃_t q_t)ᵀ Ṽ_t is
    softmax attention over those tokens; the full forward computes it with a window mask
    (O(T²) memory here), decoding with a ring buffer of n keys and values (slot p mod n).
    Bidirectional, every token reads the tokens within n // 2 of it on either side.
    """

    def __init__(self, spec: LayerSpec, options: ABCWindowOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options

    def init_state(self, batch_size: int, device=None, dtype=None) -> RingBufferState:
        """An empty ring buffer: zeros [B, n, H, D] for keys and values, real = False."""
        w = self.qkv.weight
        device = device if device is not None else w.device
        shape = (batch_size, self.options.window, self.spec.n_heads, self.spec.head_dim)
        dt = dtype or w.dtype
        return RingBufferState(torch.zeros(shape, device=device, dtype=dt),
                               torch.zeros(shape, device=device, dtype=dt),
                               torch.zeros(shape[:2], device=device, dtype=torch.bool))

    def forward(self, x: torch.Tensor, *, memory_state: RingBufferState | None = None,
                attention_mask: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real) -> (y [B, T, d], state)."""
        check_tensor("x", x, "[B, T, d]", None, None, self.spec.d_model)
        B, T, _ = x.shape
        _check_mask(attention_mask, B, T)
        n = self.options.window
        offset = memory_state.seen if memory_state is not None else 0
        q, k, v = self.project(x, offset)
        real = (attention_mask if attention_mask is not None
                else torch.ones(B, T, dtype=torch.bool, device=x.device))
        qpos = torch.arange(offset, offset + T, device=x.device)
        kpos, keys, values, key_real = qpos, k, v, real
        if memory_state is not None and memory_state.seen > 0:
            kpos = torch.cat([memory_state.positions(), qpos])
            keys = torch.cat([memory_state.k.to(k.dtype), k], 1)
            values = torch.cat([memory_state.v.to(v.dtype), v], 1)
            key_real = torch.cat([memory_state.real & (memory_state.positions() >= 0), real], 1)
        rel = qpos[:, None] - kpos[None, :]  # [Tq, Tk] query position - key position
        if self.spec.causal:
            allowed = (rel >= 0) & (rel < n)
        else:
            allowed = rel.abs() <= n // 2
        allowed = allowed[None] & key_real[:, None, :]
        o = windowed_softmax(q, keys, values, allowed)
        if memory_state is not None:
            memory_state.write(k, v, real)
        return self.finish(o), memory_state


# ------------------------------------------------------ given-φ strategies (bounded memory)


class _GivenPhi(_ABCBase):
    """An ABC layer whose write weights φ [B, T, H, M] depend only on positions (and padding)."""

    num_slots: int

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """An empty memory: zeros [B, H, M, D] for keys and values."""
        w = self.qkv.weight
        D = self.spec.head_dim
        return ABCMemoryState(BoundedMemoryState.empty(
            batch_size, self.spec.n_heads, self.num_slots, D, D,
            device=device if device is not None else w.device, dtype=_state_dtype(dtype, w)))

    def write_weights(self, offset: int, T: int, x: torch.Tensor) -> torch.Tensor:
        """φ [1 or B, T, H, M] for the tokens at positions offset .. offset+T-1."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real) -> (y [B, T, d], state)."""
        check_tensor("x", x, "[B, T, d]", None, None, self.spec.d_model)
        B, T, _ = x.shape
        _check_mask(attention_mask, B, T)
        offset = memory_state.seen if memory_state is not None else 0
        q, k, v = self.project(x, offset)
        phi = self.write_weights(offset, T, x).to(q.dtype).expand(B, T, self.spec.n_heads, -1)
        if attention_mask is not None:
            phi = phi * attention_mask[:, :, None, None].to(phi.dtype)  # padding writes nothing
        initial = memory_state.inner if memory_state is not None else None
        o, state = bounded_memory_attention(q, k, v, phi, causal=self.spec.causal,
                                            initial_state=initial,
                                            output_final_state=memory_state is not None)
        if memory_state is not None:
            memory_state.update(state, T)
        return self.finish(o), memory_state


@dataclass
class ABCLinformerOptions:
    """Options of `abc-linformer`.

    num_slots: M, memory slots (columns of W^LF [max_len, M], shared by the heads).
    bias: biases on the q/k/v and output projections.
    """

    num_slots: int = 32
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("num_slots", self.num_slots)


@register("abc-linformer", options=ABCLinformerOptions)
class ABCLinformerAttention(_GivenPhi):
    """ABC with Linformer control: learned per-position φ_t = softplus(W^LF[t]); fixed-size state.

    W^LF [max_len, M] (model.max_len rows) is a free parameter, initialised N(0, 1); softplus
    keeps φ ≥ 0 as the op requires. φ is not normalised (Linformer's projection of the
    sequence). Causal, token t reads Σ_{i≤t} φ_i ⊗ k_i, valid through the recurrence as the
    paper shows. A sequence past max_len has no column and raises ShapeError.
    """

    def __init__(self, spec: LayerSpec, options: ABCLinformerOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        self.num_slots = options.num_slots
        self.max_len = spec.max_len
        self.columns = nn.Parameter(torch.randn(spec.max_len, options.num_slots))

    def write_weights(self, offset: int, T: int, x: torch.Tensor) -> torch.Tensor:
        if offset + T > self.max_len:
            raise ShapeError(f"x: a Linformer model given a longer sequence than it was built "
                             f"for: positions up to {offset + T} exceed model.max_len="
                             f"{self.max_len}")
        return F.softplus(self.columns[offset:offset + T])[None, :, None, :]  # [1, T, 1, M]


@dataclass
class ABCRandomOptions:
    """Options of `abc-random`.

    num_slots: M, memory slots per head.
    seed: picks the pseudo-random slot sequence.
    bias: biases on the q/k/v and output projections.
    """

    num_slots: int = 32
    seed: int = 0
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("num_slots", self.num_slots)


def random_slots(positions: torch.Tensor, heads: int, slots: int, seed: int) -> torch.Tensor:
    """positions [T] int64 -> slot ids [T, H] in [0, slots): a fixed hash of (seed, position, head),
    so that a full forward pass and token-by-token decoding pick the same slots."""
    h = torch.arange(heads, device=positions.device, dtype=torch.int64)
    z = positions[:, None] * 1000003 + h[None, :] * 7919 + seed * 104729 + 12345
    mask = (1 << 31) - 1
    for _ in range(3):  # a few rounds of multiply-xorshift on 31 bits
        z = (z * 1103515245 + 12345) & mask
        z = z ^ (z >> 13)
    return torch.remainder(z, slots)


@register("abc-random", options=ABCRandomOptions)
class ABCRandomAttention(_GivenPhi):
    """ABC_RD: every token writes, one-hot, to a pseudo-random slot (φ_t = e_{i_t}); fixed-size state.

    i_t is a deterministic hash of (seed, position, head) rather than a fresh draw, so that
    training, evaluation and decoding write the same token to the same slot; over positions
    it is spread close to uniformly over the M slots.
    """

    def __init__(self, spec: LayerSpec, options: ABCRandomOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        self.num_slots = options.num_slots

    def write_weights(self, offset: int, T: int, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(offset, offset + T, device=x.device)
        ids = random_slots(pos, self.spec.n_heads, self.num_slots, self.options.seed)
        return F.one_hot(ids, self.num_slots).to(x.dtype)[None]  # [1, T, H, M]


@dataclass
class ABCMeanPoolOptions:
    """Options of `abc-meanpool`.

    num_slots: M, memory slots: the layer reads at most num_slots * pool tokens.
    pool: c, tokens averaged into each slot.
    bias: biases on the q/k/v and output projections.
    """

    num_slots: int = 32
    pool: int = 2
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("num_slots", self.num_slots)
        _check_slots("pool", self.pool)


@register("abc-meanpool", options=ABCMeanPoolOptions)
class ABCMeanPoolAttention(_GivenPhi):
    """ABC with compressive mean-pool control: φ_t = e_{⌊t/c⌋} / c; fixed-size state.

    Slot j holds the mean of tokens jc .. jc+c-1 (a partial block holds its sum / c so
    far). The slots needed grow with the length, so a sequence past num_slots * pool tokens
    raises ShapeError naming both options rather than silently reusing slots.
    """

    def __init__(self, spec: LayerSpec, options: ABCMeanPoolOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        self.num_slots = options.num_slots

    def write_weights(self, offset: int, T: int, x: torch.Tensor) -> torch.Tensor:
        c, M = self.options.pool, self.num_slots
        if offset + T > c * M:
            raise ShapeError(f"x: positions up to {offset + T} exceed what abc-meanpool can hold, "
                             f"attention.num_slots * attention.pool = {M} * {c} = {M * c}")
        ids = torch.arange(offset, offset + T, device=x.device) // c
        phi = F.one_hot(ids, M).to(x.dtype) / c  # [T, M]
        return phi[None, :, None, :]


@dataclass
class ABCL2GOptions:
    """Options of `abc-l2g`.

    num_slots: M, memory slots: one a global token, so the layer reads at most
        num_slots * every tokens.
    every: c, one global token every c positions (positions 0, c, 2c, ...).
    bias: biases on the q/k/v and output projections.
    """

    num_slots: int = 32
    every: int = 4
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("num_slots", self.num_slots)
        _check_slots("every", self.every)


@register("abc-l2g", options=ABCL2GOptions, bidirectional=False)
class ABCL2GAttention(_GivenPhi):
    """ABC with local-to-global control: global token j (position jc) writes e_j; fixed-size state.

    φ_t = e_{t/c} when t is a multiple of c, 0 for the other tokens: the memory is the
    keys / values of the global tokens, one slot each, and every token reads all the global
    tokens so far (causal) or in the sequence. Until the first global token, or for a query
    whose memory is still empty, the read is zero. A sequence past num_slots * every tokens
    raises ShapeError naming both options.

    This is the global half of local-to-global attention: a token that is not global is
    never written, so nothing else reads it. Causal only: in an encoder such a token would
    be invisible to every other one, which defeats bidirectional reading.
    """

    def __init__(self, spec: LayerSpec, options: ABCL2GOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        self.num_slots = options.num_slots

    def write_weights(self, offset: int, T: int, x: torch.Tensor) -> torch.Tensor:
        c, M = self.options.every, self.num_slots
        if offset + T > c * M:
            raise ShapeError(f"x: positions up to {offset + T} exceed what abc-l2g can hold, "
                             f"attention.num_slots * attention.every = {M} * {c} = {M * c}")
        pos = torch.arange(offset, offset + T, device=x.device)
        phi = F.one_hot(pos // c, M).to(x.dtype) * (pos % c == 0)[:, None].to(x.dtype)
        return phi[None, :, None, :]  # [1, T, 1, M]
