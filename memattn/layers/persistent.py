"""`persistent`: all-attention with a persistent memory (Sukhbaatar et al. 2019).

Each head reads N learned, input-independent key / value vectors together with the
context, in one softmax; the block has no feed-forward sublayer, the persistent vectors
take its place. The memory is written once, by training, and read by every query:

    write   k_n = √Kp · k′_n,  v_n = √N · v′_n   (k′ ~ N(0, 1/Kp), v′ ~ N(0, 1/N) at init:
            the paper's reparameterisation, unit-variance vectors from the start)
    read    o_t = Σ_c a_tc v_c + Σ_n a_tn v_n,  a_t = softmax over [context seen by t, 1..N]

Options (`attention.OPTION=VALUE`):

    n_persistent        N vectors per head (0: all-attention without them, and no feed-forward)
    variant             all-attn (one joint softmax) | attn-split (a softmax over the context and
                        one over the persistent vectors, reads summed) | head-split (half the
                        heads read only the context, half only the persistent vectors) |
                        single-head (N vectors of size d shared by all heads: their scores use
                        the full-width query, the same for every head, in each head's joint
                        softmax; each head reads its slice of the values) | ff-attn (plain
                        context attention, and the N vectors in a feed-forward sublayer of
                        their own: y = softmax(x Kᵀ / √d) V, the MLP with softmax for ReLU)
    context             softmax: every past token | window: the last `window` tokens
    relative_positions  learned p(t, c) = u_(t-c) added to the context keys (per layer,
                        shared by the heads; `max_distance` embeddings, farther ones clipped)
    adaptive_span       a soft mask m_z(x) = clamp((R + z - x) / R, 0, 1) per head with a
                        learned span z ∈ [0, span_max] (R = span_ramp), never applied to the
                        persistent vectors; span_loss · span_max · mean z joins the objective
                        through `aux_loss()`; the context is cut at span_max tokens.

Positions: under the model's rotary positions the context keys and the queries are rotated
and the persistent scores use the unrotated query (no position term for them).

Decoding state: a `KVCache` of the context keys and values. Full context: it grows
like a KV cache. Window or adaptive span: it keeps the last window - 1 / span_max - 1 tokens
(fixed size); in eval mode an adaptive-span cache keeps only ⌈max z + R⌉ tokens, the farthest
any head still sees. The same state carries the memory between training segments
(`train.segments`, Transformer-XL style): its tensors are stored detached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError
from memattn.layers.base import AttentionLayer, KVCache, LayerSpec, StateSize, register
from memattn.ops.persistent import DistanceTerms, KVState, persistent_attention

VARIANTS = ("all-attn", "attn-split", "head-split", "single-head", "ff-attn")
CONTEXTS = ("softmax", "window")


@dataclass
class PersistentOptions:
    n_persistent: int = 64  # N vectors per head; N = ff_mult · d matches an MLP's parameters
    variant: Literal["all-attn", "attn-split", "head-split", "single-head", "ff-attn"] = "all-attn"
    context: Literal["softmax", "window"] = "softmax"
    window: int = 0  # context="window": keys a query sees, itself included
    relative_positions: bool = False
    max_distance: int = 0  # relative embeddings; 0: the context limit, else model.max_len
    adaptive_span: bool = False
    span_max: int = 0  # S: the longest span, in tokens (needed by adaptive_span)
    span_ramp: int = 32  # R: the soft mask's ramp, in tokens
    span_init: float = 0.0  # z / S at initialisation
    span_loss: float = 2e-6  # λ of the span penalty λ · S · mean z/S, per layer
    bias: bool = False  # biases on the q/k/v and output projections

    def __post_init__(self) -> None:
        if self.n_persistent < 0:
            raise ConfigError(f"attention.n_persistent: expected a number of persistent vectors "
                              f"N >= 0, got {self.n_persistent}")
        if self.variant not in VARIANTS:
            raise ConfigError(f"attention.variant: expected one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if self.context not in CONTEXTS:
            raise ConfigError(f"attention.context: expected one of {', '.join(CONTEXTS)}, got {self.context!r}")
        if self.variant in ("head-split", "ff-attn") and self.n_persistent == 0:
            raise ConfigError(f"attention.n_persistent: variant {self.variant!r} needs N >= 1 "
                              "persistent vectors, got 0")
        if self.context == "window" and self.window < 1:
            raise ConfigError(f"attention.window: context 'window' needs the number of tokens a "
                              f"query sees (>= 1), got {self.window}")
        if self.context != "window" and self.window != 0:
            raise ConfigError(f"attention.window: only read with attention.context=window, got "
                              f"window={self.window} with context={self.context!r}")
        if self.adaptive_span and self.span_max < 1:
            raise ConfigError(f"attention.span_max: adaptive_span needs a maximum span (a positive "
                              f"number of tokens), got {self.span_max}")
        if self.span_ramp < 1:
            raise ConfigError(f"attention.span_ramp: expected a ramp of >= 1 tokens, got {self.span_ramp}")
        if not 0.0 <= self.span_init <= 1.0:
            raise ConfigError(f"attention.span_init: expected a fraction of span_max in [0, 1], got {self.span_init}")
        if self.span_loss < 0:
            raise ConfigError(f"attention.span_loss: expected a coefficient >= 0, got {self.span_loss}")
        if self.max_distance < 0:
            raise ConfigError(f"attention.max_distance: expected >= 0 (0: automatic), got {self.max_distance}")


class PersistentMemory(nn.Module):
    """N learned key / value vectors for each of `heads` heads, reparameterised.

    Stored k′ [heads, N, key_dim] ~ N(0, 1/key_dim) and v′ [heads, N, value_dim] ~ N(0, 1/N);
    forward() returns k = √key_dim · k′ and v = √N · v′, both of unit variance at init.
    """

    def __init__(self, heads: int, n: int, key_dim: int, value_dim: int) -> None:
        super().__init__()
        self.n, self.key_dim = n, key_dim
        self.keys = nn.Parameter(torch.randn(heads, n, key_dim) / math.sqrt(key_dim))
        self.values = nn.Parameter(torch.randn(heads, n, value_dim) / math.sqrt(n))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return math.sqrt(self.key_dim) * self.keys, math.sqrt(self.n) * self.values


class SoftmaxFeedForward(nn.Module):
    """The ff-attn sublayer: a feed-forward with softmax for ReLU, y = softmax(x Kᵀ / √d) V.

    K, V [N, d] are persistent vectors (reparameterised, `PersistentMemory`): attention of
    each position over them alone. x [B, T, d] -> y [B, T, d]; 2·N·d parameters.
    """

    def __init__(self, d: int, n: int, dropout: float) -> None:
        super().__init__()
        self.memory = PersistentMemory(1, n, d, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.memory()  # [1, N, d]
        y = F.scaled_dot_product_attention(x[:, None], k[None].to(x.dtype), v[None].to(x.dtype))
        return self.dropout(y[:, 0])


def softmax_feedforward(spec: LayerSpec, options: PersistentOptions) -> nn.Module | None:
    """The block's feed-forward slot for the ff-attn variant (None for the others: no FF)."""
    if options.variant != "ff-attn":
        return None
    return SoftmaxFeedForward(spec.d_model, options.n_persistent, spec.dropout)


@register("persistent", options=PersistentOptions, replaces_feedforward=True,
          feedforward=softmax_feedforward, aux_loss=True, project_parameters=True,
          fixed_state=lambda o: o.context == "window" or o.adaptive_span,
          state_size=StateSize("window", with_options={"context": "window"}))
class PersistentAttention(AttentionLayer):
    """All-attention: heads read the context and N learned persistent key/value vectors in one softmax; no feed-forward."""

    def __init__(self, spec: LayerSpec, options: PersistentOptions) -> None:
        H, d = spec.n_heads, spec.d_model
        if options.variant == "head-split" and H % 2:
            raise ConfigError(f"attention.variant: head-split gives half the heads to the context and "
                              f"half to the persistent vectors, so it needs an even model.n_heads, got {H}")
        D = spec.head_dim
        self.n_context_heads = H // 2 if options.variant == "head-split" else H
        super().__init__(spec, bias=options.bias, kv_heads=self.n_context_heads)
        self.options = options
        self.op_variant = {"attn-split": "split", "head-split": "heads"}.get(options.variant, "joint")
        n = 0 if options.variant == "ff-attn" else options.n_persistent  # ff-attn: in its FF sublayer
        self.persistent = None
        if n > 0 and options.variant == "single-head":
            self.persistent = PersistentMemory(1, n, d, d)
        elif n > 0:
            self.persistent = PersistentMemory(H - self.n_context_heads if self.op_variant == "heads" else H, n, D, D)
        limits = ([options.window] if options.context == "window" else []) + \
                 ([options.span_max] if options.adaptive_span else [])
        self.limit = min(limits) if limits else None  # a query sees keys at distance < limit
        self.rel = None
        if options.relative_positions:
            reach = options.max_distance or self.limit or spec.max_len
            rows = reach if spec.causal else 2 * reach - 1
            self.rel = nn.Parameter(torch.randn(rows, D) / math.sqrt(D))  # u_(t-c)
        self.span = None
        if options.adaptive_span:
            self.span = nn.Parameter(torch.full((self.n_context_heads,), float(options.span_init)))  # z / S

    # -- adaptive span ---------------------------------------------------------------------

    def spans(self) -> list[float]:
        """The learned spans z per context head, in tokens ([] without adaptive span)."""
        if self.span is None:
            return []
        return (self.span.detach().clamp(0, 1) * self.options.span_max).tolist()

    def set_spans(self, tokens: list[float]) -> None:
        """Set the spans z per context head, in tokens (e.g. another model's `spans()`)."""
        with torch.no_grad():
            self.span.copy_(torch.tensor(tokens, dtype=self.span.dtype) / self.options.span_max)

    def project_parameters(self) -> None:
        """The paper's projection of z onto [0, S] after each update (the training loop calls
        it after every optimizer step; forward only reads z clamped)."""
        if self.span is not None:
            self.span.clamp_(0.0, 1.0)

    def aux_loss(self) -> torch.Tensor | None:
        """The span penalty span_loss · span_max · mean_h z_h / span_max (None without adaptive span)."""
        if self.span is None:
            return None
        return self.options.span_loss * self.options.span_max * self.span.clamp(0, 1).mean()

    def cache_tokens(self) -> int | None:
        """Past tokens a decoding cache keeps after each step (None: all of them)."""
        if self.limit is None:
            return None
        keep = self.limit - 1
        if self.span is not None and not self.training:  # beyond ⌈max z + R⌉ the mask is 0
            z = max(self.spans())
            keep = min(keep, math.ceil(z + self.options.span_ramp))
        return keep

    # -- layer interface -------------------------------------------------------------------

    def init_state(self, batch_size: int, device=None, dtype=None) -> KVCache:
        return KVCache(None if self.limit is None else self.limit - 1)

    def forward(self, x: torch.Tensor, *, memory_state: KVCache | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d] -> (y [B, T, d], memory_state).

        attention_mask: bool [B, T], False for padding tokens of x (the cache remembers which
        of its keys were padding). positions [B, T]: rotary positions (default: after the
        tokens the state holds). With memory_state, continue after the tokens it holds and
        append to it.
        """
        offset, q, k, v = self.project(x, memory_state, attention_mask, rotate=False)
        B, T, d = x.shape
        H = self.spec.n_heads
        pq, pscale = None, None
        pk, pv = self._persistent()
        if self.options.variant == "single-head" and pk.shape[1] > 0:
            pq, pscale = q.reshape(B, T, 1, d).expand(B, T, H, d), d ** -0.5  # full-width query
        if self.rotary is not None:
            if pq is None and pk.shape[1] > 0:
                pq = q[:, :, H - pk.shape[0]:]  # persistent scores: unrotated query
            q, k = self.rotate(q, k, positions if positions is not None else offset)
        past = memory_state.past() if memory_state is not None else None
        new_mask = attention_mask
        if past is not None and (attention_mask is not None or memory_state.masked):
            mine = attention_mask if attention_mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
            attention_mask = torch.cat([memory_state.real(), mine], 1)
        keep = self.cache_tokens()
        written = memory_state is not None and memory_state.grows_in_place(keep)
        if written:
            # unbounded decoding: write first, then read every key where the cache holds it
            # (query i sits at position Tk - Tq + i either way), instead of copying the cache
            memory_state.append(k, v, keep=keep, real=new_mask)
            (k, v), past = memory_state.past(), None
        span = self.span.clamp(0, 1) * self.options.span_max if self.span is not None else None
        distance = DistanceTerms(self.rel, span, float(self.options.span_ramp), self.limit)
        initial = None if past is None else KVState(*(t.transpose(1, 2) for t in past))  # [B, Hc, T0, D]
        o, _ = persistent_attention(q, k, v, pk, pv, causal=self.spec.causal, variant=self.op_variant,
                                    pq=pq, pscale=pscale, distance=distance,
                                    attention_mask=attention_mask, initial_state=initial)
        if memory_state is not None and not written:
            memory_state.append(k, v, keep=keep, real=new_mask)
        return self.finish(o), memory_state

    def _persistent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Persistent keys [Hp, N, Kp] and values [Hp, N, D] as the op reads them."""
        H, D = self.spec.n_heads, self.spec.head_dim
        if self.persistent is None:
            heads = H - self.n_context_heads if self.op_variant == "heads" else H
            empty = self.qkv.weight.new_zeros(heads, 0, D)
            return empty, empty
        k, v = self.persistent()
        if self.options.variant == "single-head":  # [1, N, d]: one set of vectors for all heads
            N = k.shape[1]
            return k.expand(H, N, self.spec.d_model), v[0].view(N, H, D).transpose(0, 1)
        return k, v
