"""abc-window and abc-dilated: ABC with FIFO-queue control, read as windowed softmax attention.

A queue of the last n tokens (the paper's shift-matrix control) holds exactly their keys
and values, so its read is softmax attention over a window (`memattn.ops.window`);
abc-dilated adds a second queue written only by the tokens at positions 0, d, 2d, ...
Decoding keeps each queue as an n-slot ring buffer (`RingBufferState`, slot p mod n), so the
state never grows. Padding keys are masked out of the read and never enter a queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memattn.errors import ConfigError
from memattn.layers.abc.common import ABCLayer, check_positive
from memattn.layers.base import AttentionState, Cross, LayerSpec, StateSize, register
from memattn.layers.cross import SourceKV
from memattn.layers.softmax import SoftmaxCrossAttention
from memattn.ops.softmax import softmax_attention
from memattn.ops.window import (WindowState, counted_softmax, in_strided_queue, in_window,
                                local_window_attention)


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
        check_positive("window", self.window)


@dataclass
class ABCDilatedOptions(ABCWindowOptions):
    """Options of `abc-dilated`: those of `abc-window` (the local queue of n slots), and

    dilation: d, the second queue holds the last n tokens at positions 0, d, 2d, ...
    """

    dilation: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("dilation", self.dilation)


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


class WindowCrossAttention(SoftmaxCrossAttention):
    """abc-window: the FIFO queue after the whole source holds its last n real tokens."""

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> SourceKV:
        k, v = self.source_kv(src, src_mask)
        B, S, _ = src.shape
        n = min(self.options.window, S)
        real = src_mask if src_mask is not None else torch.ones(B, S, dtype=torch.bool, device=src.device)
        rank = torch.where(real, torch.arange(S, device=src.device), -1)  # [B, S], -1: padding
        last = rank.topk(n, dim=1).values.flip(1)  # [B, n] the n latest, in order
        idx = last.clamp_min(0)[:, :, None, None].expand(B, n, *k.shape[2:])
        return SourceKV(k.gather(1, idx), v.gather(1, idx), last >= 0)


# streams: a model trained on 256 characters reads 2.30 bpc at 256, 2.28 at 2,048 and 16,384
@register("abc-window", options=ABCWindowOptions, streaming=True, state_size=StateSize("window"),
          cross=Cross(WindowCrossAttention, "the queue after the whole source: its last n real tokens, "
                      "read by softmax (SourceKV of at most n tokens)"),
          test_options={"window": 4})
class ABCWindowAttention(ABCLayer):
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
        n = self.options.window
        real = (attention_mask if attention_mask is not None
                else torch.ones(B, T, dtype=torch.bool, device=x.device))
        qpos = torch.arange(offset, offset + T, device=x.device)
        if self.dilated and positions is not None:
            shift = (qpos[None] - positions).masked_select(real)
            if bool((shift % self.options.dilation != 0).any()):
                raise ConfigError(f"abc-dilated: its dilated queue holds positions 0, d, 2d, ... of the "
                                  f"batch; left-pad each row by a multiple of attention.dilation = "
                                  f"{self.options.dilation} tokens")
        if memory_state is not None and T == 1 and not (
                torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
            o = self._decode_step(memory_state.queues, q, k, v, real, offset)
            memory_state.seen += 1
            return self.finish(o), memory_state
        if offset == 0 and T > n:  # from an empty state: in blocks
            o, _ = local_window_attention(q, k, v, window=n, causal=self.spec.causal,
                                          dilation=self.options.dilation if self.dilated else 0,
                                          attention_mask=attention_mask)
        elif not self.dilated and memory_state is not None and T > n:
            # a long continuation: the held queue, in position order, as the op's state (its
            # slots hold positions offset - n .. offset - 1), then the new tokens in blocks
            queue = memory_state.queues[0]
            order = torch.argsort(queue.pos)  # empty slots (-1) first
            held = queue.real[:, order] & (queue.pos[order] >= 0)[None]  # [B, n]
            state = WindowState(queue.k[:, order].transpose(1, 2), queue.v[:, order].transpose(1, 2),
                                held[:, None].expand(-1, self.spec.n_heads, -1))
            o, _ = local_window_attention(q, k, v, window=n, causal=True, attention_mask=attention_mask,
                                          initial_state=state)
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
            memory_state.queues[0].write(k, v, real, qpos, torch.remainder(qpos, n))
            if self.dilated:  # the tokens at multiples of d, found without reading qpos
                d = self.options.dilation
                first = -(-offset // d) * d
                on = torch.arange(first, max(first, offset + T), d, device=x.device)
                rows = on - offset
                memory_state.queues[1].write(k.index_select(1, rows), v.index_select(1, rows),
                                             real.index_select(1, rows), on,
                                             torch.remainder(on // d, n))
            memory_state.seen += T
        return self.finish(o), memory_state

    def _decode_step(self, queues: list[RingBufferState], q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, real: torch.Tensor, position: int) -> torch.Tensor:
        """One token at `position`, no gradient: written into its slot of each queue that takes
        it, in place (it replaces the token n back there, which has left that queue), then
        one softmax over every held slot; a token in both queues is held, and weighs, twice."""
        n = self.options.window
        slots = [position % n]
        if self.dilated:  # the dilated queue takes positions 0, d, 2d, ...
            d = self.options.dilation
            slots.append((position // d) % n if position % d == 0 else None)
        for queue, slot in zip(queues, slots):
            if slot is not None:
                queue.k[:, slot] = k[:, 0]
                queue.v[:, slot] = v[:, 0]
                queue.real[:, slot] = real[:, 0]
                queue.pos[slot].fill_(position)  # a kernel argument, no copy to wait on

        def joined(parts: list[torch.Tensor]) -> torch.Tensor:  # the queues' slots, one after another
            return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

        held = joined([queue.real & (queue.pos >= 0)[None] for queue in queues])
        keys, values = joined([queue.k for queue in queues]), joined([queue.v for queue in queues])
        o, _ = softmax_attention(q, keys.to(q.dtype), values.to(v.dtype), causal=False,
                                 attention_mask=held)
        return o


@register("abc-dilated", options=ABCDilatedOptions, bidirectional=False, state_size=StateSize("window"),
          left_padding=False, test_options={"window": 3, "dilation": 3})
class ABCDilatedAttention(ABCWindowAttention):
    """ABC with dilated-window control: two FIFO queues of n slots each; fixed-size state.

    The local queue holds the last n tokens (as abc-window), the dilated one the last n
    tokens at positions 0, d, 2d, ... (a shift-matrix queue written only by those). The read
    is one softmax over the 2n slots, so a token held by both queues weighs twice, as its
    two slots do in the paper's memory. Causal only: the queues are a left-to-right write rule.
    A sequence read from an empty state is computed in blocks, O(T · n), as abc-window's.
    """

    dilated = True
