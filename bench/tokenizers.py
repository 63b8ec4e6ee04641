"""Bytes against byte-level BPE on the default corpus: validation loss per byte at equal bytes.

    python bench/tokenizers.py [--steps N] [--vocab 1024,4096] [--threads T] [--json OUT]

One process, plain AdamW (peer/round/simulate.py ``train_single``, the spec's inner schedule with its
horizon set to the run), the same small model shape in every arm (d 128, 4 layers, 4 heads,
ffn 352; only the embedding and head grow with the vocabulary), the same seed, batch size and
number of steps. Each arm sees the same bytes of text: the bytes arm trains on sequences of
``--bytes-seq`` (256) tokens = bytes, a BPE arm on sequences of ``round(256 / bytes_per_token)``
tokens, so a step covers about the same text and the same context in bytes. The BPE tokenizers
are trained on the corpus's training split exactly as a coordinator trains one
(peer/training/tokenizer.py ``train_bpe``); bytes per token is measured on the validation split, and the
validation loss per byte is the loss per token divided by it. No goal: a table to compare.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# run as a script, this file's directory comes first on sys.path and its name would hide the
# `tokenizers` package: drop it, and put the repository root there instead
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import machine, now, table  # noqa: E402
from peer.training.data import load_corpus  # noqa: E402
from peer.round.simulate import train_single  # noqa: E402
from peer.training.tokenizer import BYTES, load_tokenizer, tokenize_corpus, train_bpe  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from swarm.jsonout import write as write_json  # noqa: E402


def arm(name: str, text, tok, args) -> dict:
    t0 = time.monotonic()
    corpus = tokenize_corpus(text, tok, tok.vocab_size)
    t_tok = time.monotonic() - t0
    bpt = corpus.bytes_per_token
    seq_len = max(8, round(args.bytes_seq / bpt))
    spec = RunSpec().replace(
        seed=args.seed,
        model={"vocab_size": tok.vocab_size, "seq_len": seq_len},
        data={"batch_size": args.batch, "val_batches": args.val_batches,
              **({"tokenizer": "bpe", "tokenizer_sha256": tok.sha256} if tok.kind == "bpe" else {})},
        inner={"total_steps": args.steps, "warmup_steps": min(30, args.steps // 10)},
    )
    result = train_single(spec, args.steps, corpus=corpus)
    per_token = result.final_val_loss
    row = {
        "arm": name, "tokenizer": tok.kind, "vocab_size": tok.vocab_size, "tokenizer_sha256": tok.sha256,
        "bytes_per_token": bpt, "seq_len_tokens": seq_len, "seq_len_bytes": seq_len * bpt,
        "steps": args.steps, "batch_size": args.batch, "train_tokens": result.tokens, "train_bytes": result.tokens * bpt,
        "num_params": spec.model.num_params(),
        "initial_val_loss_per_byte": corpus.per_byte(result.initial_val_loss),
        "val_loss_per_token": per_token, "val_loss_per_byte": corpus.per_byte(per_token),
        "tokenize_s": t_tok, "train_s": result.wall_s,
    }
    print(f"  {name}: {row['val_loss_per_byte']:.4f} nats/byte ({per_token:.4f} nats/token, {bpt:.2f} bytes/token) "
          f"in {result.wall_s:.0f} s", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--bytes-seq", type=int, default=256, help="sequence length of the bytes arm (= bytes per sequence)")
    p.add_argument("--vocab", default="1024,4096", help="BPE vocabulary sizes, comma-separated")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the rows as strict JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    text = load_corpus("stdlib")
    print(f"{machine()}, {args.threads} thread(s); corpus {text}", flush=True)
    rows = [arm("bytes", text, BYTES, args)]
    for vocab in [int(v) for v in args.vocab.split(",") if v]:
        t = time.monotonic()
        tok = load_tokenizer(train_bpe(text.train.numpy().tobytes(), vocab))
        print(f"  trained BPE {vocab} in {time.monotonic() - t:.1f} s (sha256 {tok.sha256[:16]})", flush=True)
        rows.append(arm(f"bpe-{vocab}", text, tok, args))
    base = rows[0]["val_loss_per_byte"]
    cols = ["arm", "vocab", "bytes/tok", "seq tok", "params", "train MB", "val/byte", "val/token", "vs bytes", "train s"]
    lines = [[r["arm"], str(r["vocab_size"]), f"{r['bytes_per_token']:.2f}", str(r["seq_len_tokens"]),
              f"{r['num_params'] / 1e6:.2f}M", f"{r['train_bytes'] / 1e6:.2f}", f"{r['val_loss_per_byte']:.4f}",
              f"{r['val_loss_per_token']:.4f}", f"{r['val_loss_per_byte'] / base:.3f}", f"{r['train_s']:.0f}"] for r in rows]
    print(table(cols, lines))
    print(f"total {time.monotonic() - t0:.0f} s")
    if args.json:
        write_json(args.json, {"bench": "tokenizers", "when": now(), "machine": machine(), "threads": args.threads,
                               "corpus": repr(text), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                   indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
