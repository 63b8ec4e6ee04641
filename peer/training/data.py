"""Corpus, byte tokenizer and the per-peer training stream.

By default tokens are utf-8 bytes (vocabulary 256), so there is no tokenizer file to agree on; a run
may use a BPE tokenizer instead (peer/training/tokenizer.py), and the corpus then holds token ids. A corpus is
read once into two uint8 tensors: the training text and the validation text. Besides text files it
may hold ``.jsonl`` and ``.parquet`` files of documents, or be a pre-tokenized directory whose shards
are memory-mapped (peer/training/data_formats.py). Files go to one side
or the other by a hash of their path relative to the corpus root, so every machine that reads the
same files makes the same split; a single file is split by position instead.

Each peer draws its own stream of batches at random offsets of the training text, from a
generator seeded by (run seed, shard, batch number): a different stream per peer id, the same
stream again after a restart, and resuming needs only the batch counter.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple, Union

import numpy as np
import torch

from peer.training.data_formats import STRUCTURED, DataError, is_pretokenized, open_tokens, read_documents

__all__ = [
    "VOCAB_SIZE",
    "BYTE_VOCAB",
    "DEFAULT_MAX_BYTES",
    "DataError",
    "Corpus",
    "encode",
    "decode",
    "load_corpus",
    "TrainStream",
    "val_batches",
]

VOCAB_SIZE = BYTE_VOCAB = 256
DEFAULT_MAX_BYTES = 40 * 1024 * 1024
# directories of the standard library that are not library source, or differ between machines
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "lib-dynload", "test", "tests", "idle_test"}

Batch = Tuple[torch.Tensor, torch.Tensor]


# --- tokenizer ---------------------------------------------------------------------------------
def encode(text: str) -> torch.Tensor:
    """Text -> int64 tensor of its utf-8 bytes."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(ids) -> str:
    """Byte ids (tensor or sequence of ints) -> text; invalid utf-8 shows as U+FFFD."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return bytes(ids).decode("utf-8", errors="replace")


# --- corpus ------------------------------------------------------------------------------------
@dataclass
class Corpus:
    train: torch.Tensor  # uint8, the training text of every train file, concatenated
    val: torch.Tensor  # uint8, the held-out text
    source: str  # what was read: "stdlib:<dir>", or the path given
    train_files: int
    val_files: int
    split: str  # "file" (by a hash of each relative path) or "position" (the tail is held out)
    truncated: bool  # True when max_bytes stopped the reading before the end
    # what train and val hold: utf-8 bytes, or the ids of a BPE tokenizer (then torch int32 tensors,
    # or numpy arrays memory-mapped from pre-tokenized shards)
    tokenizer: str = "bytes"
    tokenizer_sha256: str = ""
    vocab_size: int = BYTE_VOCAB
    val_bytes: int = -1  # bytes of text the validation tokens stand for (-1: one byte per token)
    fingerprint: str = ""  # pre-tokenized: a digest of the sidecar (hashing every shard would take long)

    def digest(self) -> str:
        """A short fingerprint of the exact bytes: peers can check they read the same corpus."""
        if self.fingerprint:
            return self.fingerprint
        h = hashlib.sha256()
        for part in (self.train, self.val):
            h.update(len(part).to_bytes(8, "little"))
            h.update(np.asarray(part).tobytes())
        return h.hexdigest()[:16]

    @property
    def bytes_per_token(self) -> float:
        """Bytes of validation text per validation token: converts a loss per token to one per byte."""
        return self.val_bytes / len(self.val) if self.val_bytes > 0 and len(self.val) else 1.0

    def per_byte(self, loss_per_token: float) -> float:
        return loss_per_token / self.bytes_per_token

    def loss_report(self, val_loss_per_byte: float) -> Dict[str, object]:
        """Status fields that make runs with different tokenizers comparable."""
        return {"tokenizer": self.tokenizer, "tokenizer_sha256": self.tokenizer_sha256,
                "bytes_per_token": self.bytes_per_token, "val_loss_per_token": val_loss_per_byte * self.bytes_per_token}

    def __repr__(self) -> str:
        unit = "bytes" if self.tokenizer == "bytes" else f"{self.tokenizer} tokens"
        return (
            f"Corpus({self.source!r}, train={len(self.train)} {unit}/{self.train_files} files, "
            f"val={len(self.val)} {unit}/{self.val_files} files, split={self.split}, truncated={self.truncated}"
            + (f", {self.bytes_per_token:.2f} bytes/token" if self.tokenizer != "bytes" else "") + ")"
        )


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(
    source: Union[str, Path, None] = None,
    val_fraction: float = 0.1,
    max_bytes: int = DEFAULT_MAX_BYTES,
    text_field: str = "text",
) -> Corpus:
    """Read a corpus: None or "stdlib" (the standard library's .py sources), a text, ``.jsonl`` or
    ``.parquet`` file, a directory of such files (recursively; binaries and hidden entries are
    skipped), or a pre-tokenized directory (``voloco tokenize``: memory-mapped, not read).

    At most ``max_bytes`` are read, from files in sorted path order. A directory is split by file
    (``val_fraction`` of paths by hash); when that leaves one side empty, or for a single file, the
    last ``val_fraction`` of the bytes is held out instead. Raises DataError.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in (0, 1), got {val_fraction}: set data.val_fraction to e.g. 0.1")
    if max_bytes <= 0:
        raise DataError(f"max_bytes must be positive, got {max_bytes}")
    if source is None or (isinstance(source, str) and source == "stdlib"):
        root = stdlib_dir()
        if not root.is_dir():
            raise DataError(f"the standard library directory {root} is missing: pass --data PATH to a text corpus")
        files = _walk(root, stdlib=True)
        label = f"stdlib:{root}"
    else:
        path = Path(source).expanduser()
        label = str(source)
        if not path.exists():
            raise DataError(f"corpus path {path} does not exist: pass an existing text file or directory, or 'stdlib'")
        if is_pretokenized(path):
            return _pretokenized(path, label)
        if path.is_file():
            data, truncated = _read_any(path, max_bytes, text_field)
            if not data:
                raise DataError(f"corpus file {path} holds no utf-8 text: pass a non-empty text file")
            return _split_by_position(bytearray(data), val_fraction, label, 1, truncated)
        if not path.is_dir():
            raise DataError(f"corpus path {path} is neither a file nor a directory: pass a text file or directory")
        root, files = path, _walk(path, stdlib=False)

    train, val = bytearray(), bytearray()
    n_train = n_val = 0
    total, truncated = 0, False
    for rel in files:
        if total >= max_bytes:
            truncated = True
            break
        data, cut = _read_any(root / rel, max_bytes - total, text_field, skip_unreadable=label.startswith("stdlib:"))
        if not data:
            continue
        truncated |= cut
        total += len(data)
        if _held_out(rel, val_fraction):
            val += data
            n_val += 1
        else:
            train += data
            n_train += 1
    if not train and not val:
        what = "no .py files" if label.startswith("stdlib:") else "no utf-8 text files"
        raise DataError(f"corpus directory {root} holds {what}: pass a file or directory with text in it")
    if not train or not val:
        return _split_by_position(train + val, val_fraction, label, n_train + n_val, truncated)
    return Corpus(_as_tensor(train), _as_tensor(val), label, n_train, n_val, "file", truncated)


def _walk(root: Path, stdlib: bool) -> List[str]:
    """Relative posix paths of candidate files under root, sorted (os.walk order is not stable)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        keep = []
        for d in dirnames:
            if d.startswith(".") or d == "__pycache__":
                continue
            if stdlib and (d in _STDLIB_SKIP_DIRS or d.startswith("config-")):
                continue
            keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            if f.startswith("."):
                continue
            # _sysconfigdata_* records the build machine's paths: it differs between machines
            if stdlib and (not f.endswith(".py") or f.startswith("_sysconfigdata")):
                continue
            out.append((rel_dir / f).as_posix())
    return sorted(out)


def _pretokenized(path: Path, label: str) -> Corpus:
    train, val, meta = open_tokens(path)
    raw = (path / "meta.json").read_bytes()
    return Corpus(train, val, label, len(meta["train"]), len(meta["val"]), "shards", False,
                  tokenizer=meta["tokenizer"], tokenizer_sha256=meta.get("tokenizer_sha256", ""),
                  vocab_size=meta["vocab_size"], val_bytes=int(meta.get("val_bytes", -1)),
                  fingerprint=hashlib.sha256(raw).hexdigest()[:16])


def _read_any(path: Path, limit: int, text_field: str, skip_unreadable: bool = False) -> Tuple[bytes, bool]:
    """A file's text: the documents of a .jsonl/.parquet file (DataError if bad), else its utf-8 text
    (an unreadable file is a DataError, or skipped in the standard library: a distribution's dangling link)."""
    if path.suffix in STRUCTURED:
        data, cut = read_documents(path, limit, text_field)
        if not data:
            raise DataError(f"corpus file {path} holds no documents: remove it or fill it")
        return data, cut
    return _read_text(path, limit, skip_unreadable)


def _read_text(path: Path, limit: int, skip_unreadable: bool = False) -> Tuple[bytes, bool]:
    """Up to ``limit`` bytes of a file, or b"" when it is not utf-8 text; and whether it was cut."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit)
            cut = bool(f.read(1))
    except OSError as e:
        if skip_unreadable:
            return b"", False
        raise DataError(f"cannot read corpus file {path}: {e.strerror or e}") from None
    if b"\x00" in data:
        return b"", False
    try:
        # final=False: a cut in the middle of a multi-byte character is still text
        codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)
    except UnicodeDecodeError:
        return b"", False
    return data, cut


def _held_out(rel_path: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
    return h < val_fraction * 2**64


def _split_by_position(data: bytearray, val_fraction: float, label: str, files: int, truncated: bool) -> Corpus:
    cut = len(data) - int(len(data) * val_fraction)
    cut = max(1, min(cut, len(data) - 1)) if len(data) > 1 else len(data)
    return Corpus(_as_tensor(data[:cut]), _as_tensor(data[cut:]), label, files, 0, "position", truncated)


def _as_tensor(data: bytearray) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


def _need(text: torch.Tensor, seq_len: int, what: str) -> int:
    """The number of valid start offsets of a (seq_len + 1)-byte window in text."""
    if seq_len <= 0:
        raise DataError(f"seq_len must be positive, got {seq_len}")
    room = len(text) - seq_len
    if room < 1:
        raise DataError(
            f"the {what} text has {len(text)} bytes, fewer than one sequence of seq_len+1={seq_len + 1}: "
            f"use a larger corpus or a smaller model.seq_len"
        )
    return room


def _windows(text, offsets: torch.Tensor, seq_len: int) -> Batch:
    idx = offsets.unsqueeze(1) + torch.arange(seq_len + 1)
    if isinstance(text, torch.Tensor):
        chunk = text[idx].to(torch.int64)
    else:  # numpy: memory-mapped token shards
        chunk = torch.from_numpy(np.asarray(text[idx.numpy()]).astype(np.int64))
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


# --- streams -----------------------------------------------------------------------------------
class TrainStream:
    """An endless, reproducible stream of (x, y) int64 batches of shape (batch_size, seq_len).

    Batch ``i`` depends only on (seed, shard, i): each shard (a peer id) sees a different stream,
    and ``load_state_dict`` resumes it exactly from the number of batches already drawn.
    """

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int, shard: str):
        if batch_size <= 0:
            raise DataError(f"batch_size must be positive, got {batch_size}")
        self.text = corpus.train
        self.room = _need(self.text, seq_len, "training")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.shard = int(seed), str(shard)
        self.batches = 0

    @property
    def tokens_per_batch(self) -> int:
        return self.seq_len * self.batch_size

    def _generator(self, index: int) -> torch.Generator:
        key = f"voloco-train\x00{self.seed}\x00{self.shard}\x00{index}".encode("utf-8")
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1
        return torch.Generator(device="cpu").manual_seed(seed)

    def next_batch(self) -> Batch:
        offsets = torch.randint(0, self.room, (self.batch_size,), generator=self._generator(self.batches))
        self.batches += 1
        return _windows(self.text, offsets, self.seq_len)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> Dict[str, object]:
        return {"seed": self.seed, "shard": self.shard, "batches": self.batches}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if state.get("seed") != self.seed or state.get("shard") != self.shard:
            raise DataError(
                f"stream state is for seed={state.get('seed')!r} shard={state.get('shard')!r}, this stream is "
                f"seed={self.seed} shard={self.shard!r}: start a fresh stream or use the matching peer id"
            )
        batches = state.get("batches")
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise DataError(f"stream state has an invalid batch count {batches!r}: start a fresh stream")
        self.batches = batches


def val_batches(corpus: Corpus, seq_len: int, batch_size: int, n_batches: int) -> List[Batch]:
    """A fixed list of validation batches at evenly spaced offsets: the same on every machine."""
    if batch_size <= 0 or n_batches <= 0:
        raise DataError(f"batch_size and n_batches must be positive, got {batch_size} and {n_batches}")
    room = _need(corpus.val, seq_len, "validation")
    n = batch_size * n_batches
    last = room - 1
    offsets = torch.tensor([(i * last) // max(1, n - 1) for i in range(n)], dtype=torch.int64)
    return [_windows(corpus.val, o, seq_len) for o in offsets.split(batch_size)]
