"""decode: per-token latency and the memory a sequence's decoding state holds, against the
context length, for every causal mechanism and softmax attention with its KV cache.

For each mechanism one small causal LM (random weights: the cost of a step does not depend
on them) reads a random context of length c through its decoding cache, `prefill_chunk`
tokens a call; then it generates greedily (the argmax token is fed back), `--warmup`
untimed steps and `steps` timed ones. The cache is carried to the next, longer context, so
the longest context is read once. Latency: the median wall time of one step (one new token
for each of the B sequences), logits and argmax included. State: `ModelCache.nbytes()` at
context c, the bytes of the state tensors every layer holds (softmax: the keys and values
used so far; bounded mechanisms: their fixed-size memory), divided by B. On CUDA also the
peak of `torch.cuda.max_memory_allocated` over the timed steps, above the model's weights.

Peers (`research.bench.peers`), where installed: after each mechanism that has one, the same
LM with every attention layer replaced by the peer's, decoding through the peer's own cache
(x-transformers' memory tokens: its own LM, which has no cache and runs the prefix again);
state: the bytes of the tensors that cache holds.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from research.bench.common import Choice, Progress, chosen_mechanisms, describe_lm, measure, model_config
from research.bench.peers import Peer, PeerUnavailable, peer_lm, peer_reason, peers_of
from research.bench.report import Metric, Result, Row, Section, fmt_bytes, fmt_ms
from research.bench.settings import BenchSettings
from research.bench.timing import failure, synchronize
from memattn.models import CausalLM

NAME = "decode"
COMPILE_WARMUP = 3  # untimed compiled steps: the first compiles, the next may once more for dynamic shapes


def _section(s: BenchSettings) -> Section:
    metrics = [Metric("seconds_per_token", "ms per token", fmt_ms, scale=1e3),
               Metric("state_bytes_per_sequence", "state bytes per sequence", fmt_bytes)]
    if s.device.type == "cuda":
        metrics.append(Metric("peak_bytes", "CUDA peak while decoding", fmt_bytes))
    d = s.sizes.decode
    return Section(NAME, "Greedy decoding against context length",
                   ("Every model's one-token step compiled (torch.compile, dynamic shapes). " if d.compile else "")
                   + f"Batch {d.batch}; the median of {d.steps} greedy steps at each context, after "
                   f"{s.warmup} untimed. ms per token: one step, which gives a token to each "
                   "sequence. State bytes: the decoding state's tensors at that context, per "
                   "sequence." + (" CUDA peak: `max_memory_allocated` over the timed steps above "
                                  "the weights, the whole batch." if s.device.type == "cuda" else ""),
                   tuple(metrics), x_name="context")


def _split(s: BenchSettings):
    runs, skipped = [], []
    for choice in chosen_mechanisms(s):
        if not choice.mechanism.causal:
            skipped.append((choice, "bidirectional only: it has no causal form to decode with"))
        elif not hasattr(choice.mechanism.layer, "init_state"):
            skipped.append((choice, "its layer has no decoding state (init_state)"))
        else:
            runs.append(choice)
    return runs, skipped


def count(s: BenchSettings) -> int:
    runs = _split(s)[0]
    return (len(runs) + sum(len(peers_of(c.name)) for c in runs)) * len(s.sizes.decode.contexts)


def run(s: BenchSettings, progress: Progress) -> Result:
    d, lm = s.sizes.decode, s.sizes.lm
    runs, skipped = _split(s)
    result = Result(
        NAME, "Decoding: latency and state memory against context", __doc__.split("\n\n", 1)[1].strip(),
        [_section(s)], {}, {"lm": vars(lm), "decode": vars(d), "lm_shape": describe_lm(lm)})
    result.intro += f"\n\nThe LM: {describe_lm(lm)}; batch {d.batch}."
    result.rows += [Row(NAME, c.label, c.name, c.options, status="skipped", reason=why) for c, why in skipped]
    for choice in runs:
        result.rows += decode_mechanism(choice, s, progress)
        for peer in peers_of(choice.name):
            result.rows += decode_peer(peer, choice, s, progress)
            if peer.note:
                result.notes.append(f"{peer.label}: {peer.note}.")
    return result


def _lm(choice: Choice, s: BenchSettings) -> CausalLM:
    torch.manual_seed(0)
    max_len = max(s.sizes.decode.contexts) + s.warmup + s.sizes.decode.steps + COMPILE_WARMUP + 1
    return CausalLM(model_config(choice.name, choice.options, s.sizes.lm, max_len))


def decode_mechanism(choice: Choice, s: BenchSettings, progress: Progress) -> list[Row]:
    """One row per context: the model reads the contexts in increasing order, one cache."""
    return decode_model(lambda: _lm(choice, s), Row(NAME, choice.label, choice.name, choice.options),
                        s, progress)


def decode_peer(peer: Peer, choice: Choice, s: BenchSettings, progress: Progress) -> list[Row]:
    """The rows of `peer` against `choice`'s mechanism (one skipped row where it cannot run)."""
    row = Row(NAME, peer.label, choice.name, choice.options, versus=choice.label)
    try:
        return decode_model(lambda: peer_lm(peer, s.sizes.lm, choice.options, _lm(choice, s)), row, s,
                            progress, strict=True)
    except PeerUnavailable as e:
        progress.done(len(s.sizes.decode.contexts))
        row.status, row.reason = "skipped", peer_reason(e)
        return [row]


def decode_model(build, like: Row, s: BenchSettings, progress: Progress, strict: bool = False) -> list[Row]:
    """One row (a copy of `like`) per context for the model build() returns. strict: a
    PeerUnavailable from build() is raised, not recorded as a failure."""
    d, lm = s.sizes.decode, s.sizes.lm
    contexts = sorted(set(d.contexts))
    steps = s.warmup + d.steps
    rows: list[Row] = []

    def row_at(c: int, **kw) -> Row:
        return dataclasses.replace(like, **{"x": c, "options": dict(like.options), "metrics": {},
                                            "shape": {}, **kw})

    try:
        model = build().to(device=s.device, dtype=s.dtype).eval()
    except Exception as e:  # noqa: BLE001  (recorded, and the run goes on)
        if strict and isinstance(e, PeerUnavailable):
            raise
        status, reason = failure(e)
        progress.done(len(contexts))
        return [row_at(c, status=status, reason=reason) for c in contexts]
    weights = torch.cuda.memory_allocated(s.device) if s.device.type == "cuda" else 0
    gen = torch.Generator(device=s.device).manual_seed(0)
    held = {"cache": None, "position": 0, "logits": None, "compiled": 0}
    step = model
    if d.compile:
        from memattn.generate import decoding_step

        step = decoding_step(model)

    def at(c: int) -> dict[str, float]:
        if held["cache"] is None or held["position"] > c:  # start over from an empty cache
            held.update(cache=model.init_cache(d.batch, device=s.device), position=0)
        cache = held["cache"]
        with torch.inference_mode():
            while held["position"] < c:
                n = min(d.prefill_chunk, c - held["position"])
                ids = torch.randint(0, lm.vocab_size, (d.batch, n), device=s.device, generator=gen)
                held["logits"] = model(ids, cache=cache)[:, -1]
                held["position"] += n
            state = cache.nbytes()
            token = held["logits"].argmax(-1, keepdim=True)  # [B, 1]
            times = []
            warm = COMPILE_WARMUP if d.compile and not held["compiled"] else 0
            for i in range(-warm, steps):
                if i == s.warmup and s.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(s.device)
                synchronize(s.device)
                start = time.perf_counter()
                logits = step(token, cache=cache)[:, -1]
                token = logits.argmax(-1, keepdim=True)
                synchronize(s.device)
                if i >= 0:
                    times.append(time.perf_counter() - start)
            held["logits"] = logits
            held["position"] += steps + warm
            held["compiled"] = 1
        out = {"seconds_per_token": statistics.median(times[s.warmup:]), "state_bytes": state,
               "state_bytes_per_sequence": state / d.batch,
               "tokens_per_s": d.batch / statistics.median(times[s.warmup:])}
        if s.device.type == "cuda":
            out["peak_bytes"] = torch.cuda.max_memory_allocated(s.device) - weights
        return out

    oom_at = None
    for c in contexts:
        progress.step(f"decode {like.label} @ {c:,}")
        row = row_at(c, shape={"batch": d.batch})
        if oom_at is not None:
            row.status, row.reason = "oom", f"not run: out of memory at context {oom_at:,} already"
        else:
            measure(row, lambda c=c: at(c), s)
            if row.status != "ok":
                held.update(cache=None, position=0)  # the cache may be half-updated: start over
                oom_at = c if row.status == "oom" else None
        rows.append(row)
        progress.done()
    return rows
