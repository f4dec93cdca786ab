"""Sampling from a causal LM with its per-layer decoding cache: the prefix is read once."""

from __future__ import annotations

from typing import Iterator

import torch


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, seed: int | None = None, compile: bool = False) -> Iterator[torch.Tensor]:
    """Yield one new token per step, [B] each, continuing `prompt` [B, T0].

    The prompt is read in one forward pass into the cache; each later step feeds only the
    token just sampled. temperature 0 is greedy; top_k > 0 samples among the k likeliest.
    compile: run the one-token steps through `decoding_step(model)` (torch.compile): the
    first steps compile (tens of seconds on a CPU), the later ones run fused.
    """
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt: expected token ids [B, T0] with T0 >= 1, got shape {tuple(prompt.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0, got {temperature}")
    gen = torch.Generator(device=prompt.device)
    if seed is not None:
        gen.manual_seed(seed)
    was_training = model.training
    model.eval()
    cache = model.init_cache(prompt.shape[0], device=prompt.device)
    logits = model(prompt, cache=cache)[:, -1]
    step = decoding_step(model) if compile else model
    try:
        for _ in range(max_new_tokens):
            token = sample(logits, temperature, top_k, gen)
            yield token
            logits = step(token[:, None], cache=cache)[:, -1]
    finally:
        model.train(was_training)


def decoding_step(model):
    """`model` compiled for decoding (torch.compile, shapes dynamic so that the growing
    position does not recompile it): called as the model, `step(token [B, 1], cache=cache)`,
    with the same results (tested against eager). Kept outside the model: the model files stay
    plain and eager."""
    return torch.compile(model, dynamic=True)


def sample(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)
