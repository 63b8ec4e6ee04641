"""``voloco generate --checkpoint DIR``: sample text from a peer's checkpoint, to see what the swarm
has learned.

The model is peer/training/model.py's, loaded as ``voloco export`` reads it (voloco/export.py ``load_run``),
on the CPU. Tokens are utf-8 bytes (peer/training/data.py), or a ``tokenizer.json`` beside the checkpoint
(a run with a trained tokenizer saves it there). Sampling: temperature, then the ``top_k`` most
likely tokens, from a generator seeded by ``--seed`` (the same output for the same seed on the same
machine); ``--temperature 0`` is greedy. The context is cut to the model's ``seq_len`` last tokens.

Only a checkpoint for now: downloading a live peer's state needs a DHT node and the swarm's
membership view (peer/round/state_sync.py); a volunteer's own peer writes checkpoints with
``--checkpoint-dir``, and that is what this reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from peer.training.data import decode as decode_bytes
from swarm.console import UsageError
from voloco.export import LoadedRun, add_spec_argument, load_run

HELP = "sample text from a peer's checkpoint (see what the swarm has learned)"

__all__ = ["HELP", "add_arguments", "run_generate", "sample", "tokenizer_for"]

Encode = Callable[[str], List[int]]
Decode = Callable[[List[int]], str]


def tokenizer_for(run: LoadedRun) -> Tuple[Encode, Decode]:
    """(encode, decode) of the run: its tokenizer.json if the checkpoint directory has one, else bytes."""
    path = run.tokenizer_file
    if path is None:
        return (lambda text: list(text.encode("utf-8"))), decode_bytes
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception types
        raise UsageError(f"cannot read {path}: {e}") from None
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), (lambda ids: tok.decode(ids))


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt: List[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    seed: int = 0,
) -> List[int]:
    """The ``max_new_tokens`` token ids sampled after ``prompt`` (at least one id)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    seq_len, vocab = model.spec.seq_len, model.spec.vocab_size
    ids = torch.tensor([prompt], dtype=torch.int64)
    out: List[int] = []
    for _ in range(max_new_tokens):
        logits, _ = model(ids[:, -seq_len:])
        logits = logits[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < vocab:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], dtype=torch.int64)], dim=1)
    return out


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", type=Path, metavar="DIR", required=True,
        help="a peer's --checkpoint-dir (holds checkpoint.safetensors); sampling from a live peer over"
        " --join is not supported yet: run a peer with --checkpoint-dir and point this at it",
    )
    parser.add_argument(
        "--prompt", default="", metavar="TEXT",
        help="text the sample continues (default: empty, which starts from a newline)",
    )
    parser.add_argument(
        "--max-new-tokens", type=_positive_int, default=200, metavar="N",
        help="tokens to sample after the prompt (bytes for a byte-level run; default: 200)",
    )
    parser.add_argument(
        "--temperature", type=_non_negative_float, default=0.8, metavar="T",
        help="divides the logits before sampling: lower is more conservative, 0 always takes the most likely token (default: 0.8)",
    )
    parser.add_argument(
        "--top-k", type=_positive_int, default=None, metavar="K",
        help="sample only among the K most likely tokens (default: all tokens)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S",
        help="seed of the sampler: the same seed gives the same text (default: 0)",
    )
    add_spec_argument(parser)


def run_generate(args: argparse.Namespace) -> int:
    run = load_run(args.checkpoint, args.spec)
    encode, decode = tokenizer_for(run)
    prompt_ids = encode(args.prompt) if args.prompt else encode("\n")
    if not prompt_ids:  # a tokenizer that drops a lone newline
        raise UsageError("the prompt encodes to no tokens: pass --prompt TEXT")
    if max(prompt_ids) >= run.spec.model.vocab_size:
        raise UsageError(f"the prompt has token ids >= model.vocab_size ({run.spec.model.vocab_size})")
    new = sample(run.model(), prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    text = decode(new)
    sys.stdout.write((args.prompt + text) if args.prompt else text)
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[round {run.meta['round']} of run {run.spec.run_id!r}, {len(new)} new tokens]", file=sys.stderr)
    return 0
