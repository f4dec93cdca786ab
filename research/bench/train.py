"""train: forward + backward throughput against sequence length, every causal mechanism.

Three comparisons, each at every length T of `train.lengths` with a batch of
B = max(1, train.tokens // T) sequences (so that every length trains on about as many
tokens a step):

- one attention layer (the LM's width and heads): y = layer(x) for x [B, T, d], then
  y.backward(dy) with a random dy; parameter and input gradients set to None between calls;
- the small causal LM: next-token cross-entropy on random tokens, then backward;
- the ABC op itself: memattn's `abc_attention` (chunked form) against the causal softmax op
  (`scaled_dot_product_attention`) and, where installed, flash-linear-attention's `chunk_abc`
  (CUDA) and its pure-PyTorch `naive_recurrent_abc`, on the same q, k, v [B, T, H, D] and
  slot logits s [B, T, H, M].

Peers (`research.bench.peers`), where installed: after each mechanism that has one, the
peer's layer in the layer rows, and in the LM rows memattn's LM with every attention layer
replaced by the peer's (x-transformers' memory tokens: its own LM of the same shape).

Throughput: B·T / the median wall time of one forward + backward. On CUDA also the peak of
`torch.cuda.max_memory_allocated` in one step above what was allocated before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from research.bench.common import Choice, Progress, chosen_mechanisms, describe_lm, measure, model_config
from research.bench.peers import (FLA_ABC, FLA_NAIVE_ABC, Peer, PeerUnavailable, fla_chunk_abc,
                                 fla_naive_abc, peer_lm, peer_reason, peers_of)
from research.bench.report import BASELINE, Metric, Result, Row, Section, fmt_bytes, fmt_rate
from research.bench.settings import BenchSettings
from research.bench.timing import median_time, peak_allocated
from memattn.layers.base import LayerSpec, build_attention
from memattn.models import CausalLM
from memattn.ops import abc_attention, softmax_attention

NAME = "train"
MEMATTN_ABC = "abc_attention (memattn)"


def _metrics(s: BenchSettings) -> tuple[Metric, ...]:
    out = [Metric("tokens_per_s", "tokens/s", fmt_rate)]
    if s.device.type == "cuda":
        out.append(Metric("peak_bytes", "CUDA peak memory", fmt_bytes))
    return tuple(out)


def _split(s: BenchSettings):
    runs, skipped = [], []
    for choice in chosen_mechanisms(s):
        if choice.mechanism.causal:
            runs.append(choice)
        else:
            skipped.append((choice, "bidirectional only: it has no causal form"))
    return runs, skipped


def count(s: BenchSettings) -> int:
    runs = _split(s)[0]
    return (2 * (len(runs) + sum(len(peers_of(c.name)) for c in runs)) + 4) * len(s.sizes.train.lengths)


def batch_for(s: BenchSettings, T: int) -> int:
    return max(1, s.sizes.train.tokens // T)


def _time_step(step, s: BenchSettings, tokens: int) -> dict[str, float]:
    seconds = median_time(step, repeats=s.repeats, warmup=s.warmup, device=s.device)
    out = {"seconds": seconds, "tokens_per_s": tokens / seconds}
    if s.device.type == "cuda":
        out["peak_bytes"] = peak_allocated(step, s.device)
    return out


def layer_step(choice: Choice, s: BenchSettings, T: int, peer: Peer | None = None) -> dict[str, float]:
    """One layer of `choice`'s mechanism, or `peer`'s layer built for it."""
    lm, B = s.sizes.lm, batch_for(s, T)
    torch.manual_seed(0)
    spec = LayerSpec(lm.d_model, lm.n_heads, causal=True, max_len=T)
    layer = (peer.layer(spec, choice.options) if peer is not None
             else build_attention(choice.name, choice.options, spec)).to(s.device, s.dtype).train()
    x = torch.randn(B, T, lm.d_model, device=s.device, dtype=s.dtype, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y, _ = layer(x)
        y.backward(dy)

    return _time_step(step, s, B * T)


def lm_step(choice: Choice, s: BenchSettings, T: int, peer: Peer | None = None) -> dict[str, float]:
    """The small LM of `choice`'s mechanism, or the LM of `peer` built for it (`peer_lm`)."""
    lm, B = s.sizes.lm, batch_for(s, T)
    torch.manual_seed(0)
    model = CausalLM(model_config(choice.name, choice.options, lm, T))
    if peer is not None:
        model = peer_lm(peer, lm, choice.options, model)
    model = model.to(s.device, s.dtype).train()
    idx = torch.randint(0, lm.vocab_size, (B, T + 1), device=s.device)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten()).backward()

    return _time_step(step, s, B * T)


def op_step(op, s: BenchSettings, T: int) -> dict[str, float]:
    lm, B, M = s.sizes.lm, batch_for(s, T), s.sizes.train.slots
    H, D = lm.n_heads, lm.d_model // lm.n_heads
    g = torch.Generator(device=s.device).manual_seed(T)

    def leaf(*shape):
        return torch.randn(*shape, device=s.device, generator=g).to(s.dtype).requires_grad_()

    q, k, v, logits = leaf(B, T, H, D), leaf(B, T, H, D), leaf(B, T, H, D), leaf(B, T, H, M)
    do = torch.randn(B, T, H, D, device=s.device, generator=g).to(s.dtype)

    def step():
        for t in (q, k, v, logits):
            t.grad = None
        op(q, k, v, logits).backward(do)

    return _time_step(step, s, B * T)


def _ops(s: BenchSettings) -> list[tuple[str, object, str]]:
    """[(label, op(q, k, v, s) -> o, why skipped or "")]: softmax, memattn's ABC, its peers."""
    fla, why = fla_chunk_abc(s.device)
    naive, naive_why = fla_naive_abc(s.device)
    return [(BASELINE, lambda q, k, v, _: softmax_attention(q, k, v, causal=True)[0], ""),
            (MEMATTN_ABC, lambda q, k, v, logits: abc_attention(q, k, v, logits, causal=True)[0], ""),
            (FLA_ABC, fla, why), (FLA_NAIVE_ABC, naive, naive_why)]


def run(s: BenchSettings, progress: Progress) -> Result:
    t, lm = s.sizes.train, s.sizes.lm
    metrics = _metrics(s)
    H, D = lm.n_heads, lm.d_model // lm.n_heads
    batches = ", ".join(f"{batch_for(s, T)} at {T:,}" for T in sorted(t.lengths))
    sections = [
        Section("layer", "One attention layer, forward + backward",
                f"d_model {lm.d_model}, {H} heads, rotary positions; batch {batches}.", metrics, "length"),
        Section("lm", "The small LM, forward + backward",
                f"{describe_lm(lm)}; next-token cross-entropy; batch {batches}.", metrics, "length"),
        Section("op", f"The ABC op, forward + backward (M = {t.slots} slots)",
                f"q, k, v [B, T, {H}, {D}], slot logits [B, T, {H}, {t.slots}]; batch {batches}. "
                "softmax: the causal softmax op (`scaled_dot_product_attention`).", metrics, "length"),
    ]
    result = Result(NAME, "Training: forward + backward throughput against length",
                    __doc__.split("\n\n", 1)[1].strip(), sections, {},
                    {"lm": vars(lm), "train": vars(t), "lm_shape": describe_lm(lm),
                     "batch": {str(T): batch_for(s, T) for T in t.lengths}})
    runs, skipped = _split(s)
    for section in ("layer", "lm"):
        result.rows += [Row(section, c.label, c.name, c.options, status="skipped", reason=why)
                        for c, why in skipped]
    lengths = sorted(set(t.lengths))
    for T in lengths:
        shape = {"batch": batch_for(s, T), "length": T}
        for section, fn in (("layer", layer_step), ("lm", lm_step)):
            for c in runs:
                progress.step(f"train {section} {c.label} @ {T:,}")
                row = Row(section, c.label, c.name, c.options, x=T, shape=shape)
                result.rows.append(measure(row, lambda fn=fn, c=c, T=T: fn(c, s, T), s))
                progress.done()
                for peer in peers_of(c.name):
                    progress.step(f"train {section} {peer.label} @ {T:,}")
                    row = Row(section, peer.label, c.name, c.options, x=T, shape=shape, versus=c.label)
                    result.rows.append(_measure_peer(row, lambda fn=fn, c=c, T=T, p=peer: fn(c, s, T, p), s))
                    progress.done()
        for label, op, why in _ops(s):
            progress.step(f"train op {label} @ {T:,}")
            mech = "abc-mlp" if label != BASELINE else BASELINE
            row = Row("op", label, mech, {"num_slots": t.slots}, x=T, shape=shape,
                      versus=MEMATTN_ABC if label in (FLA_ABC, FLA_NAIVE_ABC) else "")
            if op is None:
                row.status, row.reason = "skipped", why
            else:
                measure(row, lambda op=op, T=T: op_step(op, s, T), s)
            result.rows.append(row)
            progress.done()
    notes = dict.fromkeys(f"{p.label}: {p.note}." for c in runs for p in peers_of(c.name) if p.note)
    result.notes += list(notes)
    return result


def _measure_peer(row: Row, fn, s: BenchSettings) -> Row:
    """`measure`, with a peer that cannot be built recorded as skipped with its reason."""
    try:
        return measure(row, fn, s, reraise=(PeerUnavailable,))
    except PeerUnavailable as e:
        row.status, row.reason = "skipped", peer_reason(e)
        return row
