"""abc-mlp: ABC_MLP, the control weights computed from the input.

α = act(W_φ x) [H, M] per token, normalised per slot over the prefix (causal) or the
sequence (bidirectional): φ_i = α_i / Σ_j α_j. The layer hands slot logits s = log α to
`abc_attention`, which does the normalisation in log space. Its cross attention
(`memattn.layers.cross`) writes a memory of `cross_slots` slots the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError
from memattn.layers.abc.common import ABCLayer, ABCMemoryState, check_positive
from memattn.layers.base import LayerSpec, register

# activation=relu: α = 0 becomes log(RELU_FLOOR) as a logit, so a slot whose prefix has only
# zero α averages those tokens uniformly instead of dividing 0 by 0.
RELU_FLOOR = 1e-12


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
    """

    num_slots: int = 32
    cross_slots: int | None = None
    activation: Literal["exp", "relu", "sigmoid"] = "exp"
    tie_phi: bool = False
    bias: bool = False
    phi_init_std: float | None = None
    recency: bool = False

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


@register("abc-mlp", options=ABCMLPOptions)
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
        if options.recency and not spec.causal:
            raise ConfigError("attention.recency: a rate per slot over the tokens written so far "
                              "needs causal self-attention")
        # β of `recency`, [H·M] flat: one number per slot, not a matrix to decay
        self.rate = nn.Parameter(torch.zeros(H * M)) if options.recency else None
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """W_φ from attention.phi_init_std, β = 0; a model calls this after its own init."""
        reset_phi(self.phi, self.options.phi_init_std)
        if self.rate is not None:
            nn.init.zeros_(self.rate)

    def init_state(self, batch_size: int, device=None, dtype=None) -> ABCMemoryState:
        """An empty memory: log_z = -inf [B, H, M], zeros [B, H, M, D] for keys and values."""
        return self.empty_abc_state(batch_size, self.options.num_slots, device, dtype)

    def slot_logits(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d] -> s [B, T, H, M], log α for the chosen activation; with `recency`,
        plus β·j for the j-th real token of the call (the state keeps the earlier tokens'
        logits relative to the call's first token: `_age_state`)."""
        B, T, _ = x.shape
        z = self.phi(x).view(B, T, self.spec.n_heads, self.options.num_slots)
        s = activation_logits(z, self.options.activation)
        if self.rate is None:
            return s
        j = (torch.arange(T, device=x.device).expand(B, T) if attention_mask is None
             else attention_mask.cumsum(1) - 1)
        dtype = torch.promote_types(s.dtype, torch.float32)  # β·j of hundreds: no half precision
        return s.to(dtype) + j[:, :, None, None].to(dtype) * self.rate.view(self.spec.n_heads, -1).to(dtype)

    def _age_state(self, memory_state: ABCMemoryState, attention_mask: torch.Tensor | None,
                   T: int) -> None:
        """After a call of T tokens (n real ones per row): every logit in the state becomes
        relative to the next call's first token, log_z -= β·n (in place while decoding)."""
        log_z = memory_state.inner.log_z
        rate = self.rate.view(self.spec.n_heads, -1).to(log_z)
        # no host tensor on the way: a CUDA graph may capture a decoding step
        shift = rate * T if attention_mask is None else attention_mask.sum(1).to(log_z)[:, None, None] * rate
        if torch.is_grad_enabled():
            memory_state.inner = memory_state.inner._replace(log_z=log_z - shift)
        else:
            log_z.sub_(shift)

    def forward(self, x: torch.Tensor, *, memory_state: ABCMemoryState | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] bool (True = real), positions [B, T] ->
        (y [B, T, d], state)."""
        _, q, k, v = self.project(x, memory_state, attention_mask, positions)
        y = self.attend_logits(q, k, v, self.slot_logits(x, attention_mask), memory_state, attention_mask)
        if self.rate is not None and memory_state is not None:
            self._age_state(memory_state, attention_mask, x.shape[1])
        return y, memory_state
