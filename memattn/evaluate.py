"""Evaluation: mean next-token loss over a split, as nats, bits per character and perplexity."""

from __future__ import annotations

import math
from collections.abc import Callable

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
             by_position: bool = False, progress: Callable[[int, int], None] | None = None) -> dict:
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
    progress(windows done, windows in all): called after each batch of windows (not streams).
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
        if progress is not None:
            progress(min(start + batch_size, n_windows), n_windows)
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


MAX_WINDOW = 16_384  # longest window a growing-state model reads at once (T² scores per head and layer)


def position_buckets(train_len: int, length: int) -> list[tuple[int, int]]:
    """Log-spaced position buckets [start, end) up to `length`: [0, T), [T, 2T), [2T, 4T), ...,
    the last one cut at `length` (T = train_len)."""
    edges, end = [0], train_len
    while end < length:
        edges.append(end)
        end *= 2
    edges.append(length)
    return list(zip(edges, edges[1:]))


@torch.no_grad()
def evaluate_by_length(model: torch.nn.Module, ids: torch.Tensor, *, lengths, train_len: int,
                       streams: int = 1, device: str | torch.device = "cpu", chars_per_token: float = 1.0,
                       chunk: int = 0, max_window: int = MAX_WINDOW, progress=None,
                       windows: bool = False) -> dict:
    """Bits per character by position in a document, at the training length and past it.

    ids: int64 [N], the split, read as `streams` documents of L = max(lengths) tokens:
    document d is ids[d·L : (d + 1)·L + 1], the consecutive non-overlapping pieces of the split
    (fewer documents when the split holds fewer; ConfigError naming --lengths when it holds
    none). Position p scores the target p + 1 with the tokens 0..p read.
    How the model reads, the "read" of every figure:
    - "stream": every layer's decoding state is fixed in size; the documents, one row each,
      in one pass of `chunk` tokens at a time (default train_len), the cache carried: memory
      stays constant whatever L.
    - "window": a growing state; each document as one window from its first token, of at
      most `max_window` tokens. The model is causal, so the first n positions of a longer
      window are those of a window of n tokens.
    What the model cannot read (a window over max_window; learned or split positions past
    model.max_len; a ShapeError of the mechanism met while streaming, e.g. abc-linformer's
    columns end at model.max_len) is "not read": bpc None, read None and a note saying why;
    the rest is still reported.
    progress: optional callable(done, total), tokens scored so far and in all.
    windows: also read the same positions as windows of train_len from an empty memory, the
    reading the model was trained for; each figure then has "bpc_windows", so that the cost of
    the long read is measured on the same text.

    Returns {"read", "length": L, "train_len", "documents", "tokens_read" (per document),
    "tokens" (scored), "chunk", "max_window", "state_bytes" (the cache of all documents at the
    end of a stream, else None), "buckets": [{"start", "end", "tokens", "bpc", "read"(, "note")}]
    over `position_buckets(train_len, L)`, "lengths": [{"length": n, ...}] over the first n
    positions}.
    """
    from memattn.errors import ConfigError, ShapeError

    lengths = sorted(set(lengths))
    if not lengths or lengths[0] < 1:
        raise ConfigError(f"--lengths: expected positive numbers of tokens, got {lengths}")
    for name, value in (("train_len", train_len), ("streams", streams), ("max_window", max_window)):
        if value < 1:
            raise ConfigError(f"{name}: expected a number >= 1, got {value}")
    if chunk < 0:
        raise ConfigError(f"chunk: expected a number of tokens >= 0 (0: train_len), got {chunk}")
    if not hasattr(model, "init_cache"):
        raise ConfigError("--lengths: reads memattn's causal language models (a model with init_cache)")
    L = lengths[-1]
    documents = min(streams, (len(ids) - 1) // L)
    if documents < 1:
        raise ConfigError(f"--lengths: a document of {L:,} tokens needs {L + 1:,} tokens of the split "
                          f"(targets are shifted by one); the split holds {len(ids):,}")
    docs = ids[:documents * L + 1].unfold(0, L + 1, L)  # [D, L + 1]
    stream = all(s.fixed_size for s in model.init_cache(1).states)
    mode, chunk = ("stream", chunk or train_len) if stream else ("window", None)

    reach, why = L, ""  # positions read, and why not further ({n}: the tokens asked for)
    cfg = model.cfg
    if cfg.positions in ("learned", "split") and cfg.max_len < reach:
        reach = cfg.max_len
        why = f"not read: {{n:,}} tokens exceed model.max_len={cfg.max_len:,} of the {cfg.positions} position table"
    if not stream and max_window < reach:
        reach = max_window
        why = f"not read: a window of {{n:,}} tokens exceeds max_window={max_window:,}"

    was_training = model.training
    model.eval()
    nats = torch.zeros(reach, dtype=torch.float64)  # summed over the documents
    read, cache = 0, None
    if progress:
        progress(0, documents * reach)
    try:
        if stream:
            cache = model.init_cache(documents, device=device)
            for start in range(0, reach, chunk):
                end = min(start + chunk, reach)
                piece = docs[:, start:end + 1].to(device)
                logits = model(piece[:, :-1], cache=cache)
                loss = F.cross_entropy(logits.float().transpose(1, 2), piece[:, 1:], reduction="none")  # [D, c]
                nats[start:end] = loss.sum(0).double().cpu()
                read = end
                if progress:
                    progress(documents * end, documents * reach)
        else:
            for d in range(documents):
                window = docs[d:d + 1, :reach + 1].to(device)
                logits = model(window[:, :-1])
                nats += F.cross_entropy(logits.float().transpose(1, 2), window[:, 1:],
                                        reduction="none")[0].double().cpu()  # [reach]
                if progress:
                    progress((d + 1) * reach, documents * reach)
            read = reach
    except ShapeError as e:  # a limit of the mechanism's own, met at position `read`
        if read == 0:
            raise
        reach, why = read, "not read: " + str(e).replace("{", "{{").replace("}", "}}")
    finally:
        model.train(was_training)
    state_bytes = cache.nbytes() if cache is not None else None
    short = torch.zeros(reach, dtype=torch.float64)  # nats at each position read in windows of train_len
    if windows:
        model.eval()
        for start in range(0, reach, train_len):
            end = min(start + train_len, reach)
            piece = docs[:, start:end + 1].to(device)
            logits = model(piece[:, :-1])
            short[start:end] = F.cross_entropy(logits.float().transpose(1, 2), piece[:, 1:],
                                               reduction="none").sum(0).double().cpu()
        model.train(was_training)

    total = torch.cat([nats.new_zeros(1), nats[:reach].cumsum(0)])  # [reach + 1] nats before each position
    total_short = torch.cat([short.new_zeros(1), short.cumsum(0)])
    to_bits = 1 / (math.log(2) * chars_per_token)

    def figure(start: int, end: int) -> dict:
        if end > reach:
            return {"tokens": 0, "bpc": None, "read": None, "note": why.format(n=end)}
        count = documents * (end - start)
        out = {"tokens": count, "bpc": (total[end] - total[start]).item() / count * to_bits, "read": mode}
        if windows:
            out["bpc_windows"] = (total_short[end] - total_short[start]).item() / count * to_bits
        return out

    return {"read": mode, "length": L, "train_len": train_len, "documents": documents,
            "tokens_read": reach, "tokens": documents * reach, "chunk": chunk,
            "max_window": None if stream else max_window, "state_bytes": state_bytes,
            "buckets": [{"start": a, "end": b, **figure(a, b)} for a, b in position_buckets(train_len, L)],
            "lengths": [{"length": n, **figure(0, n)} for n in lengths]}


def plot_by_length(result: dict, path, title: str = "") -> None:
    """Bits per character against position (`evaluate_by_length`'s buckets, log x axis), one
    line, with a vertical marker at the training length; written to `path` (PNG)."""
    from memattn.errors import ConfigError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot: needs matplotlib (pip install 'memattn[plot]')") from None
    read = [b for b in result["buckets"] if b["bpc"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    # a bucket [start, end) drawn at the geometric middle of the tokens read at its positions
    ax.plot([math.sqrt((b["start"] + 1) * b["end"]) for b in read], [b["bpc"] for b in read],
            marker="o", label=f"bpc ({result['read']})")
    ax.axvline(result["train_len"], color="grey", linestyle="--", label=f"training length {result['train_len']:,}")
    unread = [b for b in result["buckets"] if b["bpc"] is None]
    if unread:
        ax.axvspan(unread[0]["start"] + 1, result["length"], color="grey", alpha=0.15, label="not read")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens read (position + 1)")
    ax.set_ylabel("bits per character")
    ax.set_title(title or f"quality by length: {result['documents']} document(s) of {result['length']:,} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    from memattn.fileio import atomic_write

    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
