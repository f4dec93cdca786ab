"""The `memattn` command line: train, eval, generate, info, demo, experiment, compress, decompress, bench.

Every command that builds a run takes `--config PRESET_OR_YAML` and `key=value` overrides,
e.g. `memattn train --config demo model.n_layers=2 attention=softmax train.steps=100`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from memattn.errors import ConfigError, MemattnError, UsageError
from memattn.fileio import atomic_write_text

OVERRIDES_HELP = ("key=value overrides of the config, checked against its fields: "
                  "model.* data.* train.*, and attention=NAME / attention.OPTION=VALUE "
                  "for the mechanism (e.g. model.d_model=128 train.steps=200 attention=softmax)")


# ---------------------------------------------------------------------------------------
# Numeric options: each range is checked once, by its argparse type


def int_at_least(least: int, what: str = "a number", note: str = ""):
    """An argparse type: an integer >= `least`, else a one-line error naming the option
    ("--batch-size: expected a number >= 1, got 0"). `what` names the quantity, `note` follows
    the bound (e.g. " (0: all)")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected {what} >= {least}{note}, got {text}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


def float_at_least(least: float, what: str = "a finite number", note: str = ""):
    """An argparse type: a finite float >= `least`, else a one-line error naming the option."""
    import math

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < least:
            raise argparse.ArgumentTypeError(f"expected {what} >= {least:g}{note}, got {text}")
        return value

    parse.__name__ = f"number >= {least:g}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line raised as UsageError (main prints it and returns 2),
    never a usage block and sys.exit in the middle of a caller's process."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)", prog=self.prog)


def _run_config(args):
    from memattn.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args) -> int:
    from memattn.train import train

    cfg = _run_config(args)
    summary = train(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet)
    if summary.get("complete"):
        print(f"{cfg.train.out_dir}: the run is complete at step {summary['checkpoint_step']} "
              f"(train.steps={cfg.train.steps}); nothing to train. Give a larger train.steps to go on.")
    elif summary.get("val"):
        val = summary["val"]
        score = (f"val bpc {val['bpc']:.3f}" if "bpc" in val else
                 f"val masked accuracy {100 * val['accuracy']:.1f} %" if "accuracy" in val else
                 f"val perplexity {val['ppl']:.2f}")
        print(f"{summary['attention']}: {summary['params']:,} parameters, {summary['steps']} steps, "
              f"{score}, {summary['tokens_per_s']:,.0f} tokens/s, checkpoint {summary['checkpoint']}")
    return 0


def cmd_eval(args) -> int:
    from memattn.errors import ConfigError
    from memattn.evaluate import as_tensor, check_streamable, evaluate
    from memattn.train import checkpoint_split, model_from_checkpoint

    lengths = parse_lengths(args.lengths) if args.lengths is not None else None
    by_length = ("--streams", args.streams), ("--max-window", args.max_window), ("--chunk", args.chunk), \
        ("--plot", args.plot)
    if lengths is None and any(value is not None for _, value in by_length):
        given = [name for name, value in by_length if value is not None]
        raise ConfigError(f"{' / '.join(given)}: options of --lengths; give --lengths too")
    if lengths is not None and (args.context or args.stream or args.seq_len):
        raise ConfigError("--lengths: reads whole documents from their first token (streamed or as one "
                          "window); not with --context, --stream or --seq-len")
    check_device(args.device)
    model, cfg, vocab = model_from_checkpoint(args.checkpoint, args.device)
    if lengths is not None and (cfg.task != "lm" or not hasattr(model, "init_cache")):
        raise ConfigError(f"--lengths: measures memattn's causal language models; {args.checkpoint} is a "
                          f"{cfg.task} run{' of a converted model' if cfg.task == 'lm' else ''}")
    if cfg.task == "translation":
        return eval_translation(args, model, cfg, vocab)
    ids, chars_per_token, note = checkpoint_split(args.checkpoint, cfg, vocab, args.split)
    if note:
        print(f"memattn eval: note: {note}", file=sys.stderr)
    if lengths is not None:
        return eval_by_length(args, model, cfg, as_tensor(ids), lengths, chars_per_token)
    if cfg.task == "mlm":
        return eval_masked(args, model, cfg, ids)
    seq_len = args.seq_len or cfg.train.seq_len
    stream = args.stream or cfg.train.segments
    check_window(cfg, len(ids), seq_len, 0 if stream else args.context, args.split,
                 streams=args.batch_size if stream else 0)
    ids = as_tensor(ids)
    if stream and args.context:
        raise ConfigError("--context: a stream (--stream, or a run trained with train.segments) "
                          "already reads everything before each segment")
    if args.stream:
        check_streamable(model)
    windows = (len(ids) - 1 - args.context) // seq_len
    if args.batches:
        windows = min(windows, args.batches * args.batch_size)
    read, scored = windows * (args.context + seq_len), windows * seq_len
    if not stream and args.context and read > 1_000_000 and read > 8 * scored:
        print(f"memattn eval: note: each window re-reads --context {args.context:,} tokens before scoring "
              f"{seq_len}: {read:,} tokens read to score {scored:,} (--batches N reads fewer)", file=sys.stderr)
    with progress_bar(f"eval {cfg.model.attention.name}", "window", quiet=args.json or args.quiet) as progress:
        result = evaluate(model, ids, seq_len=seq_len, batch_size=args.batch_size,
                          max_batches=args.batches, device=args.device, segments=stream,
                          context=args.context, chars_per_token=chars_per_token, progress=progress)
    result.update(split=args.split, seq_len=seq_len, context=args.context, stream=stream,
                  checkpoint=str(args.checkpoint))
    reading = ("one stream per row, state carried" if stream else
               f"segments of {seq_len} after {args.context} unscored tokens")
    print(json.dumps(result) if args.json else
          f"{args.split}: loss {result['loss']:.4f} nats, {result['bpc']:.4f} bits/char, "
          f"perplexity {result['ppl']:.3f} over {result['tokens']:,} tokens ({reading})")
    return 0


def check_window(cfg, tokens: int, seq_len: int, context: int, split: str, streams: int = 0) -> None:
    """ConfigError unless a split of `tokens` tokens holds one window of context + seq_len
    tokens and its next one (or, streamed, `streams` streams of a segment each), and the
    model's learned positions, if any, reach that far: refused before anything is read."""
    names = "--seq-len" + (" / --context" if context else "")
    if streams and (tokens - 1) // streams < seq_len:
        raise ConfigError(f"--seq-len / --batch-size: the {split} split holds {tokens:,} tokens, too few for "
                          f"{streams} streams of a segment of {seq_len} tokens each; use a smaller --batch-size "
                          "or --seq-len")
    if not streams and tokens < context + seq_len + 1:
        raise ConfigError(f"{names}: the {split} split holds {tokens:,} tokens, fewer than one window of "
                          f"{context + seq_len:,} tokens and its next one ({context:,} of context + seq_len "
                          f"{seq_len:,} + 1); use a shorter {names.replace(' / ', ' or ')}")
    if cfg.model.positions in ("learned", "split") and context + seq_len > cfg.model.max_len:
        raise ConfigError(f"{names}: windows of {context + seq_len:,} tokens run past the model's learned "
                          f"positions (model.max_len={cfg.model.max_len:,}); use at most {cfg.model.max_len:,} "
                          "tokens in all")


@contextlib.contextmanager
def progress_bar(label: str, unit: str, *, quiet: bool = False):
    """A progress callback (done, total) that shows a bar with the time left on stderr once a
    job has run for 2 s (none with `quiet`); the bar is closed when the block ends."""
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if quiet:
            return
        if bar is None:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc=label, unit=unit, delay=2, dynamic_ncols=True)
        bar.update(done - bar.n)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()


def parse_lengths(text: str) -> list[int]:
    """`--lengths 512,2048,8192`: positive numbers of tokens, else ConfigError."""
    from memattn.errors import ConfigError

    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"--lengths: expected positive numbers of tokens separated by commas "
                          f"(e.g. 512,2048,8192), got {text!r}")
    return sorted(set(lengths))


def eval_by_length(args, model, cfg, ids, lengths, chars_per_token) -> int:
    """`memattn eval --lengths`: bits per character by position bucket and over the first n tokens
    (`memattn.evaluate.evaluate_by_length`), as a table or JSON, and optionally a plot."""
    from memattn.evaluate import MAX_WINDOW, evaluate_by_length, plot_by_length

    streams, chunk, max_window = args.streams or 1, args.chunk or 0, args.max_window or MAX_WINDOW
    bar = None

    def progress(done: int, total: int) -> None:  # tokens scored, on stderr
        nonlocal bar
        if bar is None:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc=f"eval {cfg.model.attention.name} by length", unit="token",
                       unit_scale=True, dynamic_ncols=True)
        bar.update(done - bar.n)

    try:
        result = evaluate_by_length(model, ids, lengths=lengths, train_len=cfg.train.seq_len, streams=streams,
                                    device=args.device, chars_per_token=chars_per_token, chunk=chunk,
                                    max_window=max_window, progress=None if args.json or args.quiet else progress)
    finally:
        if bar is not None:
            bar.close()
    result.update(split=args.split, attention=cfg.model.attention.name, checkpoint=str(args.checkpoint))
    if result["documents"] < streams:
        print(f"memattn eval: note: the {args.split} split holds {result['documents']} document(s) of "
              f"{result['length']:,} tokens, not --streams {streams}", file=sys.stderr)
    if args.plot:
        plot_by_length(result, args.plot, title=f"{result['attention']}: {args.split} bpc by position")
    if args.json:
        print(json.dumps(result))
        return 0
    how = (f"streamed in chunks of {result['chunk']:,} tokens, state {result['state_bytes']:,} bytes at the end"
           if result["read"] == "stream" else f"each read as one window of at most {result['max_window']:,} tokens")
    print(f"{args.split}: {result['attention']} trained on {result['train_len']:,} tokens, "
          f"{result['documents']} document(s) of {result['length']:,} tokens, {how}")

    def row(label: str, r: dict) -> str:
        bpc = f"{r['bpc']:.4f}" if r["bpc"] is not None else "-"
        return f"{label:<22}{bpc:>8}  {r['read'] or r['note']}"

    print(f"{'positions':<22}{'bpc':>8}  read")
    for b in result["buckets"]:
        print(row(f"[{b['start']:,}, {b['end']:,})", b))
    print(f"{'first n tokens':<22}{'bpc':>8}  read")
    for n in result["lengths"]:
        print(row(f"{n['length']:,}", n))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def eval_translation(args, model, cfg, vocab_json) -> int:
    """`memattn eval` of a translation run: loss and perplexity of the split's references,
    then its sources translated (--beam) and scored with SacreBLEU and chrF."""
    from memattn.data import Vocab
    from memattn.translation import evaluate_pairs, load_parallel_corpus, score_translations, translate_texts

    if args.stream or args.context or args.seq_len:
        raise MemattnError("--stream / --context / --seq-len: for language models, not a translation run")
    vocab = Vocab.from_json(vocab_json)
    split = load_parallel_corpus(cfg, vocab).split(args.split)
    n = min(len(split), args.batches * args.batch_size) if args.batches else len(split)
    result = evaluate_pairs(model, split, vocab, batch_size=args.batch_size, max_batches=args.batches,
                            device=args.device)
    start = time.perf_counter()
    hyps = translate_texts(model, vocab, split.source_text[:n], beam=args.beam,
                           length_penalty=args.length_penalty, batch_size=args.batch_size,
                           device=args.device, where=f"the {args.split} split")
    seconds = time.perf_counter() - start
    result.update(score_translations(hyps, split.target_text[:n]), split=args.split, sentences=n,
                  beam=args.beam, length_penalty=args.length_penalty, translate_s=round(seconds, 2),
                  checkpoint=str(args.checkpoint))
    print(json.dumps(result) if args.json else
          f"{args.split}: loss {result['loss']:.4f} nats, perplexity {result['ppl']:.3f} over "
          f"{result['tokens']:,} target tokens; BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f} "
          f"over {n:,} sentences (beam {args.beam}, {seconds:.1f} s)")
    return 0


def eval_masked(args, model, cfg, ids) -> int:
    """`memattn eval` of a masked-LM run: loss, perplexity and accuracy at the masked positions
    of the split's windows (masks drawn from the run's seed)."""
    from memattn.evaluate import as_tensor
    from memattn.masked import evaluate_masked, windows

    if args.stream or args.context:
        raise MemattnError("--stream / --context: for causal language models, not a masked-LM run")
    seq_len = args.seq_len or cfg.train.seq_len
    data = windows(as_tensor(ids), seq_len, args.batches * args.batch_size if args.batches else 1 << 62)
    result = evaluate_masked(model, data, cfg.model.vocab_size - 1, args.batch_size, cfg.train.seed, args.device)
    result.update(split=args.split, seq_len=seq_len, checkpoint=str(args.checkpoint))
    print(json.dumps(result) if args.json else
          f"{args.split}: loss {result['loss']:.4f} nats, perplexity {result['ppl']:.3f}, accuracy "
          f"{100 * result['accuracy']:.2f} % over {result['tokens']:,} masked tokens (windows of {seq_len})")
    return 0


def cmd_translate(args) -> int:
    from memattn.data import Vocab
    from memattn.errors import ConfigError
    from memattn.train import model_from_checkpoint
    from memattn.translation import translate_texts

    check_device(args.device)
    path = Path(args.input)
    texts = read_text_input(path, "--input").splitlines()
    with output_file(args.output, "--output", {"the --input file": path, "the run": args.run}) as out:
        model, cfg, vocab_json = model_from_checkpoint(args.run, args.device)
        if cfg.task != "translation":
            raise ConfigError(f"{args.run}: a {cfg.task} run; `memattn translate` needs a translation run")
        translated = translate_texts(model, Vocab.from_json(vocab_json), texts, beam=args.beam,
                                     length_penalty=args.length_penalty, max_len=args.max_len,
                                     batch_size=args.batch_size, device=args.device, where=str(path))
        text = "".join(line + "\n" for line in translated)
        if out is not None:
            atomic_write_text(out, text)
        else:
            sys.stdout.write(text)
    return 0


def cmd_generate(args) -> int:
    import torch

    from memattn.data import Vocab
    from memattn.generate import generate
    from memattn.train import model_from_checkpoint

    from memattn.errors import ConfigError

    check_device(args.device)
    model, cfg, vocab_json = model_from_checkpoint(args.checkpoint, args.device)
    if cfg.task != "lm" or not hasattr(model, "init_cache"):
        raise ConfigError(f"{args.checkpoint}: a {cfg.task} run{' of a converted model' if cfg.task == 'lm' else ''}; "
                          "memattn generate continues memattn's causal language models (translate a "
                          "translation run with memattn translate)")
    vocab = Vocab.from_json(vocab_json)
    if vocab.kind == "char":
        known = set(vocab.symbols) - ({vocab.symbols[vocab.unk_id]} if vocab.unk_id is not None else set())
        unknown = sorted(set(args.prompt) - known)
        if unknown:
            if vocab.unk_id is None:
                raise ConfigError(f"--prompt: characters not in the model's vocabulary: {''.join(unknown)!r}")
            print(f"memattn generate: note: the model does not know {''.join(unknown)!r}; read as its "
                  "unknown symbol", file=sys.stderr)
    prompt = torch.as_tensor(vocab.encode(args.prompt), dtype=torch.long, device=args.device)
    if prompt.numel() == 0:
        raise MemattnError("--prompt: needs at least one character")
    ids = prompt.tolist()
    shown = vocab.decode(ids)  # the text written so far, as the vocabulary reads it
    if vocab.kind == "pretrained" and shown != args.prompt:  # a tokenizer that normalises, or <unk>
        print(f"memattn generate: note: the model's tokenizer reads the prompt as {shown!r}", file=sys.stderr)
    sys.stdout.write(args.prompt)
    start = time.perf_counter()
    for token in generate(model, prompt[None], args.tokens, temperature=args.temperature,
                          top_k=args.top_k, seed=args.seed, compile=args.compile):
        ids.extend(token.tolist())
        # Decoded after what precedes it, a subword keeps its leading space and a byte joins
        # the character it belongs to; an unfinished character (U+FFFD last) waits a token.
        text = vocab.decode(ids)
        if text.endswith("\ufffd"):
            continue
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else vocab.decode(token.tolist()))
        sys.stdout.flush()
        shown = text
    text = vocab.decode(ids)
    if text != shown:
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else "")
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{args.tokens} tokens in {elapsed:.2f}s, {args.tokens / elapsed:,.1f} tokens/s]", file=sys.stderr)
    return 0


def mechanism_table() -> str:
    """Every registered mechanism: where it works, its summary, and each option with its type
    and default, as `attention.OPTION=VALUE` sets it."""
    import dataclasses
    import typing

    from memattn.layers import mechanisms

    lines = []
    for name, mech in mechanisms().items():
        uses = [use for use, ok in (("causal", mech.causal), ("encoder", mech.bidirectional),
                                    ("cross", mech.cross is not None)) if ok]
        if not mech.causal:
            streams = ""
        elif mech.streams(mech.options()):
            streams = "; streams past its training length"
        elif callable(mech.streaming):
            streams = "; streams past its training length with the options that say so"
        else:
            streams = "; not shown to stream past its training length"
        lines.append(f"{name} ({', '.join(uses)}{streams}): {mech.summary}")
        hints = typing.get_type_hints(mech.options)
        for f in dataclasses.fields(mech.options):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            hint = hints[f.name]
            if typing.get_origin(hint) is typing.Literal:
                kind = " | ".join(map(str, typing.get_args(hint)))
            else:
                kind = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
            lines.append(f"    attention.{f.name}: {kind} = {default!r}")
    return "\n".join(lines)


def check_device(name: str) -> None:
    """ConfigError for a device torch cannot use here (e.g. cuda without a GPU)."""
    import torch

    from memattn.errors import ConfigError

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device: {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device: {name!r} asked for, but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device: {name!r} asked for, but this machine has {torch.cuda.device_count()} "
                          "CUDA device(s), numbered from 0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device: {name!r} asked for, but no Apple GPU (mps) is available")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device: {name!r} is a torch device that memattn does not run on "
                          "(it holds no data or is not supported); use cpu or cuda")


def available_memory() -> int | None:
    """Bytes of memory this process may still take: the system's available memory, and its
    control group's limit where there is one; None when neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits_in_memory(build, what: str) -> None:
    """ConfigError when the model build() makes would not fit in the memory available: it is
    built on the meta device first (shapes, no data), so a size that cannot be held is refused
    before anything is allocated."""
    import torch

    try:
        with torch.device("meta"):
            model = build()
    except MemattnError:
        raise
    except Exception:  # noqa: BLE001 (a model that cannot be sized this way is built for real)
        return
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(t.numel() * t.element_size() for t in tensors)
    have = available_memory()
    if have is not None and need > have:
        params = sum(p.numel() for p in model.parameters())
        raise ConfigError(f"{what}: the model asked for has {params:,} parameters, {need / 2**30:,.1f} GiB, more "
                          f"than the {have / 2**30:,.1f} GiB of memory available here; choose smaller sizes "
                          "(model.d_model, model.n_layers, attention options)")


def read_text_input(path: str | os.PathLike, option: str) -> str:
    """The UTF-8 text of the input file `path` (given by `option`), or ConfigError naming it."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{option}: no such file {path}")
    if not path.is_file():
        raise ConfigError(f"{option}: {path} is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{option}: {path} is not UTF-8 text (byte {e.start} cannot be read); convert it "
                          "to UTF-8, e.g. iconv -f latin1 -t utf-8") from None


@contextlib.contextmanager
def output_file(path: str | os.PathLike | None, option: str, reads: dict):
    """Checks and holds the output file `path` of a command (given by `option`) while the block
    writes it: not a file the command reads (`reads`: what names each -> its path), not a
    folder, its folder made now (so a path that cannot be written fails before any work), and
    no other memattn process writing it at the same time. Yields the Path (None: no output
    file, e.g. standard output)."""
    from memattn.fileio import check_not_an_input, output_lock

    if path is None:
        yield None
        return
    out = Path(path)
    check_not_an_input(out, reads, option, ConfigError)
    if out.is_dir():
        raise ConfigError(f"{option}: {out} is a folder; give the path of a file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, option, ConfigError):
        yield out


def state_memory(model, lengths=(64, 128)) -> tuple[int, float]:
    """(fixed bytes, bytes per token) of the decoding state, measured on a batch of one."""
    import torch

    sizes = []
    for n in lengths:
        cache = model.init_cache(1)
        with torch.no_grad():
            model(torch.zeros(1, n, dtype=torch.long), cache=cache)
        sizes.append(cache.nbytes())
    per_token = (sizes[1] - sizes[0]) / (lengths[1] - lengths[0])
    return int(sizes[0] - per_token * lengths[0]), per_token


def cmd_info(args) -> int:
    import dataclasses

    from memattn.analysis import learned_spans
    from memattn.layers import mechanisms
    from memattn.models import CausalLM

    words = [o for o in args.overrides if "=" not in o]
    if len(words) == 1 and not args.checkpoint and Path(words[0]).exists():  # memattn info RUN
        args.checkpoint = words[0]
        args.overrides.remove(words[0])
    if args.checkpoint:
        from memattn.errors import ConfigError
        from memattn.train import model_from_checkpoint

        if args.overrides:
            raise ConfigError(f"info: {' '.join(args.overrides)}: a checkpoint is described as it was "
                              "saved; key=value overrides describe a model built from --config")
        model, cfg, _ = model_from_checkpoint(args.checkpoint)
    else:
        cfg = _run_config(args)
        model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or 256)
        check_fits_in_memory(lambda: CausalLM(model_cfg), "info")
        model = CausalLM(model_cfg).eval()
    causal = cfg.task == "lm" and hasattr(model, "init_cache")  # a memattn causal LM decodes
    fixed, per_token = (state_memory(model, (min(64, cfg.model.max_len // 2), min(128, cfg.model.max_len)))
                        if causal else (None, None))
    m = cfg.model
    info = {
        "task": cfg.task, "attention": m.attention.name, "options": m.attention.options,
        "parameters": model.num_parameters(), "layers": m.n_layers, "d_model": m.d_model,
        "heads": m.n_heads, "positions": m.positions, "vocab_size": model.cfg.vocab_size if hasattr(model, "cfg") else m.vocab_size,
        "state_fixed_bytes": fixed, "state_bytes_per_token": per_token,
    }
    if causal:  # each layer's own state: a hybrid mixes fixed and growing ones
        from memattn.analysis import state_bytes_by_layer

        info["state_by_layer"] = state_bytes_by_layer(model, (min(64, m.max_len // 2), min(128, m.max_len)))
    spans = learned_spans(model)
    if spans:  # adaptive attention span: z per head (tokens), per layer
        info["spans"] = {str(i): [round(z, 1) for z in zs] for i, zs in enumerate(spans) if zs}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"attention      {info['attention']} {info['options'] or ''}")
    print(f"parameters     {info['parameters']:,}")
    if causal or cfg.task != "lm":  # a converted model's shape is its own config's
        print(f"shape          {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, "
              f"{m.positions} positions, vocabulary {info['vocab_size']}")
    if causal:
        print(f"decoding state {fixed:,} bytes fixed + {per_token:,.0f} bytes per token of context"
              f" (batch 1, fp32{'; constant in context length' if per_token == 0 else ''})")
        for layer in info["state_by_layer"]:
            print(f"  layer {layer['layer']:<8}{layer['attention']}: {layer['fixed_bytes']:,} bytes fixed"
                  + (f" + {layer['bytes_per_token']:,.0f} per token" if layer["bytes_per_token"] else ""))
    else:
        print(f"task           {cfg.task}" + (" (a converted transformers model)" if cfg.task == "lm" else ""))
    for n, (i, zs) in enumerate(info.get("spans", {}).items()):
        print(f"{'learned spans' if n == 0 else '':<15}layer {i}: {', '.join(f'{z:g}' for z in zs)} tokens")
    if args.mechanisms:
        print(mechanism_table())
    elif not args.checkpoint:
        print("mechanisms     " + ", ".join(mechanisms()) + " (--mechanisms: their options)")
    return 0


def cmd_demo(args) -> int:
    from memattn.demo import run_demo

    run_demo(args.config, args.overrides, mechanisms=args.attention, out_dir=args.out_dir,
             warm_steps=args.warm_steps, contexts=tuple(sorted(set(args.contexts))), overwrite=args.overwrite)
    return 0


def cmd_experiment(args) -> int:
    from memattn.experiments import get_experiment
    from memattn.experiments._common import running
    from memattn.fileio import output_lock

    module = get_experiment(args.name)
    out_dir = Path(args.out_dir or f"results/{args.name}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out-dir: {out_dir} is a file; give a folder for the results")
    if args.quick and holds_full_results(out_dir):
        raise ConfigError(f"--quick: {out_dir} holds the full results of experiment {args.name} (results.json); "
                          f"a quick run would write over them; give it a folder of its own with --out-dir "
                          f"(e.g. --out-dir runs/{args.name}-quick)")
    created = not out_dir.exists()
    with output_lock(out_dir, "--out-dir", ConfigError), running(args.command_line):
        try:
            module.run(out_dir, quick=args.quick, overrides=args.overrides, jobs=args.jobs)
        except MemattnError:  # refused before any result: no folder of its own left behind
            if created and out_dir.is_dir() and not any(out_dir.iterdir()):
                out_dir.rmdir()
            raise
    return 0


def holds_full_results(out_dir: Path) -> bool:
    """Whether `out_dir` holds an experiment's results from a full run (results.json without
    "quick": true, or one that cannot be read): what a --quick run must not write over."""
    path = out_dir / "results.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("quick") is not True
    except (OSError, ValueError, AttributeError):
        return True


def new_folder(path: str, reads: dict | None = None) -> Path:
    """The `-o` folder of a command that writes a model: new or empty, not a file, not what
    the command reads (`reads`: what names each -> its path), else ConfigError."""
    from memattn.fileio import check_not_an_input

    out = Path(path)
    check_not_an_input(out, reads or {}, "-o", ConfigError)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"-o: {out} is a file; give a new (or empty) folder")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"-o: {out} is not empty; choose a new folder")
    return out


@contextlib.contextmanager
def new_output_folder(path: str, reads: dict | None = None):
    """Write the `-o` folder `path` of a command: checked (`new_folder`), held against other
    memattn processes writing it at the same time (the second is refused), and written whole
    or not at all (`memattn.fileio.atomic_folder`). Yields the folder to write into."""
    from memattn.fileio import atomic_folder, output_lock

    out = new_folder(path, reads)
    with output_lock(out, "-o", ConfigError):
        new_folder(path, reads)  # again, now that no other memattn process can write it
        with atomic_folder(out) as work:
            yield work


def cmd_export_hf(args) -> int:
    try:
        from memattn.integrations.export import export_run
    except ImportError as e:
        raise ConfigError(str(e)) from None

    with new_output_folder(args.out, {"the run": args.run}) as work:
        auto = export_run(args.run, work)
    print(f"memattn export-hf: wrote {args.out} (config.json, model.safetensors, the tokenizer, a model card); "
          f"load it with AutoTokenizer and {auto}.from_pretrained after `import memattn.integrations.hf` "
          "(or with trust_remote_code=True)", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from memattn.typed import parse_key_value

    try:
        from memattn.integrations.convert import convert_pretrained
    except ImportError as e:
        raise ConfigError(str(e)) from None
    options = {}
    for text in args.overrides:
        path, value = parse_key_value(text)
        if len(path) != 2 or path[0] != "attention":
            raise ConfigError(f"{text}: expected attention.OPTION=VALUE (an option of {args.attention!r})")
        options[path[1]] = value
    layers = None
    if args.layers:
        try:
            layers = [int(i) for i in args.layers.split(",")]
        except ValueError:
            raise ConfigError(f"--layers: expected layer numbers like 0,2,5, got {args.layers!r}") from None
    with new_output_folder(args.out, {"the model": args.model}) as work:
        had_tokenizer = convert_pretrained(args.model, args.attention, options, layers, work)
    kept = ("with its tokenizer" if had_tokenizer
            else "without a tokenizer (the source has none; give data.tokenizer= to train it)")
    print(f"memattn convert: wrote {args.out} {kept}; load it with transformers' Auto classes after "
          "`import memattn.integrations.hf` (or with trust_remote_code=True), or train on with "
          f"`memattn train train.init_from={args.out}`", file=sys.stderr)
    return 0


def cmd_compress(args) -> int:
    from memattn.data import Vocab
    from memattn.models.compressor import compress_ids, fingerprint, load_compressor, save_compressed

    source = Path(args.input)
    with output_file(args.out, "-o", {"the input text": source, "the checkpoint": args.checkpoint}) as out:
        model, meta = load_compressor(args.checkpoint)
        vocab = Vocab.from_json(meta["vocab"])
        text = read_text_input(source, "input")
        note_unknown(vocab, text, f"{source}", "memattn compress")
        seq_len = args.seq_len or int(meta["seq_len"])
        memory, lengths = compress_ids(model, vocab.encode(text), seq_len=seq_len, batch_size=args.batch_size)
        if args.half:
            memory = memory.half()
        save_compressed(out, memory, lengths, model_fingerprint=fingerprint(model), seq_len=seq_len,
                        characters=len(text), tokens=int(lengths.sum()), num_memory=model.num_memory,
                        d_model=model.cfg.d_model)
    stored = memory.numel() * memory.element_size()
    print(f"{len(text):,} characters -> {memory.shape[0]} sequences x {memory.shape[1]} vectors x "
          f"{memory.shape[2]} ({stored:,} bytes of {str(memory.dtype).replace('torch.', '')}) in {args.out}"
          f" (sequences of {seq_len} tokens)")
    return 0


def note_unknown(vocab, text: str, where: str, command: str) -> None:
    """Say (stderr) which characters of `text` a character vocabulary lacks and so reads as its
    unknown symbol, how many; ConfigError when it has no unknown symbol for them."""
    if getattr(vocab, "kind", None) != "char":
        return
    from collections import Counter

    known = set(vocab.symbols) - ({vocab.symbols[vocab.unk_id]} if vocab.unk_id is not None else set())
    counts = Counter(c for c in text if c not in known)
    if not counts:
        return
    shown = "".join(c for c, _ in counts.most_common(20))
    if vocab.unk_id is None:
        raise ConfigError(f"{where}: characters not in the model's vocabulary: {shown!r}")
    n = sum(counts.values())
    print(f"{command}: note: {n:,} of the {len(text):,} characters of {where} ({100 * n / max(1, len(text)):.2g} %) "
          f"are not in the model's vocabulary and are read as its unknown symbol: {shown!r}", file=sys.stderr)


def cmd_decompress(args) -> int:
    from memattn.data import Vocab
    from memattn.errors import CheckpointError
    from memattn.models.compressor import (check_compressed, decompress_ids, fingerprint, load_compressed,
                                           load_compressor)

    reads = {"the compressed file": args.compressed, "the checkpoint": args.checkpoint}
    with output_file(args.out, "-o", reads) as out:
        compressed = load_compressed(args.compressed)
        model, meta = load_compressor(args.checkpoint)
        if compressed.meta.get("model") != fingerprint(model):
            raise CheckpointError(f"compressed file {args.compressed} was made by another model than "
                                  f"{args.checkpoint} (their fingerprints differ)")
        check_compressed(compressed, model, args.compressed)
        vocab = Vocab.from_json(meta["vocab"])
        ids = decompress_ids(model, compressed.memory, compressed.lengths, n_symbols=vocab.size,
                             batch_size=args.batch_size)
        text = vocab.decode(ids)
        if out is not None:
            atomic_write_text(out, text)
            print(f"{len(text):,} characters from {compressed.memory.shape[0]} sequences -> {out}",
                  file=sys.stderr)
        else:
            sys.stdout.write(text)
    return 0


def cmd_bench(args) -> int:
    import shlex

    import torch

    from memattn.bench import make_settings, run_benchmarks
    from memattn.bench.timing import reexec_tuned

    names, settings = make_settings(
        args.targets, attention=args.attention or [], device=args.device, dtype=args.dtype,
        quick=args.quick, out=args.out, repeats=args.repeats, warmup=args.warmup,
        threads=args.threads, command=args.command_line, progress=not args.quiet)
    from_command_line = sys.argv[1:] == shlex.split(args.command_line)[1:]
    if settings.device.type == "cpu" and from_command_line and not args.no_env_tuning:
        reexec_tuned([sys.executable, "-m", "memattn", *sys.argv[1:]])  # returns when already tuned
    if args.threads:
        torch.set_num_threads(args.threads)
    from memattn.fileio import check_writable, output_lock

    out = settings.out_dir
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file; give a folder for the results")
    check_writable(out)  # a folder that cannot be written fails now, not after the runs
    start = time.perf_counter()
    with output_lock(out, "--out", ConfigError):
        written = run_benchmarks(names, settings)
    for name, paths in written.items():
        print(f"{name}: " + ", ".join(str(p) for p in paths))
    print(f"[{len(names)} benchmark(s) in {time.perf_counter() - start:.0f} s on {settings.device}, "
          f"{args.dtype}, {torch.get_num_threads()} threads]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="memattn", description=(
        "Attention over a memory: train, evaluate and sample language models whose attention "
        "is any registered mechanism (see `memattn info`)."))
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error instead of its one line (also MEMATTN_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(sp, default="demo"):
        sp.add_argument("--config", default=default,
                        help=f"preset name in configs/ or a YAML file (default: {default})")
        sp.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)

    t = sub.add_parser("train", help="train a causal LM or a translation model (under torchrun: data-parallel)",
                       description="Train a causal LM (or, with task=translation / --config translation, "
                       "an encoder-decoder on parallel data) from a preset and overrides. Writes "
                       "checkpoint.safetensors, log.jsonl, config.yaml and summary.json to "
                       "train.out_dir. Data-parallel with `torchrun --nproc_per_node=N -m memattn train ...`.")
    with_config(t)
    t.add_argument("--resume", action="store_true",
                   help="continue from train.out_dir/checkpoint.safetensors (same losses as an uninterrupted run)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the run in train.out_dir (without it, or --resume, an existing run is refused)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="bits per character and perplexity of a checkpoint",
                       description="Evaluate a checkpoint on a split of its corpus.")
    e.add_argument("checkpoint", help="checkpoint file or run folder")
    e.add_argument("--split", choices=("train", "val", "test"), default="test",
                   help="which split of the corpus (default: %(default)s)")
    e.add_argument("--seq-len", type=positive_int, help="window length (default: the training seq_len)")
    e.add_argument("--batch-size", type=positive_int, default=16, help="windows per forward pass")
    e.add_argument("--batches", type=non_negative_int, default=0,
                   help="evaluate only the first N batches (default: all)")
    e.add_argument("--context", type=int_at_least(0, "a number of tokens"), default=0,
                   help="tokens read before each scored segment but not scored (default: 0)")
    e.add_argument("--stream", action="store_true",
                   help="read the split as --batch-size contiguous streams in one pass, each layer's "
                   "fixed-size state carried from segment to segment (bounded mechanisms only)")
    e.add_argument("--beam", type=int_at_least(1, "a beam"), default=5,
                   help="translation runs: beam size (1: greedy)")
    e.add_argument("--length-penalty", type=float_at_least(0), default=0.6,
                   help="translation runs: GNMT length penalty alpha (default: %(default)s)")
    e.add_argument("--lengths", metavar="N,N,...",
                   help="quality by length: read documents of the longest N tokens and report bits per "
                   "character by position ([0, seq_len), then doubling) and over the first N tokens of "
                   "each; bounded mechanisms stream through their fixed state, others read one window "
                   "(language models only; e.g. 512,2048,8192,32768)")
    e.add_argument("--streams", type=positive_int, help="with --lengths: documents read (default: 1)")
    e.add_argument("--chunk", type=positive_int,
                   help="with --lengths: tokens per call of a streamed read (default: the training seq_len)")
    e.add_argument("--max-window", type=positive_int,
                   help="with --lengths: longest window a growing-state model (softmax) reads; longer "
                   "lengths are reported as not read (default: 16384)")
    e.add_argument("--plot", metavar="FILE.png", help="with --lengths: plot bits per character against position")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.add_argument("--device", default="cpu", help="torch device to run on")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)

    tr = sub.add_parser("translate", help="translate a file of sentences with a translation run",
                        description="Translate each line of --input (batched greedy or beam search "
                        "through the decoder's cache; bounded memories stay fixed in size).")
    tr.add_argument("run", help="checkpoint file or run folder of a translation run")
    tr.add_argument("--input", required=True, help="text file, one source sentence a line")
    tr.add_argument("--output", help="write the translations here (default: standard output)")
    tr.add_argument("--beam", type=int_at_least(1, "a beam"), default=5,
                    help="beam size (1: greedy; default: %(default)s)")
    tr.add_argument("--length-penalty", type=float_at_least(0), default=0.6,
                    help="GNMT length penalty alpha, ((5 + length) / 6) ** alpha (default: %(default)s)")
    tr.add_argument("--max-len", type=positive_int,
                    help="longest output in tokens (default: twice the longest source of its batch plus 10, "
                    "at most model.max_len - 1)")
    tr.add_argument("--batch-size", type=positive_int, default=32, help="sentences decoded together")
    tr.add_argument("--device", default="cpu", help="torch device to run on")
    tr.set_defaults(fn=cmd_translate)

    g = sub.add_parser("generate", help="stream a sample from a checkpoint",
                       description="Continue a prompt, streaming characters as they are sampled; "
                       "the prompt is read once into each layer's decoding state.")
    g.add_argument("checkpoint", help="checkpoint file or run folder")
    g.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    g.add_argument("--tokens", type=int_at_least(0, "a number of tokens"), default=500, help="tokens to generate")
    g.add_argument("--temperature", type=float_at_least(0, note=" (0: greedy)"), default=0.8, help="0 for greedy")
    g.add_argument("--top-k", type=int_at_least(0, "k", " (0: sample from all)"), default=0,
                   help="sample among the k likeliest (0: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--compile", action="store_true",
                   help="decode through torch.compile (compiles first: tens of seconds on a CPU)")
    g.add_argument("--device", default="cpu", help="torch device to run on")
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("info", help="parameters and decoding-state memory of a model",
                       description="Describe a checkpoint, or a model built from a config: "
                       "parameters, shape and the memory its decoding state holds per token.")
    i.add_argument("--checkpoint", help="checkpoint file or run folder (default: build from --config); "
                   "`memattn info RUN` also names one")
    with_config(i)
    i.add_argument("--mechanisms", action="store_true", help="also list the registered mechanisms")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(fn=cmd_info)

    d = sub.add_parser("demo", help="the main job: prepare the corpus, train, evaluate, generate, compare",
                       description="Prepare the default corpus, train softmax attention, start each "
                       "other mechanism from it (train.init_from) and train it on, evaluate every "
                       "model on the test split, generate a sample, and compare quality, speed and "
                       "the decoding cost and state at growing contexts (a table and a plot).")
    with_config(d)
    d.add_argument("--attention", nargs="+", default=["softmax", "gsa"],
                   help="mechanisms to compare, the baseline first (default: %(default)s)")
    d.add_argument("--warm-steps", type=int_at_least(0, "a number of steps"), default=200,
                   help="steps each other mechanism trains after starting from the baseline; 0: "
                   "train it from scratch with the baseline's budget (default: %(default)s)")
    d.add_argument("--contexts", type=int_at_least(1, "a context length"), nargs="+",
                   default=[256, 1024, 4096, 16384],
                   help="context lengths at which decoding cost and state are measured (default: %(default)s)")
    d.add_argument("--out-dir", default="runs/demo", help="where runs and summary.json go (default: %(default)s)")
    d.add_argument("--overwrite", action="store_true",
                   help="replace an earlier demo in --out-dir (without it, such a folder is refused)")
    d.set_defaults(fn=cmd_demo)

    x = sub.add_parser("experiment", help="reproduce a paper's experiment, small",
                       description="Run one of the papers' experiments and write its results "
                       "table under results/NAME/ (with the command that made it). "
                       "Experiments: " + _experiment_list())
    x.add_argument("name", help="which experiment")
    x.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    x.add_argument("--out-dir", help="where results go (default: results/NAME)")
    x.add_argument("--quick", action="store_true", help="a small smoke run, about a minute on a CPU")
    x.add_argument("--jobs", type=int_at_least(1, "a number of models at once"), default=1,
                   help="models trained at once, one thread each (experiments that train models "
                   "in run folders: abc-lm, persistent-lm); running the command again continues "
                   "unfinished models and reuses finished ones")
    x.set_defaults(fn=cmd_experiment)

    h = sub.add_parser("export-hf", help="write a run as a Hugging Face transformers folder",
                       description="Write a trained causal LM or masked-LM encoder (or a trained "
                       "converted model) as a transformers model folder (config.json, model.safetensors, "
                       "the run's vocabulary as a tokenizer, a model card), with its own model type, the "
                       "context length trained at and a bos/eos token: loadable with AutoTokenizer and "
                       "AutoModelForCausalLM / AutoModelForMaskedLM.from_pretrained once "
                       "`memattn.integrations.hf` is imported or with trust_remote_code=True "
                       "(pipelines, PEFT, lm-evaluation-harness), and usable as train.init_from. "
                       "Needs memattn[hf].")
    h.add_argument("run", help="run folder or checkpoint written by `memattn train`")
    h.add_argument("-o", "--out", required=True, help="folder to write (new or empty)")
    h.set_defaults(fn=cmd_export_hf)

    cv = sub.add_parser("convert", help="replace a pretrained transformers model's attention by a mechanism",
                        description="Load a Hugging Face model folder (Llama, Mistral, Qwen2/3, GPT-2, "
                        "BERT, RoBERTa), replace its self-attention by a memattn mechanism (q/k/v/o "
                        "weights copied, everything else untouched, the mechanism's own parameters "
                        "new) and save it with its own model type (memattn-llama, ...), loadable with "
                        "transformers' Auto classes once `memattn.integrations.hf` is imported or with "
                        "trust_remote_code=True. A folder memattn wrote already is refused (convert the "
                        "original). Needs memattn[hf].")
    cv.add_argument("model", help="a transformers model folder (or hub name, where a network is there)")
    cv.add_argument("--attention", required=True, help="the mechanism (memattn info --mechanisms)")
    cv.add_argument("overrides", nargs="*", metavar="attention.OPTION=VALUE",
                    help="options of the mechanism, e.g. attention.num_slots=32")
    cv.add_argument("--layers", default="", help="comma-separated layer numbers to convert (default: all)")
    cv.add_argument("-o", "--out", required=True, help="folder to write (new or empty)")
    cv.set_defaults(fn=cmd_convert)

    c = sub.add_parser("compress", help="compress a text into M memory vectors per sequence",
                       description="Cut a text into sequences, compress each into the M memory "
                       "vectors of a compressor checkpoint (GMAT sequence compression) and write "
                       "them as one safetensors file. `memattn decompress` rebuilds the text from "
                       "that file and the checkpoint alone.")
    c.add_argument("checkpoint", help="compressor checkpoint (e.g. from `memattn experiment gmat-mlm`)")
    c.add_argument("input", help="UTF-8 text file to compress")
    c.add_argument("-o", "--out", required=True, help="compressed file to write (.safetensors)")
    c.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the training length)")
    c.add_argument("--half", action="store_true", help="store the vectors in float16 (half the bytes)")
    c.add_argument("--batch-size", type=positive_int, default=16, help="sequences per forward pass")
    c.set_defaults(fn=cmd_compress)

    dc = sub.add_parser("decompress", help="rebuild a text from its compressed memory vectors",
                        description="Read a file written by `memattn compress` and rebuild every "
                        "position of every sequence from its M memory vectors (the original text "
                        "is not needed), with the compressor checkpoint that made it.")
    dc.add_argument("compressed", help="file written by `memattn compress`")
    dc.add_argument("--checkpoint", required=True, help="the compressor checkpoint that made the file")
    dc.add_argument("-o", "--out", help="text file to write (default: standard output)")
    dc.add_argument("--batch-size", type=positive_int, default=16, help="sequences per forward pass")
    dc.set_defaults(fn=cmd_decompress)

    b = sub.add_parser("bench", help="measure every mechanism against softmax: decode, encode, train, lookup",
                       description="Measure every registered attention mechanism side by side against "
                       "softmax attention in one run, and write BENCHMARK.json, BENCHMARK.md (every "
                       "figure with its ratio to softmax) and BENCHMARK.png under --out. decode: per-token "
                       "latency and decoding-state bytes against context; encode: time and peak memory "
                       "to encode a batch; train: forward+backward tokens/s against length (a layer, a "
                       "small LM, the ABC op and its flash-linear-attention peer); lookup: per-query "
                       "cost of linear attention's stored C against softmax over the stored states. "
                       "Sizes are presets for the device (and --quick); change them with "
                       "SECTION.FIELD=VALUE, e.g. decode.contexts=[256,4096] decode.batch=8 lm.d_model=256 "
                       "(sections: lm, decode, encode, train, lookup).")
    b.add_argument("targets", nargs="*", metavar="BENCHMARK|KEY=VALUE",
                   help="decode, encode, train, lookup or all (default: all), and SECTION.FIELD=VALUE "
                   "size overrides")
    b.add_argument("--quick", action="store_true",
                   help="small sizes: all four benchmarks in under 2 minutes on a CPU")
    b.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    b.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="dtype of the models and inputs (default: %(default)s)")
    b.add_argument("--attention", nargs="+", metavar="NAME[:OPTION=VALUE,...]",
                   help="mechanisms to measure, at their default options or those given (e.g. "
                   "abc-meanpool:pool=512); default: every registered one. Softmax always runs as the baseline")
    b.add_argument("--out", help="output folder (default: benchmarks/results/DEVICE, or "
                   "benchmarks/results/DEVICE/quick with --quick; DEVICE is cpu or the GPU's name)")
    b.add_argument("--repeats", type=positive_int, help="timed calls per configuration, the median reported "
                   "(default: 5, 3 with --quick; decode times decode.steps greedy steps instead)")
    b.add_argument("--warmup", type=non_negative_int, help="untimed calls (decode: steps) before timing (default: 1)")
    b.add_argument("--threads", type=non_negative_int, default=0, help="torch threads on CPU (default: torch's choice)")
    b.add_argument("--no-env-tuning", action="store_true",
                   help="on CPU, do not re-run with OMP_WAIT_POLICY=PASSIVE and the glibc malloc settings "
                   "of memattn.bench.timing.ENV (measure the environment as it is)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(fn=cmd_bench)
    for command in sub.choices.values():  # the global flag, also accepted after the command's name
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error instead of its one line")
    return p


def _experiment_list() -> str:
    from memattn.experiments import experiments

    return "; ".join(f"{name}: {m.DESCRIPTION}" for name, m in experiments().items()) or "none yet"


def edge_message(e: BaseException) -> str | None:
    """The one line a command prints for an error that reached its edge: what memattn raises on
    purpose, and what the file system, safetensors, JSON and text decoding, torch.distributed
    and the allocator raise (naming the file or option and what to do); None for anything else
    (a bug: its traceback is shown)."""
    import json as _json

    from safetensors import SafetensorError

    from memattn.fileio import describe_os_error

    if isinstance(e, MemattnError):
        return str(e)
    if isinstance(e, OSError):
        return describe_os_error(e)
    if isinstance(e, SafetensorError):
        return f"a safetensors file could not be read or written ({e}); check the file and the disk"
    if isinstance(e, _json.JSONDecodeError):
        return (f"a file is not valid JSON ({e}; near {e.doc[max(0, e.pos - 20):e.pos + 20]!r}); it was cut "
                "short or edited: restore or remove it")
    if isinstance(e, UnicodeDecodeError):
        return (f"a file is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8, "
                "e.g. iconv -f latin1 -t utf-8")
    import torch

    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return (f"torch.distributed: {e}; check that every process of the run is alive and can reach "
                "the others (torchrun's MASTER_ADDR / MASTER_PORT)")
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))):
        return (f"not enough memory ({e or type(e).__name__}); use smaller sizes (model, --batch-size, "
                "context) or a machine with more memory")
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit status. A bad command line or input, a full or
    read-only disk, a broken file: one line on stderr and status 2 (--debug or MEMATTN_DEBUG=1:
    the traceback instead)."""
    import shlex

    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("MEMATTN_DEBUG", "") not in ("", "0")
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # key=value overrides may also come after the flags (`experiment NAME --quick steps=10`)
        if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except UsageError as e:
        if debug:
            raise
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return 2
    args.command_line = shlex.join(["memattn", *argv])
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print(f"memattn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`memattn info | head -2`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 141
    except Exception as e:  # noqa: BLE001 (the command's edge: one line, or the traceback)
        message = edge_message(e)
        if message is None or debug:
            raise
        print(f"memattn {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
