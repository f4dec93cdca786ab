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
    abc-dilated     two FIFO queues: the last n tokens and the last n tokens at positions 0, d, 2d, ...
    abc-workspace   bidirectional, Luna-style: slot logits k_i · P_m from the previous layer's memory P.
    abc-cluster     keys grouped into n clusters (k-means over the sequence; causal: online
                    k-means centres); slot j holds the mean of the keys / values of cluster j.

The causal ones decode with a fixed-size state (`fixed_size = True`): the M-slot memory, or
the n-slot ring buffers of the queues, never the prefix. Rotary positions (spec.positions == "rotary")
rotate q and k at their absolute positions before anything is written, as in `softmax`.

Layout: x [B, T, d] -> y [B, T, d]; q, k, v [B, T, H, D]; φ and slot logits [B, T, H, M].
attention_mask [B, T] bool (True = real token): padding writes nothing (φ = 0, or a slot
logit of PAD_LOGIT for abc-mlp; abc-window / abc-dilated mask padding keys out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError, ShapeError
from memattn.layers.base import AttentionLayer, AttentionState, LayerSpec, register
from memattn.ops.abc import (
    ABCState,
    BoundedMemoryState,
    abc_attention,
    bounded_memory_attention,
)
from memattn.ops.abc.common import compute_dtype

# Slot logit given to padding in abc-mlp: exp(PAD_LOGIT - s) underflows to exactly 0 next to
# a real token's logit s > -9000 (from relu / sigmoid, s ≥ log(RELU_FLOOR) ≈ -27.6), and the op
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

    def map_tensors(self, fn) -> None:
        self.inner = type(self.inner)(*(fn(t, True) for t in self.inner))


class _ABCBase(AttentionLayer):
    """The ABC layers: the shared projections plus the slot-logit memory and its read."""

    def __init__(self, spec: LayerSpec, bias: bool) -> None:
        super().__init__(spec, bias=bias)

    def empty_abc_state(self, batch_size: int, slots: int, device=None,
                        dtype=None) -> ABCMemoryState:
        """An empty slot-logit memory: log_z = -inf [B, H, M], zeros [B, H, M, D]."""
        w = self.qkv.weight
        D = self.spec.head_dim
        return ABCMemoryState(ABCState.empty(
            batch_size, self.spec.n_heads, slots, D, D,
            device=device if device is not None else w.device, dtype=_state_dtype(dtype, w)))

    def attend_logits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
                      memory_state: ABCMemoryState | None,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
        """`abc_attention` with slot logits s [B, T, H, M]; padding writes nothing -> y [B, T, d]."""
        if attention_mask is not None:
            s = s.masked_fill(~attention_mask[:, :, None, None], PAD_LOGIT)
        initial = memory_state.inner if memory_state is not None else None
        o, state = abc_attention(q, k, v, s, causal=self.spec.causal, initial_state=initial,
                                 output_final_state=memory_state is not None)
        if memory_state is not None:
            memory_state.update(state, q.shape[1])
        return self.finish(o)


# --------------------------------------------------------------------------- abc-mlp


@dataclass
class ABCMLPOptions:
    """Options of `abc-mlp`.

    num_slots: M, memory slots per head in self-attention.
    cross_slots: memory slots per head of cross attention (None: num_slots), used by
        models that attend to another sequence (`memattn.layers.cross`).
    activation: α = act(W_φ x). "exp" (the op's own control, α = exp(s)), "relu" or
        "sigmoid"; α is normalised per slot over the prefix (causal) or the sequence.
    tie_phi: one W_φ shared by every layer of the model (through spec.shared).
    bias: biases on the q/k/v, output and φ projections.
    phi_init_std: W_φ drawn N(0, phi_init_std²) instead of the model's init (0: the model's).
        A larger scale gives the slots different logits from the start: with near-equal
        logits every slot holds about the mean of the prefix and they learn alike.
    """

    num_slots: int = 32
    cross_slots: int | None = None
    activation: Literal["exp", "relu", "sigmoid"] = "exp"
    tie_phi: bool = False
    bias: bool = False
    phi_init_std: float = 0.0

    def __post_init__(self) -> None:
        if not self.phi_init_std >= 0:  # NaN too
            raise ConfigError(f"attention.phi_init_std: expected a number >= 0, got {self.phi_init_std!r}")
        _check_slots("num_slots", self.num_slots)
        if self.cross_slots is None:
            self.cross_slots = self.num_slots
        _check_slots("cross_slots", self.cross_slots)
        if self.activation not in ("exp", "relu", "sigmoid"):
            raise ConfigError(f"attention.activation: expected one of exp, relu, sigmoid, "
                              f"got {self.activation!r}")


def activation_logits(z: torch.Tensor, activation: str) -> torch.Tensor:
    """Pre-activations z = W_φ x -> slot logits s = log act(z), so that α = exp(s) = act(z)."""
    if activation == "sigmoid":
        return F.logsigmoid(z)
    if activation == "relu":
        return torch.log(F.relu(z).clamp_min(RELU_FLOOR))
    return z


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
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """W_φ from attention.phi_init_std when set; a model calls this after its own init."""
        if self.options.phi_init_std > 0:
            nn.init.normal_(self.phi.weight, std=self.options.phi_init_std)

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """An empty memory: log_z = -inf [B, H, M], zeros [B, H, M, D] for keys and values."""
        return self.empty_abc_state(batch_size, self.options.num_slots, device, dtype)

    def slot_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> s [B, T, H, M], log α for the chosen activation."""
        B, T, _ = x.shape
        z = self.phi(x).view(B, T, self.spec.n_heads, self.options.num_slots)
        return activation_logits(z, self.options.activation)

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], state)."""
        _, q, k, v = self.project(x, memory_state, attention_mask, positions)
        y = self.attend_logits(q, k, v, self.slot_logits(x), memory_state, attention_mask)
        return y, memory_state


# --------------------------------------------------------------------------- abc-window


@dataclass
class ABCWindowOptions:
    """Options of `abc-window`.

    window: n, the memory size: causal, token t reads tokens t-n+1 .. t; bidirectional,
        the n tokens t - n // 2 .. t + (n - 1) // 2 (centred; one more before for even n).
    bias: biases on the q/k/v and output projections.
    """

    window: int = 64
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("window", self.window)


@dataclass
class ABCDilatedOptions(ABCWindowOptions):
    """Options of `abc-dilated`: those of `abc-window` (the local queue of n slots), and

    dilation: d, the second queue holds the last n tokens at positions 0, d, 2d, ...
    """

    dilation: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_slots("dilation", self.dilation)


class RingBufferState(AttentionState):
    """An n-slot FIFO memory of keys and values: a token stays until n newer ones replace it.

    k [B, n, H, D], v [B, n, H, D]; real [B, n] bool, False for slots never written or
    written by padding; pos [n] int64, the position each slot holds (-1: empty).
    """

    fixed_size = True

    def __init__(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor,
                 pos: torch.Tensor) -> None:
        self.k, self.v, self.real, self.pos = k, v, real, pos
        self.seen = 0

    @classmethod
    def empty(cls, batch: int, n: int, heads: int, dim: int, *, device, dtype) -> RingBufferState:
        shape = (batch, n, heads, dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(batch, n, device=device, dtype=torch.bool),
                   torch.full((n,), -1, device=device, dtype=torch.int64))

    def write(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, pos: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Write tokens k, v [B, T, H, D], real [B, T] at positions pos [T] into slots [T]
        (in order: of two tokens for one slot the later stays)."""
        n, T = self.k.shape[1], k.shape[1]
        keep = slice(max(0, T - n), T)  # at most the last n can stay
        pos, slots = pos[keep], slots[keep]
        self.k = self.k.index_copy(1, slots, k[:, keep].to(self.k.dtype))
        self.v = self.v.index_copy(1, slots, v[:, keep].to(self.v.dtype))
        self.real = self.real.index_copy(1, slots, real[:, keep])
        self.pos = self.pos.index_copy(0, slots, pos)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.real, self.pos]

    def map_tensors(self, fn) -> None:
        self.k, self.v, self.real = fn(self.k, True), fn(self.v, True), fn(self.real, True)
        self.pos = fn(self.pos, False)  # [n]: the same slots for every row


class QueueState(AttentionState):
    """Decoding state of `abc-window` / `abc-dilated`: one or two RingBufferStates."""

    fixed_size = True

    def __init__(self, queues: list[RingBufferState]) -> None:
        self.queues = queues
        self.seen = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for q in self.queues for t in q.tensors()]

    def map_tensors(self, fn) -> None:
        for queue in self.queues:
            queue.map_tensors(fn)


def counted_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """Softmax attention where key j enters query i's memory count[b, i, j] times (0: absent).

    q [B, Tq, H, D], k [B, Tk, H, D], v [B, Tk, H, V], count [B, Tq, Tk] -> o [B, Tq, H, V];
    a query with an empty memory reads zeros. A key held in two slots weighs twice.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = scale * torch.einsum("bqhd,bkhd->bhqk", q, k)
    held = (count > 0)[:, None]  # [B, 1, Tq, Tk]
    scores = torch.where(held, scores + torch.log(count.clamp_min(1).to(scores.dtype))[:, None],
                         -torch.inf)
    # A query with an empty memory: finite scores in its row (no NaN, forward or backward),
    # then its weights are zeroed.
    empty = ~held.any(-1, keepdim=True)  # [B, 1, Tq, 1]
    p = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.einsum("bhqk,bkhv->bqhv", p, v)


def in_window(qpos: torch.Tensor, kpos: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """Key position kpos is in the window of n positions of query qpos (broadcast): causal
    the last n up to qpos, bidirectional qpos - n // 2 .. qpos + (n - 1) // 2."""
    rel = qpos - kpos
    return (rel >= 0) & (rel < window) if causal else (rel <= window // 2) & (-rel <= (window - 1) // 2)


def in_strided_queue(qpos: torch.Tensor, kpos: torch.Tensor, window: int,
                     dilation: int) -> torch.Tensor:
    """Key position kpos is in the dilated queue of query qpos (broadcast): one of the last
    n positions ≤ qpos that are multiples of d."""
    d = dilation
    return (kpos % d == 0) & (kpos <= qpos) & (qpos // d - kpos // d < window)


def local_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor,
                           window: int, causal: bool, dilation: int = 0) -> torch.Tensor:
    """Softmax attention over a sliding window, in blocks: O(T · n) time and memory.

    q, k [B, T, H, D], v [B, T, H, V], real [B, T] bool (False: padding, never read).
    Causal: query t reads keys t-n+1 .. t; bidirectional: keys t - n // 2 .. t + (n - 1) // 2. The
    sequence is cut into blocks of c tokens (c = n causal, n // 2 + 1 bidirectional) and a
    block reads itself and its neighbours (the one before; bidirectional also the one
    after), which hold every key of its window. dilation d > 0 (causal): query t also reads
    the last n positions ≤ t that are multiples of d, in the same softmax (a key in both
    sets counts twice), gathered per block from the keys at 0, d, 2d, ... A query with no
    real key reads zeros.
    """
    B, T, H, D = q.shape
    c = window if causal else window // 2 + 1
    nb = -(-T // c)
    pad = nb * c - T
    before, after = 1, (0 if causal else 1)

    def blocks(x: torch.Tensor, fill=0.0) -> torch.Tensor:  # [B, T, ...] -> [B, nb + pads, c, ...]
        x = F.pad(x.movedim(1, -1), (before * c, pad + after * c), value=fill).movedim(-1, 1)
        return x.unflatten(1, (nb + before + after, c))

    def neighbours(x: torch.Tensor) -> torch.Tensor:  # [B, nb + pads, c, ...] -> [B, nb, (1 + before + after) c, ...]
        return torch.cat([x[:, i:i + nb] for i in range(before + after + 1)], dim=2)

    qb = blocks(q)[:, before:before + nb]  # [B, nb, c, H, D]
    kb, vb = neighbours(blocks(k)), neighbours(blocks(v))  # [B, nb, w, H, *]
    keep = neighbours(blocks(real, False))  # [B, nb, w]
    qpos = torch.arange(nb * c, device=q.device).view(nb, c)  # [nb, c]
    kpos = qpos[:, :1] - before * c + torch.arange(kb.shape[2], device=q.device)  # [nb, w]
    seen = in_window(qpos[:, :, None], kpos[:, None, :], window, causal)  # [nb, c, w]
    seen = seen[None] & keep[:, :, None, :]  # [B, nb, c, w]
    if dilation:  # the strided keys j·d of block i: j in [i c // d - n + 1, ((i + 1) c - 1) // d]
        d = dilation
        first = qpos[:, 0] // d - window + 1  # [nb]
        j = first[:, None] + torch.arange(window + c // d + 1, device=q.device)  # [nb, s]
        pos = (j * d).clamp(0, T - 1)
        kb = torch.cat([kb, k[:, pos]], dim=2)
        vb = torch.cat([vb, v[:, pos]], dim=2)
        exists = ((j >= 0) & (j * d < T))[:, None, :]
        strided = in_strided_queue(qpos[:, :, None], (j * d)[:, None, :], window, d) & exists
        seen = torch.cat([seen, strided[None] & real[:, pos][:, :, None, :]], dim=-1)
    scores = torch.einsum("bncht,bnwht->bnhcw", qb, kb) * D ** -0.5
    scores = scores.masked_fill(~seen[:, :, None], -torch.inf)
    empty = ~seen.any(-1)[:, :, None, :, None]  # [B, nb, 1, c, 1]
    p = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    o = torch.einsum("bnhcw,bnwhv->bnchv", p, vb)
    return o.flatten(1, 2)[:, :T]


@register("abc-window", options=ABCWindowOptions)
class ABCWindowAttention(_ABCBase):
    """ABC with sliding-window control: a FIFO memory of the last n tokens; n-slot ring buffer.

    The paper's shift-matrix control φ_t = e_n with K̃_t = U K̃_{t-1} + e_n ⊗ k_t holds
    exactly the last n keys (values) in its n slots, so the read softmax_n(K̃_t q_t)ᵀ Ṽ_t is
    softmax attention over those tokens; a sequence read from an empty state is computed in
    blocks (`local_window_attention`, O(T · n)), decoding with a ring buffer of n keys and
    values (slot p mod n).
    Bidirectional, every token reads the n tokens centred on it (n // 2 before, (n - 1) // 2 after).
    """

    dilated = False

    def __init__(self, spec: LayerSpec, options: ABCWindowOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options

    def init_state(self, batch_size: int, device=None, dtype=None) -> QueueState:
        """Empty ring buffers (one a queue): zeros [B, n, H, D] for keys and values."""
        w = self.qkv.weight
        device = device if device is not None else w.device
        return QueueState([RingBufferState.empty(
            batch_size, self.options.window, self.spec.n_heads, self.spec.head_dim,
            device=device, dtype=dtype or w.dtype) for _ in range(1 + self.dilated)])

    def _local(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """[Tq, Tk] bool: key kpos is in the local queue of query qpos."""
        return in_window(qpos[:, None], kpos[None, :], self.options.window, self.spec.causal)

    def _strided(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """[Tq, Tk] bool: key kpos is in the dilated queue of query qpos (causal)."""
        return in_strided_queue(qpos[:, None], kpos[None, :], self.options.window,
                                self.options.dilation)

    def forward(self, x: torch.Tensor, *, memory_state: QueueState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], state).

        The queues are kept by index in the batch: with left padding (padding writes nothing)
        the local queue of a token holds the same real tokens as in its row alone; the dilated
        queue needs each row's padding to be a multiple of the dilation, else ConfigError.
        """
        offset, q, k, v = self.project(x, memory_state, attention_mask, positions)
        B, T, _ = x.shape
        real = (attention_mask if attention_mask is not None
                else torch.ones(B, T, dtype=torch.bool, device=x.device))
        qpos = torch.arange(offset, offset + T, device=x.device)
        if self.dilated and positions is not None:
            shift = (qpos[None] - positions).masked_select(real)
            if bool((shift % self.options.dilation != 0).any()):
                raise ConfigError(f"abc-dilated: its dilated queue holds positions 0, d, 2d, ... of the "
                                  f"batch; left-pad each row by a multiple of attention.dilation = "
                                  f"{self.options.dilation} tokens")
        if offset == 0 and T > self.options.window:  # from an empty state: in blocks
            o = local_window_attention(q, k, v, real, self.options.window, self.spec.causal,
                                       self.options.dilation if self.dilated else 0)
        elif not self.dilated and memory_state is not None and T > self.options.window:
            # a long continuation: the held queue, in position order, then the new tokens, in
            # blocks as from an empty state (its slots hold positions offset - n .. offset - 1)
            queue = memory_state.queues[0]
            order = torch.argsort(queue.pos)  # empty slots (-1) first
            held = queue.real[:, order] & (queue.pos[order] >= 0)[None]
            o = local_window_attention(torch.cat([torch.zeros_like(q[:, :len(order)]), q], 1),
                                       torch.cat([queue.k[:, order].to(k.dtype), k], 1),
                                       torch.cat([queue.v[:, order].to(v.dtype), v], 1),
                                       torch.cat([held, real], 1), self.options.window, True)[:, len(order):]
        else:  # the new tokens can sit in both queues; a buffered key only in its own queue
            count = self._local(qpos, qpos).long()
            if self.dilated:
                count = count + self._strided(qpos, qpos).long()
            count = count[None] * real[:, None, :]
            keys, values, counts = [k], [v], [count]
            if memory_state is not None and offset > 0:
                rules = [self._local] + ([self._strided] if self.dilated else [])
                for queue, rule in zip(memory_state.queues, rules):
                    held = queue.real & (queue.pos >= 0)[None]
                    keys.append(queue.k.to(k.dtype))
                    values.append(queue.v.to(v.dtype))
                    counts.append(rule(qpos, queue.pos).long()[None] * held[:, None, :])
            o = counted_softmax(q, torch.cat(keys, 1), torch.cat(values, 1),
                                torch.cat(counts, 2))
        if memory_state is not None:
            n = self.options.window
            memory_state.queues[0].write(k, v, real, qpos, torch.remainder(qpos, n))
            if self.dilated:
                d = self.options.dilation
                on = qpos % d == 0
                memory_state.queues[1].write(k[:, on], v[:, on], real[:, on], qpos[on],
                                             torch.remainder(qpos[on] // d, n))
            memory_state.seen += T
        return self.finish(o), memory_state


@register("abc-dilated", options=ABCDilatedOptions, bidirectional=False)
class ABCDilatedAttention(ABCWindowAttention):
    """ABC with dilated-window control: two FIFO queues of n slots each; fixed-size state.

    The local queue holds the last n tokens (as abc-window), the dilated one the last n
    tokens at positions 0, d, 2d, ... (a shift-matrix queue written only by those). The read
    is one softmax over the 2n slots, so a token held by both queues weighs twice, as its
    two slots do in the paper's memory. Causal only: the queues are a left-to-right write rule.
    A sequence read from an empty state is computed in blocks, O(T · n), as abc-window's.
    """

    dilated = True


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

    def write_weights(self, pos: torch.Tensor, last: int, x: torch.Tensor) -> torch.Tensor:
        """φ [1 or B, T, 1 or H, M] for tokens at positions pos [1 or B, T] (int64), the
        largest of which is `last`."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], state)."""
        offset, q, k, v = self.project(x, memory_state, attention_mask, positions)
        B, T, _ = x.shape
        if positions is None:
            pos, last = torch.arange(offset, offset + T, device=x.device)[None], offset + T - 1
        else:
            pos, last = positions, int(positions.max())
        phi = self.write_weights(pos, last, x).to(q.dtype).expand(B, T, self.spec.n_heads, -1)
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

    def write_weights(self, pos: torch.Tensor, last: int, x: torch.Tensor) -> torch.Tensor:
        if last >= self.max_len:
            raise ShapeError(f"x: a Linformer model given a longer sequence than it was built "
                             f"for: positions up to {last + 1} exceed model.max_len="
                             f"{self.max_len}")
        return F.softplus(self.columns[pos])[:, :, None, :]  # [1 or B, T, 1, M]


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
    """positions [...] int64 -> slot ids [..., H] in [0, slots): a fixed hash of (seed, position,
    head), so that a full forward pass and token-by-token decoding pick the same slots."""
    h = torch.arange(heads, device=positions.device, dtype=torch.int64)
    z = positions[..., None] * 1000003 + h * 7919 + seed * 104729 + 12345
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

    def write_weights(self, pos: torch.Tensor, last: int, x: torch.Tensor) -> torch.Tensor:
        ids = random_slots(pos, self.spec.n_heads, self.num_slots, self.options.seed)
        return F.one_hot(ids, self.num_slots).to(x.dtype)  # [1 or B, T, H, M]


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

    def write_weights(self, pos: torch.Tensor, last: int, x: torch.Tensor) -> torch.Tensor:
        c, M = self.options.pool, self.num_slots
        if last >= c * M:
            raise ShapeError(f"x: positions up to {last + 1} exceed what abc-meanpool can hold, "
                             f"attention.num_slots * attention.pool = {M} * {c} = {M * c}")
        phi = F.one_hot(pos // c, M).to(x.dtype) / c  # [1 or B, T, M]
        return phi[:, :, None, :]


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

    def write_weights(self, pos: torch.Tensor, last: int, x: torch.Tensor) -> torch.Tensor:
        c, M = self.options.every, self.num_slots
        if last >= c * M:
            raise ShapeError(f"x: positions up to {last + 1} exceed what abc-l2g can hold, "
                             f"attention.num_slots * attention.every = {M} * {c} = {M * c}")
        phi = F.one_hot(pos // c, M).to(x.dtype) * (pos % c == 0)[..., None].to(x.dtype)
        return phi[:, :, None, :]  # [1 or B, T, 1, M]


# ------------------------------------------------------------- abc-workspace (bidirectional)


@dataclass
class ABCWorkspaceOptions:
    """Options of `abc-workspace`.

    num_slots: M, memory slots per head (the size of the shared workspace).
    bias: biases on the q/k/v and output projections.
    """

    num_slots: int = 32
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("num_slots", self.num_slots)


class Workspace(nn.Module):
    """The workspace the abc-workspace layers of one model share (through spec.shared).

    initial [H, M, D]: the learned workspace the first layer reads (N(0, 1) init). What a
    layer passes to the next travels in the forward pass's `layer_outputs`, not here.
    """

    def __init__(self, heads: int, slots: int, head_dim: int) -> None:
        super().__init__()
        self.initial = nn.Parameter(torch.randn(heads, slots, head_dim))


@register("abc-workspace", options=ABCWorkspaceOptions, causal=False)
class ABCWorkspaceAttention(_ABCBase):
    """ABC with shared-workspace (Luna-style) control: φ from the previous layer's memory.

    Slot m's logit for token i is s_im = k_i · P_m / √D, P [B, H, M, D] the key memory K̃
    the previous layer wrote (the first layer reads a learned P), normalised over the
    sequence like ABC_MLP (φ_i = exp(s_i) / Σ_j exp(s_j) per slot), so each slot is the
    average of the tokens that match it. Bidirectional only: the memory a layer passes on
    is that of the whole sequence. Layers run in order within one forward pass; padding
    (attention_mask False) writes nothing.
    """

    def __init__(self, spec: LayerSpec, options: ABCWorkspaceOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        key = f"abc-workspace.{options.num_slots}"
        if key not in spec.shared:
            spec.shared[key] = Workspace(spec.n_heads, options.num_slots, spec.head_dim)
        self.workspace = spec.shared[key]

    def init_state(self, batch_size: int, device=None, dtype=None):
        raise ConfigError("attention: 'abc-workspace' is bidirectional only and has no "
                          "decoding state")

    reads_layer_outputs = True  # a model passes this forward pass's `layer_outputs`

    def forward(self, x: torch.Tensor, *, memory_state=None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                layer_outputs: dict[int, torch.Tensor] | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], None).

        layer_outputs: {layer_idx: key memory K̃ [B, H, M, D]} of one forward pass; this layer
        reads entry layer_idx - 1 (absent: the learned initial workspace) and writes its own.
        Keyed by layer, so a layer recomputed later (activation checkpointing) reads the same
        value as the first time.
        """
        _, q, k, v = self.project(x, attention_mask=attention_mask, positions=positions)
        B, T, _ = x.shape
        prev = (layer_outputs or {}).get(self.spec.layer_idx - 1)
        if prev is None:  # the first layer (or a layer used on its own)
            prev = self.workspace.initial.expand(B, -1, -1, -1)
        elif prev.shape[0] != B:
            raise ShapeError(f"x: batch of {B} after a workspace written for a batch of "
                             f"{prev.shape[0]}; the layers of one forward pass share its batch")
        s = torch.einsum("bthd,bhmd->bthm", k, prev.to(k.dtype)) * self.spec.head_dim ** -0.5
        if attention_mask is not None:
            s = s.masked_fill(~attention_mask[:, :, None, None], PAD_LOGIT)
        o, state = abc_attention(q, k, v, s, causal=False, output_final_state=True)
        if layer_outputs is not None:
            layer_outputs[self.spec.layer_idx] = state.k.to(k.dtype)
        return self.finish(o), None


# --------------------------------------------------------------------------- abc-cluster


@dataclass
class ABCClusterOptions:
    """Options of `abc-cluster`.

    num_clusters: n, memory slots per head: the clusters the keys are grouped into.
    iters: Lloyd iterations (assign every key to its nearest centre, move each centre to
        the mean of its keys) after the initial centres; bidirectional only.
    decay: causal only: the centres are running means of the unit keys assigned to them,
        c <- normalise(decay · c + (1 - decay) · mean), updated by every training forward.
    bias: biases on the q/k/v and output projections.
    """

    num_clusters: int = 32
    iters: int = 3
    decay: float = 0.99
    bias: bool = False

    def __post_init__(self) -> None:
        _check_slots("num_clusters", self.num_clusters)
        _check_slots("iters", self.iters)
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"attention.decay: expected a number in [0, 1), got {self.decay!r}")


def cluster_keys(k: torch.Tensor, n: int, iters: int,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """k [B, T, H, D] -> the cluster of each key, [B, T, H] in 0 .. n-1 (k-means, per head).

    Deterministic: the initial centres are the keys of the real tokens of ranks
    ⌊j L / n⌋, j = 0 .. n-1 (L real tokens, in order); then `iters` Lloyd iterations, and a
    last assignment to the nearest centre (ties to the lowest index). A centre that loses
    all its keys stays where it is. Padding (mask False) is assigned but moves no centre.
    Distances are taken elementwise (never through a matrix product), so a key's cluster
    does not depend on padding.
    """
    B, T, H, D = k.shape
    kt = k.detach().transpose(1, 2)  # [B, H, T, D]
    real = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=k.device)
    L = real.sum(1)  # [B]
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices  # real tokens first
    ranks = torch.arange(n, device=k.device)[None] * L[:, None] // n  # [B, n]
    ranks = torch.minimum(ranks, (L - 1).clamp(min=0)[:, None])
    start = order.gather(1, ranks)  # [B, n] positions of the initial centres
    centres = kt.gather(2, start[:, None, :, None].expand(B, H, n, D))  # [B, H, n, D]
    weight = real[:, None, :, None].to(kt.dtype)  # [B, 1, T, 1]

    def nearest(c: torch.Tensor) -> torch.Tensor:  # [B, H, T]; no [B, H, T, n, D] difference
        return torch.cdist(kt, c, compute_mode="donot_use_mm_for_euclid_dist").argmin(-1)

    for _ in range(iters):
        member = F.one_hot(nearest(centres), n).to(kt.dtype) * weight  # [B, H, T, n]
        count = member.sum(2)[..., None]  # [B, H, n, 1]
        sums = member.transpose(2, 3) @ kt  # [B, H, n, D]
        centres = torch.where(count > 0, sums / count.clamp(min=1), centres)
    return nearest(centres).transpose(1, 2)  # [B, T, H]


def nearest_centre(unit: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Unit keys [B, T, H, D], unit centres [H, n, D] -> the centre of largest cosine, [B, T, H]."""
    return torch.einsum("bthd,hnd->bthn", unit, centres.to(unit.dtype)).argmax(-1)


@register("abc-cluster", options=ABCClusterOptions)
class ABCClusterAttention(_ABCBase):
    """ABC with clustering control: slot j holds the mean of the keys / values in cluster j.

    Bidirectional: the keys of each head are grouped into n clusters by k-means over the
    sequence (`cluster_keys`, on the keys after rotary positions, without gradient: the
    assignment is discrete); φ_i = e_{c(i)} / |cluster c(i)|, read by every query with a
    softmax over the slots (`bounded_memory_attention`). A cluster left empty is a slot
    nothing was written to (K̃ = 0, score 0), as in the op.

    Causal: a future key cannot move a centre, so the centres are kept across sequences
    (online spherical k-means, as in the Routing Transformer): n unit vectors per head,
    a buffer moved towards the unit keys assigned to it by every training forward (see
    `decay`). Token i goes to the centre of largest cosine, c(i), and slot j at position t
    holds the mean of the keys / values of positions ≤ t in cluster j: ABC_MLP with slot
    logits 0 for c(i) and PAD_LOGIT / 2 elsewhere, so decoding keeps the same fixed-size
    state. A slot with no member yet holds the mean of the real tokens of the prefix; padding
    (PAD_LOGIT, far below a non-member) writes nothing, even there.
    """

    def __init__(self, spec: LayerSpec, options: ABCClusterOptions) -> None:
        super().__init__(spec, options.bias)
        self.options = options
        self.num_slots = options.num_clusters
        centres = torch.randn(spec.n_heads, options.num_clusters, spec.head_dim)
        self.register_buffer("centres", F.normalize(centres, dim=-1))

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """Causal only: the ABC_MLP memory of n slots (log_z [B, H, n], [B, H, n, D] twice)."""
        if not self.spec.causal:
            raise ConfigError("attention: 'abc-cluster' in a bidirectional model clusters "
                              "the whole sequence and has no decoding state")
        return self.empty_abc_state(batch_size, self.num_slots, device, dtype)

    @torch.no_grad()
    def move_centres(self, unit: torch.Tensor, cluster: torch.Tensor,
                     mask: torch.Tensor | None) -> None:
        """One online k-means step: each centre towards the mean unit key assigned to it."""
        n, decay = self.num_slots, self.options.decay
        member = F.one_hot(cluster, n).to(unit.dtype)  # [B, T, H, n]
        if mask is not None:
            member = member * mask[:, :, None, None]
        sums = torch.einsum("bthn,bthd->hnd", member, unit).to(self.centres.dtype)
        count = member.sum((0, 1))[..., None].to(self.centres.dtype)  # [H, n, 1]
        moved = F.normalize(decay * self.centres + (1 - decay) * sums / count.clamp(min=1),
                            dim=-1)
        self.centres.copy_(torch.where(count > 0, moved, self.centres))

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], state)."""
        _, q, k, v = self.project(x, memory_state, attention_mask, positions)
        n = self.num_slots
        if self.spec.causal:
            unit = F.normalize(k.detach().to(compute_dtype(k)), dim=-1)  # fp32 at least
            cluster = nearest_centre(unit, self.centres)
            if self.training:
                self.move_centres(unit, cluster, attention_mask)
            s = torch.where(F.one_hot(cluster, n).bool(), 0.0, PAD_LOGIT / 2).to(q.dtype)
            return self.attend_logits(q, k, v, s, memory_state, attention_mask), memory_state
        member = F.one_hot(cluster_keys(k, n, self.options.iters, attention_mask), n).to(q.dtype)
        if attention_mask is not None:
            member = member * attention_mask[:, :, None, None].to(q.dtype)
        phi = member / member.sum(1, keepdim=True).clamp(min=1)  # [B, T, H, n]
        o, _ = bounded_memory_attention(q, k, v, phi, causal=False)
        return self.finish(o), None
