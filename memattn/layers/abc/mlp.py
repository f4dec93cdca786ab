"""abc-mlp: ABC_MLP, the control weights computed from the input.

α = act(W_φ x) [H, M] per token, normalised per slot over the prefix (causal) or the
sequence (bidirectional): φ_i = α_i / Σ_j α_j. The layer hands slot logits s = log α to
`abc_attention`, which does the normalisation in log space. Its cross attention
(`ABCCrossAttention`) writes a memory of `cross_slots` slots the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError
from memattn.layers.abc.common import PAD_LOGIT, ABCLayer, ABCMemoryState, check_positive
from memattn.layers.base import Cross, LayerSpec, StateSize, register
from memattn.layers.cross import SlotCrossAttention
from memattn.ops.abc import ABCState
from memattn.ops.abc.chunked import abc_memory
from memattn.ops.contract import compute_dtype

# activation=relu: α = 0 becomes log(RELU_FLOOR) as a logit, so a slot whose prefix has only
# zero α averages those tokens uniformly instead of dividing 0 by 0.
RELU_FLOOR = 1e-12
# forget: b_f at init, softplus(-5) ≈ 0.0067: a slot's horizon of about 150 tokens to start from
FORGET_BIAS = -5.0
# recency / forget: a call longer than this is read in pieces of it (`forward`), so that the
# decays summed inside one piece stay small enough for float32 logits to resolve (Σλ ≤ 1,024
# for rates up to 1 a token: a resolution of 1e-4)
PIECE = 1024


@dataclass
class ABCMLPOptions:
    """Options of `abc-mlp`.

    num_slots: M, memory slots per head in self-attention.
    cross_slots: memory slots per head of cross attention (None: num_slots), used by
        models that attend to another sequence (`ABCCrossAttention`).
    activation: α = act(W_φ x). "exp" (the op's own control, α = exp(s)), "relu" or
        "sigmoid"; α is normalised per slot over the prefix (causal) or the sequence.
    tie_phi: one W_φ shared by every layer of the model (through spec.shared).
    bias: biases on the q/k/v, output and φ projections.
    phi_init_std: W_φ drawn N(0, phi_init_std²), applied after the model's init. None (the
        default): √(8 / d_model), slot logits of std ≈ 2.8 for unit-variance inputs; 0: the
        model's own init. With near-equal logits every slot holds about the mean of the prefix
        and the slots learn alike; at 1,500 steps (results/abc-lm-1500) the larger scale was ahead on two seeds.
    recency: in self-attention, token i's logit for slot m gets a learned β_m·i (β per head
        and slot, 0 at init): for β > 0 each later token shrinks an earlier one's share of the
        slot by e^(-β), an exponential moving average with its own rate per slot; β < 0 keeps
        the earliest tokens instead. Under positions that x does not carry (rotary ones, which
        only q and k see) a write otherwise depends on where its token is only through what
        the layers below mixed into x (not at all in a first layer). Not in the paper; causal
        self-attention only (cross attention's memory has none).
    forget: in self-attention, a forget rate per slot computed from each token,
        λ_j = softplus(W_f x_j + b_f) ≥ 0 [H, M]: token j shrinks every earlier token's share of
        each slot by e^(-λ_j), so token i's logit gets Σ_{i<j≤t} λ_j against token t's, the
        data-dependent form of `recency` (both may be on: the rates add). W_f = 0 and
        b_f = FORGET_BIAS at init (λ ≈ 0.007 a token). Each slot stays a normalised average
        (ABC's memory), now over a horizon the tokens choose. Not in the paper; causal
        self-attention only.
    """

    num_slots: int = 32
    cross_slots: int | None = None
    activation: Literal["exp", "relu", "sigmoid"] = "exp"
    tie_phi: bool = False
    bias: bool = False
    phi_init_std: float | None = None
    recency: bool = False
    forget: bool = False

    def __post_init__(self) -> None:
        if self.phi_init_std is not None and not self.phi_init_std >= 0:  # NaN too
            raise ConfigError(f"attention.phi_init_std: expected a number >= 0, got {self.phi_init_std!r}")
        check_positive("num_slots", self.num_slots)
        if self.cross_slots is None:
            self.cross_slots = self.num_slots
        check_positive("cross_slots", self.cross_slots)
        if self.activation not in ("exp", "relu", "sigmoid"):
            raise ConfigError(f"attention.activation: expected one of exp, relu, sigmoid, "
                              f"got {self.activation!r}")


def reset_phi(phi: nn.Linear, std: float | None) -> None:
    """W_φ ~ N(0, std²) for `phi_init_std` = std; None: std = √(8 / d_model); 0: left as it is."""
    if std is None:
        std = math.sqrt(8 / phi.in_features)
    if std > 0:
        nn.init.normal_(phi.weight, std=std)


def activation_logits(z: torch.Tensor, activation: str) -> torch.Tensor:
    """Pre-activations z = W_φ x -> slot logits s = log act(z), so that α = exp(s) = act(z)."""
    if activation == "sigmoid":
        return F.logsigmoid(z)
    if activation == "relu":
        return torch.log(F.relu(z).clamp_min(RELU_FLOOR))
    return z


class ABCCrossAttention(SlotCrossAttention):
    """ABC_MLP cross attention: `cross_slots` slots per head written by the source, fixed size."""

    def __init__(self, spec: LayerSpec, options: ABCMLPOptions) -> None:
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


# streams with a write rule that forgets: recency at 2,048 and 16,384 characters of a model
# trained on 256: 2.34 bpc, 2.36 at 256 (the paper's rule 2.69 -> 3.57 at 2,048); forget at
# 16x and 64x its training length 0.9 % and 0.8 % below the same text read in windows of it
# (results/long-stream-300)
@register("abc-mlp", options=ABCMLPOptions, streaming=lambda o: o.recency or o.forget,
          state_size=StateSize("num_slots"),
          cross=Cross(ABCCrossAttention, "cross_slots slots per head written with φ = act(W_φ h) "
                      "normalised over the source (ABCState)"),
          test_options={"num_slots": 8, "cross_slots": 3})
class ABCMLPAttention(ABCLayer):
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
        for flag in ("recency", "forget"):
            if getattr(options, flag) and not spec.causal:
                raise ConfigError(f"attention.{flag}: a rate per slot over the tokens written so far "
                                  "needs causal self-attention")
        # β of `recency`, [H·M] flat: one number per slot, not a matrix to decay
        self.rate = nn.Parameter(torch.zeros(H * M)) if options.recency else None
        # W_f, b_f of `forget`: λ = softplus(W_f x + b_f) [H·M] a token
        self.forget = nn.Linear(spec.d_model, H * M) if options.forget else None
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """W_φ from attention.phi_init_std, β = 0, W_f = 0 and b_f = FORGET_BIAS; a model
        calls this after its own init."""
        reset_phi(self.phi, self.options.phi_init_std)
        if self.rate is not None:
            nn.init.zeros_(self.rate)
        if self.forget is not None:
            nn.init.zeros_(self.forget.weight)
            nn.init.constant_(self.forget.bias, FORGET_BIAS)

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """An empty memory: log_z = -inf [B, H, M], zeros [B, H, M, D] for keys and values."""
        return self.empty_abc_state(batch_size, self.options.num_slots, device, dtype)

    def slot_logits(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, d] -> (s [B, T, H, M], shift [B, H, M] or None).

        s is log α for the chosen activation. With `recency` / `forget`, token j of the call
        gets the decay of the real tokens up to it added, c_j = β·(real tokens before j) +
        Σ_{i≤j} λ_i (padding adds nothing; its logits the layer masks), and shift = c after the call's last token: the
        state subtracts it so that its logits stay relative to the next call's first token
        (`_age_state`), whatever the length of the stream.
        """
        B, T, _ = x.shape
        H, M = self.spec.n_heads, self.options.num_slots
        s = activation_logits(self.phi(x).view(B, T, H, M), self.options.activation)
        if self.rate is None and self.forget is None:
            return s, None
        dtype = torch.promote_types(s.dtype, torch.float32)  # decays of hundreds: no half precision
        real = (torch.ones(B, T, device=x.device, dtype=dtype) if attention_mask is None
                else attention_mask.to(dtype))
        s, shift = s.to(dtype), s.new_zeros((B, H, M), dtype=dtype)
        if self.rate is not None:  # β times the real tokens before token j in the call
            rate = self.rate.view(H, M).to(dtype)
            s = s + (real.cumsum(1) - real)[:, :, None, None] * rate
            shift = shift + real.sum(1)[:, None, None] * rate
        if self.forget is not None:  # Σ λ_i of the real tokens up to token j
            lam = F.softplus(self.forget(x).view(B, T, H, M).to(dtype))
            if attention_mask is not None:  # padding forgets nothing (no mask: no pass to skip it)
                lam = lam * real[:, :, None, None]
            cum = lam.cumsum(1)
            s, shift = s + cum, shift + cum[:, -1]
        return s, shift

    def _age_state(self, memory_state: ABCMemoryState, shift: torch.Tensor) -> None:
        """After a call: every logit in the state becomes relative to the next call's first
        token, log_z -= shift [B, H, M] (in place while decoding)."""
        log_z = memory_state.inner.log_z
        # no host tensor on the way: a CUDA graph may capture a decoding step
        if torch.is_grad_enabled():
            memory_state.inner = memory_state.inner._replace(log_z=log_z - shift.to(log_z))
        else:
            log_z.sub_(shift.to(log_z))

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], state)."""
        _, q, k, v = self.project(x, memory_state, attention_mask, positions)
        T = x.shape[1]
        if (self.rate is None and self.forget is None) or T <= PIECE:
            s, shift = self.slot_logits(x, attention_mask)
            y = self.attend_logits(q, k, v, s, memory_state, attention_mask)
            if shift is not None and memory_state is not None:
                self._age_state(memory_state, shift)
            return y, memory_state
        # decays summed over a long call outgrow what float32 logits resolve: pieces of PIECE
        # tokens, each with logits relative to its own first token, the state carried
        state = memory_state if memory_state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        ys = []
        for a in range(0, T, PIECE):
            part = slice(a, a + PIECE)
            mask = None if attention_mask is None else attention_mask[:, part]
            s, shift = self.slot_logits(x[:, part], mask)
            ys.append(self.attend_logits(q[:, part], k[:, part], v[:, part], s, state, mask))
            self._age_state(state, shift)
        return torch.cat(ys, 1), memory_state
