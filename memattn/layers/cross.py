"""Cross attention: queries from a target sequence read a memory written by a source sequence.

A cross layer has two halves, so that a decoder writes the source's memory once and reads
it at every step:

    memory(src [B, S, d], src_mask [B, S] | None) -> memory of the source
    forward(x [B, T, d], memory) -> y [B, T, d]

A memory is a NamedTuple of tensors whose first dimension is the batch (beam search repeats
and reorders it field by field). Each mechanism writes it with its own rule, applied to
the whole source (a set: no position of the target enters it):

    softmax        the source's keys and values and its mask (`SourceKV`): grows with S.
    abc-window     the queue after the source: its last n real tokens, read by softmax
                   (`SourceKV` of at most n tokens).
    abc-mlp        ABC_MLP (Peng et al. 2022): `cross_slots` slots per head written with
                   φ = act(W_φ h) normalised over the source (`ABCState`).
    abc-linformer  φ_s = softplus(W^LF[s]) over the source positions s (own W^LF).
    abc-random     φ_s = e_{i_s}, a fixed pseudo-random slot per source position and head.
    abc-meanpool   φ_s = e_{⌊s/c⌋} / c.
    abc-l2g        φ_s = e_{s/c} on every c-th source token.
    abc-cluster    the source keys grouped by k-means; slot j the mean of cluster j.
                   These five write a `BoundedMemoryState` (K̃ = Σ φ_s ⊗ k_s, Ṽ likewise).
    gsa            gated slot attention (Zhang et al. 2024): `cross_slots` slots per head
                   written in source order, each keeping α_s = σ(W_g h_s)^(1/τ) of what it
                   holds and taking the rest from token s (`GSAState`).
    linear, gated-linear
                   C = Σ_s v_s φ(k_s)ᵀ (gated: g_s ⊙ on keys and values), read C φ(q)
                   (normalised by z = Σ_s φ(k_s) when the mechanism normalises) (`LinearMemory`).

The slot memories (every abc-* above but the window, and gsa) are read by a softmax over the
slots, o = softmax_M(K̃ q / √D)ᵀ Ṽ; their size is fixed whatever S, and the sizes come from
the cross mechanism's own options (`model.cross_attention`; abc-mlp's or gsa's `cross_slots`
when the model's own mechanism serves). Source positions count real tokens only, so a padded
source writes what it would alone; padding writes nothing.

A mechanism says in the registry whether it can serve as cross attention and with which
layer (`register_cross` below); `build_cross_attention(name, options, spec)` builds it, and
a mechanism that cannot is refused with a ConfigError naming those that can: never a silent
softmax.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError, ShapeError, check_tensor
from memattn.layers.abc import PAD_LOGIT, activation_logits, forget_gates, reset_phi
from memattn.layers.abc.given import l2g_phi, linformer_phi, meanpool_phi, random_phi
from memattn.layers.base import LayerSpec, check_mask, get_mechanism, mechanisms, parse_options, register_cross
from memattn.layers.linear import NORMALIZER_EPS, feature
from memattn.ops.abc import ABCState, BoundedMemoryState
from memattn.ops.abc.chunked import abc_memory, read_memory
from memattn.ops.abc.cluster import sequence_kmeans
from memattn.ops.contract import compute_dtype
from memattn.ops.gsa import GSAState, gsa_memory
from memattn.ops.softmax import softmax_attention


class SourceKV(NamedTuple):
    """A memory of source tokens: their keys and values [B, S, H, D], mask [B, S] | None."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None


class LinearMemory(NamedTuple):
    """Linear cross attention's memory: C [B, H, K, V] = Σ φ(k) vᵀ, z [B, H, K] = Σ φ(k) | None."""

    c: torch.Tensor
    z: torch.Tensor | None


def source_positions(src_mask: torch.Tensor | None, B: int, S: int, device) -> tuple[torch.Tensor, int]:
    """Positions of the source tokens counted over real ones ([1 or B, S] int64) and the largest."""
    if src_mask is None:
        return torch.arange(S, device=device)[None], S - 1
    pos = (src_mask.long().cumsum(1) - 1).clamp_min(0)
    return pos, int(pos.max())


class _Cross(nn.Module):
    """Query, key / value and output projections shared by the cross layers."""

    def __init__(self, spec: LayerSpec, options: Any) -> None:
        super().__init__()
        self.spec = spec
        self.options = options
        bias = getattr(options, "bias", False)
        self.q = nn.Linear(spec.d_model, spec.d_model, bias=bias)
        self.kv = nn.Linear(spec.d_model, 2 * spec.d_model, bias=bias)
        self.out = nn.Linear(spec.d_model, spec.d_model, bias=bias)
        self.dropout = nn.Dropout(spec.dropout)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, H, D]."""
        return x.view(*x.shape[:2], self.spec.n_heads, self.spec.head_dim)

    def source_kv(self, src: torch.Tensor, src_mask: torch.Tensor | None):
        check_tensor("src", src, "[B, S, d]", None, None, self.spec.d_model)
        check_mask(src_mask, *src.shape[:2], name="src_mask")
        return (self.heads(t) for t in self.kv(src).chunk(2, dim=-1))

    def query(self, x: torch.Tensor, memory_batch: int) -> torch.Tensor:
        """x [B, T, d] (B = the memory's batch) -> queries [B, T, H, D]."""
        check_tensor("x", x, "[B, T, d]", None, None, self.spec.d_model)
        if x.shape[0] != memory_batch:
            raise ShapeError(f"x: batch of {x.shape[0]} for a memory of batch {memory_batch}")
        return self.heads(self.q(x))

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.out(o.flatten(2)))


class SoftmaxCrossAttention(_Cross):
    """Softmax over every source token; the memory holds the source's keys and values."""

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> SourceKV:
        k, v = self.source_kv(src, src_mask)
        return SourceKV(k, v, src_mask)

    def forward(self, x: torch.Tensor, memory: SourceKV) -> torch.Tensor:
        q = self.query(x, memory.k.shape[0])
        o, _ = softmax_attention(q, memory.k, memory.v, causal=False, attention_mask=memory.mask)
        return self.finish(o)


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


class SlotCrossAttention(_Cross):
    """A bounded memory of M slots per head written by the source, read by a softmax over
    the slots; subclasses write it (`memory`)."""

    def forward(self, x: torch.Tensor, memory: ABCState | BoundedMemoryState | GSAState) -> torch.Tensor:
        q = self.query(x, memory.k.shape[0])
        o = read_memory(q.to(memory.k.dtype), memory.k, memory.v, self.spec.head_dim ** -0.5)
        return self.finish(o.to(x.dtype))

    def given_phi(self, k: torch.Tensor, v: torch.Tensor, phi: torch.Tensor) -> BoundedMemoryState:
        """K̃ = Σ_s φ_s ⊗ k_s, Ṽ likewise: k, v [B, S, H, D], φ [B, S, H, M] -> [B, H, M, D] twice,
        in float32 at least."""
        dt = compute_dtype(k)
        phi = phi.to(dt)
        return BoundedMemoryState(torch.einsum("bshm,bshk->bhmk", phi, k.to(dt)),
                                  torch.einsum("bshm,bshv->bhmv", phi, v.to(dt)))


class ABCCrossAttention(SlotCrossAttention):
    """ABC_MLP cross attention: `cross_slots` slots per head written by the source, fixed size."""

    def __init__(self, spec: LayerSpec, options: Any) -> None:
        super().__init__(spec, options)
        self.phi = nn.Linear(spec.d_model, spec.n_heads * options.cross_slots, bias=options.bias)
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """W_φ from attention.phi_init_std, as abc-mlp's self-attention."""
        reset_phi(self.phi, self.options.phi_init_std)

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> ABCState:
        """src [B, S, d] -> ABCState (log_z [B, H, M], k [B, H, M, D], v [B, H, M, D]).

        Padding (src_mask False) writes nothing; the memory is fp32 for fp16 / bf16 inputs.
        """
        k, v = self.source_kv(src, src_mask)
        B, S, _ = src.shape
        s = activation_logits(self.phi(src).view(B, S, self.spec.n_heads, -1),
                              self.options.activation)
        if src_mask is not None:
            s = s.masked_fill(~src_mask[:, :, None, None], PAD_LOGIT)
        dt = compute_dtype(src)
        return abc_memory(k.to(dt), v.to(dt), s.to(dt))


class GSACrossAttention(SlotCrossAttention):
    """gsa cross attention: `cross_slots` slots per head written by the source through its
    forget gates, in order; fixed size."""

    def __init__(self, spec: LayerSpec, options: Any) -> None:
        super().__init__(spec, options)
        self.gate = nn.Linear(spec.d_model, spec.n_heads * options.cross_slots, bias=options.bias)

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> GSAState:
        """src [B, S, d] -> GSAState (k [B, H, M, D], v [B, H, M, D]): the memory after the
        source. Padding (src_mask False) has α = 1 and writes nothing; fp32 for fp16 / bf16."""
        k, v = self.source_kv(src, src_mask)
        g = forget_gates(self.gate, src, self.spec.n_heads, self.options.gate_logit_normalizer,
                         src_mask)
        dt = compute_dtype(src)
        return gsa_memory(k.to(dt), v.to(dt), g.to(dt))


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


class LinformerCrossAttention(GivenPhiCrossAttention):
    """abc-linformer: φ_s = softplus(W^LF[s]), its own W^LF [max_len, M]."""

    def __init__(self, spec: LayerSpec, options: Any) -> None:
        super().__init__(spec, options)
        self.columns = nn.Parameter(torch.randn(spec.max_len, options.num_slots))

    def phi(self, pos, last):
        return linformer_phi(self.columns, pos, last)


class RandomCrossAttention(GivenPhiCrossAttention):
    """abc-random: φ_s = e_{i_s}, a fixed pseudo-random slot per source position and head."""

    def phi(self, pos, last):
        return random_phi(pos, self.spec.n_heads, self.options.num_slots, self.options.seed)


class MeanPoolCrossAttention(GivenPhiCrossAttention):
    """abc-meanpool: φ_s = e_{⌊s/c⌋} / c."""

    def phi(self, pos, last):
        return meanpool_phi(pos, last, self.options.pool, self.options.num_slots, torch.float32)


class L2GCrossAttention(GivenPhiCrossAttention):
    """abc-l2g: φ_s = e_{s/c} on every c-th source token."""

    def phi(self, pos, last):
        return l2g_phi(pos, last, self.options.every, self.options.num_slots)


class ClusterCrossAttention(SlotCrossAttention):
    """abc-cluster cross attention: the source keys grouped by k-means (`sequence_kmeans`);
    slot j holds the mean key / value of cluster j (an empty cluster holds zeros)."""

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> BoundedMemoryState:
        k, v = self.source_kv(src, src_mask)
        n = self.options.num_clusters
        member = F.one_hot(sequence_kmeans(k, n, self.options.iters, src_mask), n).to(compute_dtype(k))
        if src_mask is not None:
            member = member * src_mask[:, :, None, None]
        return self.given_phi(k, v, member / member.sum(1, keepdim=True).clamp(min=1))


class LinearCrossAttention(_Cross):
    """linear / gated-linear cross attention: C = Σ_s v_s φ(k_s)ᵀ over the source, read
    C φ(q) (divided by z·φ(q), z = Σ_s φ(k_s), when the mechanism normalises); gated, the
    source's gate g_s = σ(W_g h_s + b_g) multiplies its keys and values. No decay: the
    source is a set."""

    def __init__(self, spec: LayerSpec, options: Any, gated: bool) -> None:
        super().__init__(spec, options)
        self.gate = nn.Linear(spec.d_model, spec.d_model) if gated else None

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> LinearMemory:
        k, v = self.source_kv(src, src_mask)
        dt = compute_dtype(k)
        k, v = feature(k, self.options.feature_map).to(dt), v.to(dt)
        if self.gate is not None:
            g = torch.sigmoid(self.gate(src)).view_as(k).to(dt)
            k, v = g * k, g * v
        if src_mask is not None:
            k = k * src_mask[:, :, None, None]  # padding writes nothing
        z = k.sum(1) if self.options.normalize else None  # [B, H, K]
        return LinearMemory(torch.einsum("bshk,bshv->bhkv", k, v), z)

    def forward(self, x: torch.Tensor, memory: LinearMemory) -> torch.Tensor:
        q = feature(self.query(x, memory.c.shape[0]), self.options.feature_map).to(memory.c.dtype)
        o = torch.einsum("bthk,bhkv->bthv", q, memory.c)
        if memory.z is not None:
            o = o / torch.einsum("bthk,bhk->bth", q, memory.z)[..., None].clamp_min(NORMALIZER_EPS)
        return self.finish(o.to(x.dtype))


register_cross("softmax", SoftmaxCrossAttention)
register_cross("abc-window", WindowCrossAttention)
register_cross("abc-mlp", ABCCrossAttention)
register_cross("abc-linformer", LinformerCrossAttention)
register_cross("abc-random", RandomCrossAttention)
register_cross("abc-meanpool", MeanPoolCrossAttention)
register_cross("abc-l2g", L2GCrossAttention)
register_cross("abc-cluster", ClusterCrossAttention)
register_cross("gsa", GSACrossAttention)
register_cross("linear", lambda spec, o: LinearCrossAttention(spec, o, gated=False))
register_cross("gated-linear", lambda spec, o: LinearCrossAttention(spec, o, gated=True))


def cross_mechanisms() -> list[str]:
    """The registered mechanisms that can serve as cross attention."""
    return [name for name, m in mechanisms().items() if m.cross is not None]


def build_cross_attention(name: str, options: dict[str, Any] | Any, spec: LayerSpec) -> nn.Module:
    """The cross layer of mechanism `name` with its options; ConfigError if it has none."""
    mech = get_mechanism(name)
    if mech.cross is None:
        raise ConfigError(f"attention: {name!r} cannot serve as cross attention (it has no memory "
                          f"written by another sequence); mechanisms that can: "
                          f"{', '.join(cross_mechanisms())} (set model.cross_attention)")
    return mech.cross(spec, parse_options(name, options))
