"""ABC strategies whose write weights φ depend only on positions: abc-linformer, abc-random,
abc-meanpool and abc-l2g.

    abc-linformer   learned per-position columns φ_t = softplus(W^LF[t]) [M], W^LF [max_len, M];
                    causal through the recurrence.
    abc-random      φ_t = e_{i_t}, i_t a fixed pseudo-random slot (a hash of position and head).
    abc-meanpool    φ_t = e_{⌊t/c⌋} / c: slot j holds the mean of tokens jc .. jc+c-1.
    abc-l2g         local-to-global: φ_t = e_{t/c} for the global tokens t = 0, c, 2c, ..., else 0.

Each is a `GivenPhiLayer` with its own `write_weights`; the layer zeroes φ on padding and
reads the memory with `bounded_memory_attention` (no normalisation), so decoding keeps the
op's BoundedMemoryState (k, v [B, H, M, D]). Each has a cross layer, a `GivenPhiCrossAttention`
writing the source by the same rule at the source's positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ShapeError
from memattn.layers.abc.common import ABCLayer, ABCMemoryState, check_positive, state_dtype
from memattn.layers.base import Cross, LayerSpec, StateSize, register
from memattn.layers.cross import SlotCrossAttention, source_positions
from memattn.ops.abc import BoundedMemoryState, bounded_memory_attention
from memattn.ops.contract import compute_dtype


class GivenPhiLayer(ABCLayer):
    """An ABC layer whose write weights φ [B, T, H, M] depend only on positions (and padding)."""

    num_slots: int

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """An empty memory: zeros [B, H, M, D] for keys and values."""
        w = self.qkv.weight
        D = self.spec.head_dim
        return ABCMemoryState(BoundedMemoryState.empty(
            batch_size, self.spec.n_heads, self.num_slots, D, D,
            device=device if device is not None else w.device, dtype=state_dtype(dtype, w)))

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
        y = self.step_in_place(memory_state, q, k, v, phi)
        if y is not None:
            return y, memory_state
        initial = memory_state.inner if memory_state is not None else None
        o, state = bounded_memory_attention(q, k, v, phi, causal=self.spec.causal,
                                            initial_state=initial,
                                            output_final_state=memory_state is not None)
        if memory_state is not None:
            memory_state.update(state, T)
        return self.finish(o), memory_state


class GivenPhiCrossAttention(SlotCrossAttention):
    """The position-given strategies: φ from the positions of the real source tokens, by
    the strategy's own write rule (`phi`)."""

    def phi(self, pos: torch.Tensor, last: int) -> torch.Tensor:
        """pos [1 or B, S] int64, the largest `last` -> φ [1 or B, S, 1 or H, M]."""
        raise NotImplementedError

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> BoundedMemoryState:
        k, v = self.source_kv(src, src_mask)
        B, S, _ = src.shape
        pos, last = source_positions(src_mask, B, S, src.device)
        phi = self.phi(pos, last).to(compute_dtype(k)).expand(B, S, self.spec.n_heads, -1)
        if src_mask is not None:
            phi = phi * src_mask[:, :, None, None]  # padding writes nothing
        return self.given_phi(k, v, phi)


# --------------------------------------------------------------------------- abc-linformer


@dataclass
class ABCLinformerOptions:
    """Options of `abc-linformer`.

    num_slots: M, memory slots (columns of W^LF [max_len, M], shared by the heads).
    bias: biases on the q/k/v and output projections.
    """

    num_slots: int = 32
    bias: bool = False

    def __post_init__(self) -> None:
        check_positive("num_slots", self.num_slots)


class LinformerCrossAttention(GivenPhiCrossAttention):
    """abc-linformer: φ_s = softplus(W^LF[s]), its own W^LF [max_len, M]."""

    def __init__(self, spec: LayerSpec, options: ABCLinformerOptions) -> None:
        super().__init__(spec, options)
        self.columns = nn.Parameter(torch.randn(spec.max_len, options.num_slots))

    def phi(self, pos, last):
        return linformer_phi(self.columns, pos, last)


@register("abc-linformer", options=ABCLinformerOptions, state_size=StateSize("num_slots"),
          cross=Cross(LinformerCrossAttention, "M slots, φ_s = softplus(W^LF[s]) at the source's "
                      "positions s, with W^LF of its own (BoundedMemoryState)"),
          test_options={"num_slots": 8})
class ABCLinformerAttention(GivenPhiLayer):
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
        return linformer_phi(self.columns, pos, last)


def linformer_phi(columns: torch.Tensor, pos: torch.Tensor, last: int) -> torch.Tensor:
    """φ [1 or B, T, 1, M] = softplus(W^LF[pos]) for W^LF [max_len, M], pos [1 or B, T]."""
    if last >= columns.shape[0]:
        raise ShapeError(f"x: a Linformer model given a longer sequence than it was built "
                         f"for: positions up to {last + 1} exceed model.max_len={columns.shape[0]}")
    return F.softplus(columns[pos])[:, :, None, :]


# ------------------------------------------------------------------------------ abc-random


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
        check_positive("num_slots", self.num_slots)


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


class RandomCrossAttention(GivenPhiCrossAttention):
    """abc-random: φ_s = e_{i_s}, a fixed pseudo-random slot per source position and head."""

    def phi(self, pos, last):
        return random_phi(pos, self.spec.n_heads, self.options.num_slots, self.options.seed)


@register("abc-random", options=ABCRandomOptions, state_size=StateSize("num_slots"),
          cross=Cross(RandomCrossAttention, "M slots, φ_s = e_{i_s}: a fixed pseudo-random slot per "
                      "source position and head (BoundedMemoryState)"),
          test_options={"num_slots": 8})
class ABCRandomAttention(GivenPhiLayer):
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
        return random_phi(pos, self.spec.n_heads, self.num_slots, self.options.seed).to(x.dtype)


def random_phi(pos: torch.Tensor, heads: int, slots: int, seed: int) -> torch.Tensor:
    """φ [1 or B, T, H, M] one-hot on each token's pseudo-random slot (`random_slots`)."""
    return F.one_hot(random_slots(pos, heads, slots, seed), slots)


# ---------------------------------------------------------------------------- abc-meanpool


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
        check_positive("num_slots", self.num_slots)
        check_positive("pool", self.pool)


class MeanPoolCrossAttention(GivenPhiCrossAttention):
    """abc-meanpool: φ_s = e_{⌊s/c⌋} / c."""

    def phi(self, pos, last):
        return meanpool_phi(pos, last, self.options.pool, self.options.num_slots, torch.float32)


@register("abc-meanpool", options=ABCMeanPoolOptions,
          state_size=StateSize("num_slots", cover=lambda slots, length: {"pool": -(-length // slots)}),
          cross=Cross(MeanPoolCrossAttention, "M slots, φ_s = e_{⌊s/c⌋} / c: slot j the mean of "
                      "source tokens jc .. jc+c-1 (BoundedMemoryState)"),
          test_options={"num_slots": 16, "pool": 4})
class ABCMeanPoolAttention(GivenPhiLayer):
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
        return meanpool_phi(pos, last, self.options.pool, self.num_slots, x.dtype)


def meanpool_phi(pos: torch.Tensor, last: int, pool: int, slots: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """φ [1 or B, T, 1, M] = e_{⌊pos/c⌋} / c; ShapeError past slots · pool tokens."""
    if last >= pool * slots:
        raise ShapeError(f"x: positions up to {last + 1} exceed what abc-meanpool can hold, "
                         f"attention.num_slots * attention.pool = {slots} * {pool} = {slots * pool}")
    return (F.one_hot(pos // pool, slots).to(dtype) / pool)[:, :, None, :]


# --------------------------------------------------------------------------------- abc-l2g


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
        check_positive("num_slots", self.num_slots)
        check_positive("every", self.every)


class L2GCrossAttention(GivenPhiCrossAttention):
    """abc-l2g: φ_s = e_{s/c} on every c-th source token."""

    def phi(self, pos, last):
        return l2g_phi(pos, last, self.options.every, self.options.num_slots)


@register("abc-l2g", options=ABCL2GOptions, bidirectional=False,
          state_size=StateSize("num_slots", cover=lambda slots, length: {"every": -(-length // slots)}),
          cross=Cross(L2GCrossAttention, "M slots, φ_s = e_{s/c} on every c-th source token "
                      "(BoundedMemoryState)"),
          test_options={"num_slots": 16, "every": 4})
class ABCL2GAttention(GivenPhiLayer):
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
        return l2g_phi(pos, last, self.options.every, self.num_slots).to(x.dtype)


def l2g_phi(pos: torch.Tensor, last: int, every: int, slots: int) -> torch.Tensor:
    """φ [1 or B, T, 1, M] = e_{pos/c} on the global tokens (pos a multiple of c), else 0;
    ShapeError past slots · every tokens."""
    if last >= every * slots:
        raise ShapeError(f"x: positions up to {last + 1} exceed what abc-l2g can hold, "
                         f"attention.num_slots * attention.every = {slots} * {every} = {slots * every}")
    return (F.one_hot(pos // every, slots) * (pos % every == 0)[..., None])[:, :, None, :]
