"""Evaluation: mean next-token loss over a split, as nats, bits per character and perplexity."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def as_tensor(ids: np.ndarray) -> torch.Tensor:
    """Token ids as an int64 tensor (once per split, shared by all batches)."""
    return torch.from_numpy(np.ascontiguousarray(ids).astype(np.int64, copy=False))


@torch.no_grad()
def evaluate(model: torch.nn.Module, ids: torch.Tensor, *, seq_len: int, batch_size: int,
             max_batches: int = 0, device: str | torch.device = "cpu") -> dict[str, float]:
    """Loss over consecutive non-overlapping windows of `seq_len` + 1 tokens.

    ids: int64 [N]. max_batches > 0 evaluates only the first batches (deterministic).
    Returns {"loss": nats/token, "bpc": bits/token, "ppl": perplexity, "tokens": count}.
    """
    n_windows = (len(ids) - 1) // seq_len
    if n_windows == 0:
        raise ValueError(f"evaluate: split of {len(ids)} tokens is shorter than seq_len + 1 = {seq_len + 1}")
    if max_batches > 0:
        n_windows = min(n_windows, max_batches * batch_size)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, n_windows, batch_size):
        rows = torch.arange(start, min(start + batch_size, n_windows)) * seq_len
        idx = rows[:, None] + torch.arange(seq_len + 1)[None, :]
        window = ids[idx].to(device)
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += window[:, 1:].numel()
    model.train(was_training)
    loss = total / count
    return {"loss": loss, "bpc": loss / math.log(2), "ppl": math.exp(min(loss, 50.0)), "tokens": count}
