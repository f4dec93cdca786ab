"""How a learned memory is used: statistics of ABC_MLP's slots over a window, and the spans
an adaptive-span layer learned (`learned_spans`; `set_learned_spans` gives them to another model).

With slot logits s (α = exp(s)), the causal memory at step t is
K̃_t[j] = Σ_{i≤t} α_ij k_i / Σ_{i≤t} α_ij, and query t reads softmax_j(scale · K̃_t[j]·q_t).
Slots that start as near copies of each other (similar logits, so similar K̃ rows) are read
uniformly and get the same gradient: the statistics below show whether training parted them.
"""

from __future__ import annotations

import torch

from memattn.errors import ConfigError


def slot_statistics(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    scale: float | None = None) -> dict[str, float]:
    """Statistics of one causal ABC memory over a window, averaged over batch and heads.

    s [B, T, H, M] slot logits; q, k [B, T, H, D] (rotated as the layer rotates them).
    Returns:
      write_spread: per slot, exp(entropy of its write weights over the whole window) / T,
        averaged over slots: 1 when a slot is the plain mean of the window, 1/T when it holds
        one token.
      slots_read: exp(entropy of the read distribution averaged over all queries): how many
        slots the queries use between them (M when all equally, 1 when one slot takes all).
      read_spread: exp(entropy of each query's read), averaged: how many slots one query reads.
      key_cosine: mean cosine between two different slot keys of the memory at the last step
        (1 when the slots are copies of each other).
      write_age: the mean age t − i of what a slot holds at step t (i weighted by its write
        weight among the tokens ≤ t) over t / 2, the age of a plain prefix mean; averaged over
        slots and the steps t ≥ 1: 1 when writing ignores position, below 1 when recent tokens
        weigh more (0: each slot holds its newest token), 2 when a slot holds the first.
    """
    s, q, k = s.double(), q.double(), k.double()
    B, T, H, M = s.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    weights = torch.softmax(s, dim=1)  # [B, T, H, M] each slot's write weights over the window
    write_entropy = -(weights * weights.clamp_min(1e-300).log()).sum(1)  # [B, H, M]
    a = torch.exp(s - s.amax(dim=1, keepdim=True))  # [B, T, H, M], stable per slot
    mass = torch.cumsum(a, 1)  # [B, T, H, M]
    keys = torch.cumsum(a[..., None] * k[:, :, :, None, :], 1) / mass[..., None]  # [B, T, H, M, D]
    t = torch.arange(T, dtype=s.dtype).view(1, T, 1, 1)
    age = t - torch.cumsum(a * t, 1) / mass  # [B, T, H, M] the held tokens' mean age at step t
    read = torch.softmax(scale * torch.einsum("bthmd,bthd->bthm", keys, q), dim=-1)  # [B, T, H, M]
    mean_read = read.mean(dim=(0, 1))  # [H, M]
    entropy = -(mean_read * mean_read.clamp_min(1e-300).log()).sum(-1)  # [H]
    query_entropy = -(read * read.clamp_min(1e-300).log()).sum(-1)  # [B, T, H]
    last = torch.nn.functional.normalize(keys[:, -1], dim=-1)  # [B, H, M, D]
    cos = last @ last.transpose(-1, -2)  # [B, H, M, M]
    off_diagonal = (cos.sum((-1, -2)) - cos.diagonal(dim1=-2, dim2=-1).sum(-1)) / (M * (M - 1)) if M > 1 \
        else torch.ones(B, H, dtype=cos.dtype)
    return {"write_spread": (write_entropy.exp() / T).mean().item(),
            "slots_read": entropy.exp().mean().item(),
            "read_spread": query_entropy.exp().mean().item(),
            "key_cosine": off_diagonal.mean().item(),
            "write_age": (age[:, 1:] / (t[:, 1:] / 2)).mean().item() if T > 1 else float("nan")}


@torch.no_grad()
def abc_slot_usage(model: torch.nn.Module, idx: torch.Tensor) -> list[dict[str, float]]:
    """`slot_statistics` of every layer with learned slot logits (abc-mlp) of a causal model
    reading idx [B, T]: one dict per such layer, in order (empty for other mechanisms)."""
    stats: list[dict[str, float]] = []

    def capture(layer, args, kwargs):
        x = args[0]  # [B, T, d] the layer's input
        _, q, k, _ = layer.project(x)
        stats.append(slot_statistics(layer.slot_logits(x)[0], q, k))

    hooks = [block.attn.register_forward_pre_hook(capture, with_kwargs=True)
             for block in model.blocks if hasattr(block.attn, "slot_logits")]
    was_training = model.training
    model.eval()
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return stats


def mean_statistics(per_layer: list[dict[str, float]]) -> dict[str, float]:
    """The layers' statistics averaged (NaN where there is no layer)."""
    if not per_layer:
        return {}
    return {key: sum(d[key] for d in per_layer) / len(per_layer) for key in per_layer[0]}


def learned_spans(model: torch.nn.Module) -> list[list[float]]:
    """Each layer's learned attention spans per head, in tokens; [] if no layer learns one."""
    spans = [getattr(block.attn, "spans", list)() for block in getattr(model, "blocks", [])]
    return spans if any(spans) else []


def set_learned_spans(model: torch.nn.Module, spans: list[list[float]]) -> None:
    """Give each layer the spans per head, in tokens, that `learned_spans` reads (e.g. a trained
    model's, onto a model of its configuration); [] for a model that learns none."""
    heads = [len(layer) for layer in learned_spans(model)]
    if heads != [len(layer) for layer in spans]:
        raise ConfigError(f"spans for {[len(layer) for layer in spans]} heads per layer given to a model "
                          f"that learns {heads or 'none'}")
    for block, tokens in zip(getattr(model, "blocks", []), spans):
        if tokens:
            block.attn.set_spans(tokens)


def state_bytes_by_layer(model, lengths: tuple[int, int] = (64, 128)) -> list[dict]:
    """Each layer's decoding state of a memattn causal LM, batch of one, fp32: [{"layer",
    "attention" (its mechanism), "fixed_bytes", "bytes_per_token", "fixed_size"}], measured by
    reading `lengths` tokens (two lengths: the bytes that grow per token and those that do not)."""
    sizes = []
    for n in lengths:
        cache = model.init_cache(1)
        with torch.no_grad():
            model(torch.zeros(1, n, dtype=torch.long), cache=cache)
        sizes.append([s.nbytes() for s in cache.states])
    out = []
    for i, (short, long) in enumerate(zip(*sizes)):
        per_token = (long - short) / (lengths[1] - lengths[0])
        out.append({"layer": i, "attention": model.cfg.layer_attention(i).name,
                    "fixed_bytes": int(short - per_token * lengths[0]), "bytes_per_token": per_token,
                    "fixed_size": cache.states[i].fixed_size})
    return out
