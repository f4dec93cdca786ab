"""Keeping a softmax model's quality through a conversion: attention transfer and low-rank
adapters, the recipe of LoLCATs (Zhang et al. 2024) and Liger (Lan et al. 2025), for memattn's
own models and for transformers models converted by `memattn convert`.

A run started from a softmax model (`train.init_from`: a memattn softmax run, or a folder of
`memattn convert`) holds that model's weights everywhere but in the mechanism's own parameters
(ABC's W_φ, gates, forget rates, ...: `own_parameters`), which start from their initialisation.
Attention transfer (`train.transfer_steps`) trains those alone first: for each layer ℓ with
parameters of its own,

    u_ℓ = the input of attention layer ℓ in the frozen softmax model (its norm applied)  # [B, T, d]
    loss = Σ_ℓ mean((attn_ℓ(u_ℓ) − softmax_attn_ℓ(u_ℓ))²)

on windows of the training text, every other parameter frozen. The softmax model is the memattn
run started from, or the transformers model a converted folder was converted from. Every layer
reads the softmax model's own inputs, so the layers learn at once and independently. The
ordinary steps then train end to end; with `train.lora_rank` they train, instead of every weight,
rank-r adapters on the copied linear weights of the layers (`LoRA`) and the mechanism's own
parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memattn.errors import ConfigError


def own_parameters(model: nn.Module, source) -> list[str]:
    """Names of the parameters of `model` that did not come from `source`: the mechanism's own,
    as initialised. A memattn model: what the warm start (memattn.warmstart) does not copy; a
    converted model (a `ConvertedLM`): what the conversion did not copy."""
    if source.converted:
        from memattn.integrations.convert import new_parameters

        return new_parameters(model)
    from memattn.warmstart import warm_start_weights

    copied = warm_start_weights(model, source)
    return [name for name, _ in model.named_parameters() if name not in copied]


def start_weights(model: nn.Module, source) -> dict[str, torch.Tensor]:
    """The weights `model` started from, keyed as it holds them: the source's (a memattn model),
    or the converted folder's (a converted model)."""
    if source.converted:
        from memattn.integrations.convert import load_converted

        return {f"hf.{k}": t for k, t in load_converted(source.path).state_dict().items()}
    from memattn.warmstart import warm_start_weights

    return warm_start_weights(model, source)


def check_transfer(model: nn.Module, source, own: list[str]) -> None:
    """ConfigError (naming train.transfer_steps) unless `model` was started from a softmax model
    (a memattn softmax model, or a converted folder: its source is a transformers model's own
    attention) and holds parameters of its own to transfer."""
    from memattn.layers.base import attention_layers

    if not source.converted:
        if not isinstance(source.model, dict):
            raise ConfigError(f"train.transfer_steps: {source.path} records no memattn model config to rebuild "
                              "the softmax model from")
        teacher = softmax_mechanisms(source.model)
        if teacher is not None:
            raise ConfigError(f"train.transfer_steps: the train.init_from model {source.path} has {teacher} "
                              "attention, not softmax; transfer teaches a mechanism to reproduce softmax layers")
    if not own:
        names = sorted({mech.name for _, mech in attention_layers(model)})
        raise ConfigError(f"train.transfer_steps: attention {', '.join(map(repr, names))} has no parameters of "
                          f"its own to transfer (every parameter was copied from {source.path}); train it with "
                          "the ordinary steps alone")


def softmax_mechanisms(model: dict) -> str | None:
    """None when every layer of the model config `model` (a mapping) is softmax attention, else
    the mechanisms it has instead, in words."""
    attention = model.get("attention") or {}
    names = [attention.get("name", "softmax")]
    names += [(v or {}).get("name", "softmax") if isinstance(v, dict) else str(v)
              for v in (model.get("attention_layers") or {}).values()]
    other = sorted({n for n in names if n != "softmax"})
    return ", ".join(map(repr, other)) if other else None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of each layer, in layer order: a memattn CausalLM's blocks' `attn`,
    or a transformers model's (a `ConvertedLM`, or the original it was converted from)
    self-attention, converted or not. Each is called with the layer's normed input first and
    returns (output [B, T, d], ...)."""
    if hasattr(model, "blocks"):
        return [block.attn for block in model.blocks]
    from memattn.integrations.convert import attention_modules as transformers_attention

    return transformers_attention(model)


class AttentionTransfer:
    """The transfer objective of `model` (a CausalLM or a converted `ConvertedLM`) against
    `teacher` (the softmax model it was started from, frozen: the memattn softmax CausalLM or
    the original transformers model): `loss(x)` for token ids x [B, T].

    The layers transferred are those whose attention holds one of the parameters named in `own`.
    """

    def __init__(self, model: nn.Module, teacher: nn.Module, own: list[str]) -> None:
        self.model, self.teacher = model, teacher
        self.attention, self.teacher_attention = attention_modules(model), attention_modules(teacher)
        if len(self.attention) != len(self.teacher_attention):
            raise ConfigError(f"train.transfer_steps: the model has {len(self.attention)} attention layers, "
                              f"the softmax model it started from {len(self.teacher_attention)}")
        params = dict(model.named_parameters())
        mine = {id(params[name]) for name in own}
        self.layers = [i for i, attn in enumerate(self.attention) if any(id(p) in mine for p in attn.parameters())]

    def teacher_layers(self, x: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (its input u [B, T, d], its softmax output [B, T, d])} in the teacher on x [B, T]."""
        seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(i):
            def hook(module, args, kwargs, output):  # transformers passes hidden_states by name
                seen[i] = (args[0] if args else kwargs["hidden_states"], output[0])
            return hook

        hooks = [self.teacher_attention[i].register_forward_hook(keep(i), with_kwargs=True) for i in self.layers]
        try:
            with torch.no_grad():
                self.teacher(x)
        finally:
            for h in hooks:
                h.remove()
        return seen

    def loss(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(Σ over the transferred layers of the mean squared error between the model's layer
        output and the teacher's on the teacher's layer input, [that error per layer])."""
        losses = []
        for i, (u, want) in self.teacher_layers(x).items():
            got = self.attention[i](u)[0]
            losses.append(F.mse_loss(got.float(), want.float()))
        return torch.stack(losses).sum(), losses


class LoRA(nn.Module):
    """Rank-r adapters on linear layers of a model, kept outside it: layer `name` computes
    W x + (B A x) · scale (A [r, in], B [out, r]; B = 0 at the start, so the model is unchanged)
    once `attach()` hooks them in. The model's own weights stay as they are (frozen by the
    caller); `merged_state()` gives its state dict with each W + scale·B A, a model that needs
    no adapters (what checkpoints hold).

    Targets (`targets_of`): every linear layer inside the model's layers whose weight came from
    the source: nn.Linear, and transformers' Conv1D (GPT-2; its weight is [in, out]).
    """

    def __init__(self, model: nn.Module, names: list[str], rank: int, scale: float = 1.0) -> None:
        super().__init__()
        modules = dict(model.named_modules())
        self.names, self.rank, self.scale = list(names), rank, scale
        self.targets = [modules[n] for n in self.names]
        self.a = nn.ParameterList()
        self.b = nn.ParameterList()
        for linear in self.targets:
            w = linear.weight
            size_in, size_out = w.shape[::-1] if isinstance(linear, nn.Linear) else w.shape
            a = torch.empty(rank, size_in, device=w.device, dtype=w.dtype)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear's own weights
            self.a.append(nn.Parameter(a))
            self.b.append(nn.Parameter(torch.zeros(size_out, rank, device=w.device, dtype=w.dtype)))
        self._hooks: list = []

    @staticmethod
    def targets_of(model: nn.Module, own: list[str]) -> list[str]:
        """Names of the linear modules inside the model's layers (each the module that holds an
        attention module: memattn's blocks, a transformers model's decoder layers) whose weight came
        from the source (is not among the mechanism's `own` parameters)."""
        attention = {id(m) for m in attention_modules(model)}
        layers = tuple(name.rpartition(".")[0] + "." for name, m in model.named_modules() if id(m) in attention)
        return [name for name, m in model.named_modules()
                if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")  # transformers' GPT-2 linear
                and name.startswith(layers) and f"{name}.weight" not in own]

    def attach(self) -> None:
        """Hook the adapters into their layers (once)."""
        if self._hooks:
            return
        for linear, a, b in zip(self.targets, self.a, self.b):
            def hook(module, args, output, a=a, b=b):
                return output + F.linear(F.linear(args[0], a), b) * self.scale
            self._hooks.append(linear.register_forward_hook(hook))

    def detach_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def merged_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """model.state_dict() with every adapted weight W + scale · B A."""
        state = dict(model.state_dict())
        with torch.no_grad():
            for name, linear, a, b in zip(self.names, self.targets, self.a, self.b):
                delta = (b @ a) * self.scale  # [out, in]
                state[f"{name}.weight"] = linear.weight + (delta if isinstance(linear, nn.Linear) else delta.T)
        return state

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapters by name, for a checkpoint's extra tensors: lora.<layer>.A / .B."""
        out = {}
        for name, a, b in zip(self.names, self.a, self.b):
            out[f"lora.{name}.A"], out[f"lora.{name}.B"] = a.detach(), b.detach()
        return out

    def load(self, tensors: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
        """Go on from a checkpoint: the adapters saved by `tensors()`, and each adapted layer's
        weight set back to its frozen value `base[name.weight]` (the checkpoint holds it merged)."""
        with torch.no_grad():
            for name, linear, a, b in zip(self.names, self.targets, self.a, self.b):
                linear.weight.copy_(base[f"{name}.weight"])
                for key, p in ((f"lora.{name}.A", a), (f"lora.{name}.B", b)):
                    if key not in tensors or tensors[key].shape != p.shape:
                        raise ConfigError(f"train.lora_rank: the checkpoint holds no adapter {key} of shape "
                                          f"{tuple(p.shape)}; it was not made with train.lora_rank={self.rank}")
                    p.copy_(tensors[key])
