"""`memattn compress` and `memattn decompress`: a text as M memory vectors per sequence (GMAT
sequence compression), and back."""

from __future__ import annotations

import sys
from pathlib import Path

from memattn.cli.common import output_file, positive_int, read_text_input
from memattn.errors import ConfigError
from memattn.fileio import atomic_write_text


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


def add_commands(sub) -> None:
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
