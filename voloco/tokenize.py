"""``voloco tokenize INPUT OUT_DIR``: a corpus as pre-tokenized shards that peers memory-map.

INPUT is anything a run's ``data.corpus`` can be (a text, .jsonl or .parquet file, a directory of
them, or ``stdlib``); it is split into training and validation text as a peer splits it, encoded
with the run's tokenizer (``--tokenizer tokenizer.json``, a new BPE one with ``--vocab-size N``,
else bytes), and written as ``OUT_DIR/{train,val}-NNNNN.bin`` plus ``OUT_DIR/meta.json``, which names
the tokenizer's sha256 (a peer refuses shards made with another tokenizer than its run's). A BPE
tokenizer is copied to ``OUT_DIR/tokenizer.json``: give it to the coordinator with ``--tokenizer``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from swarm.console import UsageError

HELP = "pre-tokenize a corpus into memory-mapped shards (train/val .bin + meta.json) for data.corpus"


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("input", help="a text, .jsonl or .parquet file, a directory of them, or 'stdlib'")
    c.add_argument("out_dir", type=Path, help="directory for the shards and meta.json (created)")
    how = c.add_mutually_exclusive_group()
    how.add_argument("--tokenizer", type=Path, metavar="PATH", help="encode with this tokenizer.json (the run's)")
    how.add_argument("--vocab-size", type=int, metavar="N", help="train a byte-level BPE tokenizer of N tokens on the input "
                     "(with neither this nor --tokenizer: the byte-level tokenizer, 256 tokens)")
    c.add_argument("--text-field", default="text", help="the text field of .jsonl records / column of .parquet (default: text)")
    c.add_argument("--val-fraction", type=float, default=0.1, help="held-out fraction, as data.val_fraction (default: 0.1)")
    c.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of text (default: 40 MiB)")


def run_tokenize(args: argparse.Namespace) -> int:
    from peer.training.data import DEFAULT_MAX_BYTES, DataError, load_corpus
    from peer.training.data_formats import dtype_for, write_tokens
    from peer.training.tokenizer import BYTES, load_tokenizer, train_bpe

    t0 = time.monotonic()
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise UsageError(f"out_dir {str(args.out_dir)!r} is a file, not a directory")
    if not 0 < args.val_fraction < 1:
        raise UsageError(f"--val-fraction must lie in (0, 1), got {args.val_fraction:g}")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise UsageError("--max-bytes must be a positive number of bytes")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        raise UsageError(f"--tokenizer {str(args.tokenizer)!r} does not exist")
    try:
        corpus = load_corpus(args.input, args.val_fraction, args.max_bytes or DEFAULT_MAX_BYTES, text_field=args.text_field)
        if corpus.split == "shards":
            raise DataError(f"{args.input} is already pre-tokenized")
        if args.tokenizer is not None:
            try:
                raw = args.tokenizer.read_bytes()
            except OSError as e:
                raise UsageError(f"--tokenizer {str(args.tokenizer)!r}: {e.strerror or e}") from None
            tok = load_tokenizer(raw, source=str(args.tokenizer))
        elif args.vocab_size is not None:
            tok = load_tokenizer(train_bpe(corpus.train.numpy().tobytes(), args.vocab_size))
        else:
            tok = BYTES
        val_bytes = len(corpus.val)
        splits = {"train": tok.encode_bytes(corpus.train.numpy().tobytes()), "val": tok.encode_bytes(corpus.val.numpy().tobytes())}
        meta = write_tokens(args.out_dir, splits, {
            "dtype": dtype_for(tok.vocab_size), "tokenizer": tok.kind, "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size, "val_bytes": val_bytes, "train_bytes": len(corpus.train),
            "source": corpus.source, "corpus_digest": corpus.digest(), "text_field": args.text_field,
        })
        if tok.raw is not None:
            (args.out_dir / "tokenizer.json").write_bytes(tok.raw)
    except DataError as e:
        raise UsageError(str(e)) from None
    tokens = {name: sum(s["tokens"] for s in meta[name]) for name in ("train", "val")}
    print(f"wrote {tokens['train']} training and {tokens['val']} validation {tok.kind} tokens ({meta['dtype']}, "
          f"{val_bytes / max(1, tokens['val']):.2f} bytes/token) to {args.out_dir} in {time.monotonic() - t0:.1f} s")
    if tok.raw is not None:
        print(f"tokenizer: {args.out_dir / 'tokenizer.json'} (sha256 {tok.sha256}, {tok.vocab_size} tokens)")
        print(f"run spec: [data] corpus = \"{args.out_dir}\", tokenizer = \"bpe\"; [model] vocab_size = {tok.vocab_size}; "
              f"coordinator --tokenizer {args.out_dir / 'tokenizer.json'}")
    return 0
