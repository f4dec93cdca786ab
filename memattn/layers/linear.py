"""`linear` and `gated-linear`: cheap linear attention (de Brébisson & Vincent 2016) as layers.

The memory is one matrix per head, C_t = α_t C_{t-1} + β_t v_t k_tᵀ ([V, K]; kept as its
transpose [B, H, K, V], the op's layout), read linearly as o_t = C_t q_t. It never grows:
decoding costs O(K·V) a token whatever the length, and the decoding state is C itself.

Write and read rules per layer (φ the feature map, g the gate, all per head):

    linear         k_t = φ(W_k x_t)            v_t = W_v x_t        α = β = 1
    gated-linear   k_t = g_t ⊙ φ(W_k x_t)      v_t = g_t ⊙ W_v x_t  g_t = σ(W_g x_t + b_g)
                   (optionally α_t = σ(w_α·x_t + b_α), a forgetting gate per head)
    read           o_t = C_t φ(q_t)                        (normalize=False: the paper's read)
                   o_t = C_t φ(q_t) / (z_tᵀ φ(q_t))        (normalize=True)

where z_t = α_t z_{t-1} + k_t, the memory of the keys alone ([B, H, K, 1] in the state),
is written with the same keys and gates. Normalised, o_t is an average of past values
weighted by φ(k_i)·φ(q_t) > 0, so its scale does not depend on t; the paper's C q grows
with the number of tokens written. Normalising with elu+1 features is the default; the
paper's form is feature_map=identity, normalize=false.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError
from memattn.layers.base import AttentionLayer, AttentionState, Cross, LayerSpec, StateSize, register
from memattn.layers.cross import CrossLayer
from memattn.ops.contract import accumulation_dtype, compute_dtype
from memattn.ops.linear import LinearAttentionState, linear_attention

# Smallest normaliser z·q divided by: guards tokens that have seen only padding (z = 0).
NORMALIZER_EPS = 1e-6


@dataclass
class LinearOptions:
    """Options of the `linear` layer.

    feature_map: "elu+1" (φ(x) = elu(x) + 1 > 0) or "identity" (the paper's raw k and q).
    normalize: divide each read by z_tᵀ φ(q_t), the running sum of keys read with the same
        query (needs a positive feature map); False keeps the paper's unnormalised C q.
    bias: biases on the q/k/v and output projections.
    """

    feature_map: Literal["elu+1", "identity"] = "elu+1"
    normalize: bool = True
    bias: bool = False

    def __post_init__(self) -> None:
        if self.normalize and self.feature_map == "identity":
            raise ConfigError("attention.normalize: true needs a positive feature map "
                              "(feature_map=elu+1); with feature_map=identity the normaliser "
                              "z·q can be 0 or negative. Use normalize=false for the paper's C q")


@dataclass
class GatedLinearOptions(LinearOptions):
    """Options of the `gated-linear` layer: those of `linear`, and

    decay: also learn a forgetting gate α_t = σ(w_α·x_t + b_α) per head, C_t = α_t C_{t-1} + …
        (the general α/β form; off by default, as in the paper's gated model).
    decay_init: the initial α (through b_α), close to 1 so early training remembers.
    """

    decay: bool = False
    decay_init: float = 0.95

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.decay_init < 1.0:
            raise ConfigError(f"attention.decay_init: expected a value in (0, 1), "
                              f"got {self.decay_init!r}")


class LinearState(AttentionState):
    """The fixed-size memory of one linear attention layer.

    memory [B, H, K, V]: Cᵀ = Σ k vᵀ (gated and decayed as the layer writes);
    normalizer [B, H, K, 1] or None: z = Σ k, present when the layer normalises its reads.
    Both are kept in the accumulation dtype (fp32, or fp64 for fp64 models).
    """

    fixed_size = True

    def __init__(self, memory: torch.Tensor, normalizer: torch.Tensor | None) -> None:
        self.memory = memory
        self.normalizer = normalizer
        self.seen = 0

    def update(self, memory: torch.Tensor, normalizer: torch.Tensor | None, steps: int) -> None:
        """Replace the memory after the layer has read `steps` more tokens."""
        self.memory, self.normalizer = memory, normalizer
        self.seen += steps

    def tensors(self) -> list[torch.Tensor]:
        return [self.memory] + ([] if self.normalizer is None else [self.normalizer])

    def map_tensors(self, fn) -> None:
        self.memory = fn(self.memory, True)
        self.normalizer = None if self.normalizer is None else fn(self.normalizer, True)


def feature(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The feature map φ applied to queries and keys, elementwise."""
    return F.elu(x) + 1.0 if kind == "elu+1" else x


def _state(kv: torch.Tensor | None) -> LinearAttentionState | None:
    """A memory [B, H, K, V] as the op's state (None before the first token)."""
    return None if kv is None else LinearAttentionState(kv)


class LinearMemory(NamedTuple):
    """Linear cross attention's memory: C [B, H, K, V] = Σ φ(k) vᵀ, z [B, H, K] = Σ φ(k) | None."""

    c: torch.Tensor
    z: torch.Tensor | None


class LinearCrossAttention(CrossLayer):
    """linear / gated-linear cross attention: C = Σ_s v_s φ(k_s)ᵀ over the source, read
    C φ(q) (divided by z·φ(q), z = Σ_s φ(k_s), when the mechanism normalises); gated, the
    source's gate g_s = σ(W_g h_s + b_g) multiplies its keys and values. No decay: the
    source is a set."""

    gated = False

    def __init__(self, spec: LayerSpec, options: LinearOptions) -> None:
        super().__init__(spec, options)
        self.gate = nn.Linear(spec.d_model, spec.d_model) if self.gated else None

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


class GatedLinearCrossAttention(LinearCrossAttention):
    """gated-linear cross attention: keys and values of the source gated by g_s = σ(W_g h_s + b_g)."""

    gated = True


# no option sizes the memory: H·K·V follows from the model's width and heads
STATE_SIZE = StateSize(why="its state H·K·V is set by d_model and n_heads")


@register("linear", options=LinearOptions, state_size=STATE_SIZE,
          cross=Cross(LinearCrossAttention, "C = Σ_s v_s φ(k_s)ᵀ over the source, read C φ(q) (divided "
                      "by z·φ(q), z = Σ_s φ(k_s), when it normalises) (LinearMemory)"))
class LinearAttention(AttentionLayer):
    """Linear attention: one K×V memory per head, C = Σ v φ(k)ᵀ, read as C φ(q); fixed-size state.

    x [B, T, d] -> y [B, T, d]. Causal: token t reads C_t (its own and earlier tokens);
    bidirectional: every token reads the memory of the whole sequence. Padding marked False
    in attention_mask [B, T] writes nothing (its key, and its decay, are neutralised).

    Rotary positions (spec.positions == "rotary") rotate φ(q) and φ(k) before they meet, so
    C_t q_t weighs v_i by φ(q_t)ᵀ R_{i-t} φ(k_i), a relative-position score that the
    absolute rotations of the running memory already give; the normaliser uses the
    unrotated features so that its weights stay positive.
    """

    gated = False

    def __init__(self, spec: LayerSpec, options: LinearOptions) -> None:
        super().__init__(spec, bias=options.bias)
        self.options = options

    def init_state(self, batch_size: int, device=None, dtype=None) -> LinearState:
        """An empty memory: zeros [B, H, K, V] (and [B, H, K, 1] for the normaliser)."""
        weight = self.qkv.weight
        dt = accumulation_dtype(dtype or weight.dtype)
        device = device if device is not None else weight.device
        H, D = self.spec.n_heads, self.spec.head_dim
        memory = torch.zeros(batch_size, H, D, D, device=device, dtype=dt)
        normalizer = (torch.zeros(batch_size, H, D, 1, device=device, dtype=dt)
                      if self.options.normalize else None)
        return LinearState(memory, normalizer)

    def write_gates(self, x: torch.Tensor
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(g [B, T, H, D] multiplying keys and values, α [B, T, H]); None where unused."""
        return None, None

    def forward(self, x: torch.Tensor, *, memory_state: LinearState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real token), positions [B, T] (rotary;
        default: after the tokens the state has seen) -> (y [B, T, d], state)."""
        offset, q, k, v = self.project(x, memory_state, attention_mask, rotate=False)
        B, T, H, D = q.shape
        q, k = feature(q, self.options.feature_map), feature(k, self.options.feature_map)
        gate, alpha = self.write_gates(x)
        if gate is not None:
            k, v = gate * k, gate * v
        if attention_mask is not None:
            k = k * attention_mask[:, :, None, None].to(k.dtype)  # padding writes nothing
            if alpha is not None:
                alpha = torch.where(attention_mask[:, :, None], alpha, torch.ones_like(alpha))

        at = positions if positions is not None else offset
        if memory_state is not None and T == 1 and not torch.is_grad_enabled():
            return self.finish(self._decode_in_place(memory_state, q, k, v, alpha, at)), memory_state
        memory = normalizer = None
        if memory_state is not None:
            memory, normalizer = memory_state.memory, memory_state.normalizer
        causal = self.spec.causal
        if self.rotary is None and self.options.normalize:
            # One pass: the normaliser is an extra value column of ones.
            ones = v.new_ones(B, T, H, 1)
            initial = None if memory is None else _state(torch.cat([memory, normalizer], dim=-1))
            o, state = linear_attention(q, k, torch.cat([v, ones], dim=-1), causal=causal,
                                        alpha=alpha, initial_state=initial,
                                        output_final_state=True)
            o, den = o[..., :D], o[..., D:]
            memory, normalizer = state.kv[..., :D], state.kv[..., D:]
        else:
            qr, kr = self.rotate(q, k, at)
            o, state = linear_attention(qr, kr, v, causal=causal, alpha=alpha,
                                        initial_state=_state(memory), output_final_state=True)
            memory = state.kv
            if self.options.normalize:
                den, state = linear_attention(q, k, v.new_ones(B, T, H, 1), causal=causal,
                                              alpha=alpha, initial_state=_state(normalizer),
                                              output_final_state=True)
                normalizer = state.kv
        if self.options.normalize:
            o = o / den.clamp_min(NORMALIZER_EPS)
        if memory_state is not None:
            memory_state.update(memory, normalizer, T)
        return self.finish(o), memory_state

    def _decode_in_place(self, state: LinearState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         alpha: torch.Tensor | None, at: torch.Tensor | int) -> torch.Tensor:
        """One token [B, 1, H, *] without autograd: the memory (and normaliser) written in
        place, as a KVCache grows, then read; the op's step without its checks and copies."""
        dt, out_dtype = state.memory.dtype, v.dtype
        qr, kr = self.rotate(q, k, at)
        qr, kr, q, k, v = (t[:, 0].to(dt) for t in (qr, kr, q, k, v))  # [B, H, D]
        if alpha is not None:
            decay = alpha[:, 0, :, None, None].to(dt)
            state.memory.mul_(decay)
            if state.normalizer is not None:
                state.normalizer.mul_(decay)
        state.memory.add_(kr[..., :, None] * v[..., None, :])
        o = (qr[..., None, :] @ state.memory).squeeze(-2)  # [B, H, V]
        if state.normalizer is not None:
            state.normalizer.add_(k[..., None])
            o = o / (q[..., None, :] @ state.normalizer).squeeze(-2).clamp_min(NORMALIZER_EPS)
        state.seen += 1
        return o[:, None].to(out_dtype)


@register("gated-linear", options=GatedLinearOptions, state_size=STATE_SIZE,
          cross=Cross(GatedLinearCrossAttention, "C = Σ_s (g_s ⊙ v_s)(g_s ⊙ φ(k_s))ᵀ over the source, "
                      "g_s = σ(W_g h_s + b_g), read as linear's (LinearMemory)"))
class GatedLinearAttention(LinearAttention):
    """Gated linear attention: the paper's f = σ(W h + b) ⊙ h written into C; fixed-size state.

    The paper writes C += f fᵀ with one vector f = σ(W h + b) ⊙ h playing key and value.
    Here keys and values are separate per-head projections, so the same gate
    g_t = σ(W_g x_t + b_g) [B, T, H, D] multiplies both: C += (g ⊙ v)(g ⊙ φ(k))ᵀ, which is
    exactly f fᵀ when k = v = h (φ = identity). The gate decides, per token and feature,
    what enters the memory; it is the op's input written with β = 1. With decay=True a
    second gate α_t = σ(w_α·x_t + b_α) per head scales the old memory (the general α form).
    """

    gated = True

    def __init__(self, spec: LayerSpec, options: GatedLinearOptions) -> None:
        super().__init__(spec, options)
        self.gate = nn.Linear(spec.d_model, spec.d_model)
        if options.decay:
            self.decay_proj = nn.Linear(spec.d_model, spec.n_heads, bias=False)
            # A bias outside nn.Linear, so that a model's weight init keeps α near decay_init.
            init = torch.logit(torch.tensor(options.decay_init)).item()
            self.decay_bias = nn.Parameter(torch.full((spec.n_heads,), init))

    def write_gates(self, x: torch.Tensor):
        B, T, _ = x.shape
        gate = torch.sigmoid(self.gate(x)).view(B, T, self.spec.n_heads, self.spec.head_dim)
        alpha = None
        if self.options.decay:
            alpha = torch.sigmoid(self.decay_proj(x) + self.decay_bias)  # [B, T, H]
        return gate, alpha
