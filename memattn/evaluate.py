"""Evaluation: mean next-token loss over a split, as nats, bits per character and perplexity."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def as_tensor(ids: np.ndarray) -> torch.Tensor:
    """Token ids as an int64 tensor (once per split, shared by all batches)."""
    return torch.from_numpy(np.ascontiguousarray(ids).astype(np.int64, copy=False))


def segment_window(ids: torch.Tensor, streams: int, seq_len: int, segment: int) -> torch.Tensor:
    """Segment `segment` of each of `streams` contiguous streams: [streams, seq_len + 1] ids.

    Stream b reads ids[b·S:(b + 1)·S + 1] with S = (len(ids) - 1) // streams, in segments of
    seq_len (inputs, and targets shifted by one). Raises ValueError past its last segment.
    """
    length = (len(ids) - 1) // streams
    if (segment + 1) * seq_len > length:
        raise ValueError(f"segment {segment}: streams of {length} tokens hold only "
                         f"{length // seq_len} segments of seq_len={seq_len}")
    starts = torch.arange(streams) * length + segment * seq_len
    return ids[starts[:, None] + torch.arange(seq_len + 1)[None, :]]


@torch.no_grad()
def evaluate(model: torch.nn.Module, ids: torch.Tensor, *, seq_len: int, batch_size: int,
             max_batches: int = 0, device: str | torch.device = "cpu",
             segments: bool = False, context: int = 0, chars_per_token: float = 1.0,
             by_position: bool = False) -> dict:
    """Loss over consecutive non-overlapping segments of `seq_len` scored tokens.

    ids: int64 [N]. max_batches > 0 evaluates only the first batches (deterministic).
    context: each scored segment is preceded by `context` tokens that the model reads but
    that are not scored (the model sees context + seq_len tokens; a bounded memory carries
    its state over them, softmax attends to them). Segment i scores the targets
    ids[context + i·seq_len + 1 : context + (i + 1)·seq_len + 1].
    segments: read the split as batch_size contiguous streams, segment after segment, with
    the model's cache carrying each layer's memory from one segment to the next (as
    `train.segments` trains); max_batches > 0 then reads the first segments of each stream.
    chars_per_token: the split's characters per token (`Corpus.chars_per_token`): 1 for
    character and byte vocabularies, more for BPE, where bits per character are bits per
    token over it (the split's average, also when only part of it is scored).
    by_position: also "bpc_by_position", the bits per character at each of the seq_len scored
    positions of a segment (the mean over the segments), where the loss falls in a window.
    Returns {"loss": nats/token, "bpc": bits/character, "bits_per_token", "ppl": perplexity,
    "tokens": count}.
    """
    if context < 0:
        raise ValueError(f"evaluate: context must be >= 0, got {context}")
    if by_position and segments:
        raise ValueError("evaluate: by_position scores the positions of a window; a stream has none")
    if segments:
        if context:
            raise ValueError("evaluate: a stream carries its whole past; context applies to windows only")
        return _scores(*_evaluate_segments(model, ids, seq_len=seq_len, streams=batch_size,
                                           max_segments=max_batches, device=device), chars_per_token)
    n_windows = (len(ids) - 1 - context) // seq_len
    if n_windows <= 0:
        raise ValueError(f"evaluate: split of {len(ids)} tokens is shorter than context + seq_len + 1 = "
                         f"{context + seq_len + 1}")
    if max_batches > 0:
        n_windows = min(n_windows, max_batches * batch_size)
    was_training = model.training
    model.eval()
    per_position = torch.zeros(seq_len, dtype=torch.float64)  # nats summed over the windows
    for start in range(0, n_windows, batch_size):
        rows = torch.arange(start, min(start + batch_size, n_windows)) * seq_len
        idx = rows[:, None] + torch.arange(context + seq_len + 1)[None, :]
        window = ids[idx].to(device)  # [b, context + seq_len + 1]
        logits = model(window[:, :-1])[:, context:]
        targets = window[:, context + 1:]
        loss = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # [b, seq_len]
        per_position += loss.sum(0).double().cpu()
    model.train(was_training)
    scores = _scores(per_position.sum().item(), n_windows * seq_len, chars_per_token)
    if by_position:
        to_bpc = 1 / (n_windows * math.log(2) * chars_per_token)
        scores["bpc_by_position"] = (per_position * to_bpc).tolist()
    return scores


def _scores(total: float, count: int, chars_per_token: float) -> dict[str, float]:
    """The figures of `total` nats over `count` tokens."""
    loss = total / count
    bits = loss / math.log(2)
    return {"loss": loss, "bpc": bits / chars_per_token, "bits_per_token": bits,
            "ppl": math.exp(min(loss, 50.0)), "tokens": count}


def check_streamable(model: torch.nn.Module) -> None:
    """Raise ConfigError unless every layer's decoding state stays the same size as it reads."""
    from memattn.errors import ConfigError

    cache = model.init_cache(1)
    growing = [i for i, s in enumerate(cache.states) if not s.fixed_size]
    if growing:
        name = model.cfg.attention.name
        raise ConfigError(f"--stream: the decoding state of {name!r} grows with the context "
                          f"(layers {growing}); streaming needs a bounded memory (an abc-* or "
                          "linear mechanism, or persistent with attention.context=window)")


def _evaluate_segments(model, ids, *, seq_len, streams, max_segments, device) -> tuple[float, int]:
    """(nats summed, tokens scored) of the split read as `streams` streams."""
    streams = min(streams, (len(ids) - 1) // seq_len)
    if streams == 0:
        raise ValueError(f"evaluate: split of {len(ids)} tokens is shorter than seq_len + 1 = {seq_len + 1}")
    n_segments = (len(ids) - 1) // streams // seq_len
    if max_segments > 0:
        n_segments = min(n_segments, max_segments)
    was_training = model.training
    model.eval()
    cache = model.init_cache(streams, device=device)
    total, count = 0.0, 0
    for segment in range(n_segments):
        window = segment_window(ids, streams, seq_len, segment).to(device)
        logits = model(window[:, :-1], cache=cache)
        total += F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten(), reduction="sum").item()
        count += window[:, 1:].numel()
    model.train(was_training)
    return total, count
