"""Tokenizers of a run: utf-8 bytes (the default) or a byte-level BPE ``tokenizer.json``.

A BPE run's spec names the sha256 of its tokenizer.json (``data.tokenizer_sha256``); the coordinator
trains it on the spec's corpus (deterministic: the same corpus and vocabulary size give the same
bytes on every machine) or loads the file given with ``--tokenizer``, and serves it over the swarm
(swarm/tokenizer_share.py). A peer accepts a tokenizer only if its bytes hash to the signed spec's
sha256, and only then parses it; it keeps a verified copy in its cache and next to its checkpoint.

Token ids of a text are computed per chunk of about 64 KiB cut after a newline (a newline never sits
inside a multi-byte character, and the cut points depend only on the text), so every machine gets
the same ids from the same text whatever its thread count.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import tempfile
from pathlib import Path
from typing import Iterator, List, Optional, Union

import numpy as np

from peer.training.data import BYTE_VOCAB, DataError
from protocol.spec.sections import MAX_TOKENIZER_BYTES

__all__ = [
    "TokenizerError",
    "Tokenizer",
    "BYTES",
    "sha256_hex",
    "train_bpe",
    "load_tokenizer",
    "cache_dir",
    "cached",
    "store_verified",
]

logger = logging.getLogger("voloco.peer")

CHUNK = 1 << 12  # bytes of text per encoding call (small chunks encode faster)
TRAIN_MAX_BYTES = 64 << 20  # the most corpus text a BPE tokenizer is trained on


class TokenizerError(DataError):
    """A tokenizer that cannot be used: wrong hash, too large, unparsable, or the wrong size."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def text_chunks(data: bytes, size: int = CHUNK) -> Iterator[str]:
    """``data`` as text, cut after the first newline past every ``size`` bytes (deterministic)."""
    i = 0
    while i < len(data):
        j = data.find(b"\n", i + size)
        j = len(data) if j < 0 else j + 1
        yield data[i:j].decode("utf-8", errors="replace")
        i = j


class Tokenizer:
    """``kind`` "bytes" (no file) or "bpe" (``raw``: the tokenizer.json bytes, hashed to ``sha256``)."""

    def __init__(self, kind: str, raw: Optional[bytes] = None):
        self.kind, self.raw = kind, raw
        self.sha256 = sha256_hex(raw) if raw is not None else ""
        self._tok = None
        if kind == "bytes":
            self.vocab_size = BYTE_VOCAB
            return
        if raw is None:
            raise TokenizerError("a BPE tokenizer needs its tokenizer.json bytes")
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust parser raises its own exception type
            raise TokenizerError(f"tokenizer.json (sha256 {self.sha256[:16]}) does not parse: {str(e)[:200]}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.vocab_size <= 1 << 8 else np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Token ids of utf-8 text, in ``self.dtype``."""
        if self._tok is None:
            return np.frombuffer(bytes(data), dtype=np.uint8).copy()
        parts = [np.asarray(e.ids, dtype=self.dtype) for e in self._tok.encode_batch(list(text_chunks(bytes(data))))]
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if self._tok is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._tok.decode(ids)

    def check_vocab(self, vocab_size: int) -> None:
        if self.vocab_size != vocab_size:
            raise TokenizerError(
                f"the {self.kind} tokenizer{' ' + self.sha256[:16] if self.sha256 else ''} has {self.vocab_size} tokens but "
                f"model.vocab_size is {vocab_size}: they must be equal (set model.vocab_size = {self.vocab_size})"
            )

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, vocab={self.vocab_size}{', sha256=' + self.sha256[:16] if self.sha256 else ''})"


BYTES = Tokenizer("bytes")


def train_bpe(text: Union[bytes, bytearray, memoryview], vocab_size: int) -> bytes:
    """A byte-level BPE tokenizer.json trained on ``text`` (utf-8), exactly ``vocab_size`` tokens.

    Deterministic: the same text and size give the same bytes (the chunks are fixed by the text, and
    the trainer breaks ties between pairs by the pair itself). TokenizerError when the text cannot
    yield that many tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size <= BYTE_VOCAB:
        raise TokenizerError(f"a BPE vocabulary must exceed the {BYTE_VOCAB} bytes, got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text_chunks(bytes(text[:TRAIN_MAX_BYTES])), trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise TokenizerError(
            f"BPE training on {min(len(text), TRAIN_MAX_BYTES)} bytes of text found only {got} tokens, not model.vocab_size = "
            f"{vocab_size}: use a larger corpus or set model.vocab_size = {got}"
        )
    return tok.to_str().encode("utf-8")


def load_tokenizer(raw: bytes, expected_sha256: Optional[str] = None, vocab_size: Optional[int] = None,
                   source: str = "tokenizer.json") -> Tokenizer:
    """A BPE tokenizer from its bytes, checked (size, then hash, then parse, then size of vocabulary)."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_TOKENIZER_BYTES:
        raise TokenizerError(f"{source} is larger than {MAX_TOKENIZER_BYTES} bytes: refused")
    digest = sha256_hex(bytes(raw))
    if expected_sha256 is not None and digest != expected_sha256:
        raise TokenizerError(
            f"{source} has sha256 {digest}, but the run spec names {expected_sha256}: refused (tampered or another run's)"
        )
    tok = Tokenizer("bpe", bytes(raw))
    if vocab_size is not None:
        tok.check_vocab(vocab_size)
    return tok


# ---- the cache ---------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """$VOLOCO_CACHE, else $XDG_CACHE_HOME/voloco, else ~/.cache/voloco; tokenizers live in ``tokenizers/``."""
    root = os.environ.get("VOLOCO_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "voloco")
    return Path(root).expanduser() / "tokenizers"


def cached(sha256: str, places: List[Optional[Path]]) -> Optional[bytes]:
    """The bytes of the first file among the cache and ``places`` whose sha256 is ``sha256``."""
    for path in [cache_dir() / f"{sha256}.json", *[p for p in places if p is not None]]:
        try:
            if path.is_file() and path.stat().st_size <= MAX_TOKENIZER_BYTES:
                raw = path.read_bytes()
                if sha256_hex(raw) == sha256:
                    return raw
        except OSError:
            continue
    return None


def store_verified(raw: bytes, checkpoint_dir: Optional[Path]) -> None:
    """Keep verified bytes in the cache and as ``checkpoint_dir/tokenizer.json`` (atomic; best effort for the cache)."""
    targets = [cache_dir() / f"{sha256_hex(raw)}.json"]
    if checkpoint_dir is not None:
        targets.append(Path(checkpoint_dir) / "tokenizer.json")
    for i, path in enumerate(targets):
        try:
            _atomic_write(path, raw)
        except OSError as e:
            if i > 0:  # the checkpoint's copy is part of the checkpoint: say so
                raise DataError(f"could not write {path}: {e}") from None


def _atomic_write(path: Path, raw: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_bytes() == raw:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---- a run's tokenizer and corpus ----------------------------------------------------------------------
def tokenize_corpus(corpus, tok: Tokenizer, vocab_size: int):
    """``corpus`` (peer/training/data.py) as ``tok``'s token ids; a pre-tokenized corpus is checked against ``tok``."""
    from peer.training.data import Corpus

    tok.check_vocab(vocab_size)
    if corpus.tokenizer != "bytes" or corpus.split == "shards":  # pre-tokenized: it must name this very tokenizer
        if corpus.tokenizer != tok.kind or corpus.tokenizer_sha256 != tok.sha256 or corpus.vocab_size != vocab_size:
            raise DataError(
                f"the pre-tokenized corpus {corpus.source} was made with tokenizer {corpus.tokenizer} "
                f"{corpus.tokenizer_sha256[:16] or ''} (vocab {corpus.vocab_size}), but this run uses {tok}: re-create it "
                f"with `voloco tokenize --tokenizer tokenizer.json` using the run's tokenizer.json"
            )
        return corpus
    if tok.kind == "bytes":
        return corpus
    import torch

    def ids(part) -> "torch.Tensor":
        return torch.from_numpy(tok.encode_bytes(np.asarray(part).tobytes()).astype(np.int32))

    return Corpus(ids(corpus.train), ids(corpus.val), corpus.source, corpus.train_files, corpus.val_files, corpus.split,
                  corpus.truncated, tokenizer=tok.kind, tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size,
                  val_bytes=len(corpus.val))


def run_tokenizer(dht, spec, checkpoint_dir: Optional[Path] = None, timeout: float = 20.0) -> Tokenizer:
    """The run's tokenizer, verified against the signed spec: from the cache, the checkpoint directory or the
    swarm; kept in the cache and the checkpoint directory, and served to other peers from then on."""
    data = spec.data
    if data.tokenizer == "bytes":
        return BYTES
    if not data.tokenizer_sha256:
        raise TokenizerError('the run spec asks for a "bpe" tokenizer but names no data.tokenizer_sha256: '
                             "the coordinator must publish the tokenizer's sha256")
    places = [Path(checkpoint_dir) / "tokenizer.json"] if checkpoint_dir is not None else []
    raw = cached(data.tokenizer_sha256, places)
    if raw is None:
        from swarm.tokenizer_share import TokenizerFetchError, fetch_tokenizer

        if dht is None:
            raise TokenizerError(f"the run's tokenizer {data.tokenizer_sha256[:16]} is not in the cache and there is no swarm to ask")
        try:
            raw = fetch_tokenizer(dht, spec, timeout=timeout)
        except TokenizerFetchError as e:
            raise TokenizerError(str(e)) from None
        logger.info(f"tokenizer: fetched {len(raw)} bytes from the swarm, sha256 {data.tokenizer_sha256[:16]} verified")
    tok = load_tokenizer(raw, data.tokenizer_sha256, spec.model.vocab_size, source="the run's tokenizer.json")
    store_verified(raw, checkpoint_dir)
    if dht is not None:
        from swarm.tokenizer_share import serve_tokenizer

        serve_tokenizer(dht, spec.run_id, raw)
    return tok


def obtain_corpus(dht, spec, data: Optional[str] = None, checkpoint_dir: Optional[Path] = None):
    """What a peer trains on: the run's tokenizer (verified) applied to its corpus (``data`` or the spec's)."""
    from peer.training.data import load_corpus

    tok = run_tokenizer(dht, spec, checkpoint_dir)
    corpus = load_corpus(data or spec.data.corpus, spec.data.val_fraction, text_field=spec.data.text_field)
    return tokenize_corpus(corpus, tok, spec.model.vocab_size)


def coordinator_tokenizer(spec, path: Optional[Path] = None):
    """(spec naming its tokenizer's sha256, tokenizer.json bytes or None) for a coordinator: ``path``'s
    file (``--tokenizer``), else, for a bpe run, one trained on the training split of the spec's corpus.
    Any problem is a UsageError (swarm/console.py) that says what to change."""
    from protocol.errors import SpecError
    from swarm.console import UsageError

    try:
        return _coordinator_tokenizer(spec, path)
    except (DataError, SpecError) as e:
        raise UsageError(f"tokenizer of run {spec.run_id}: {e}") from None


def _coordinator_tokenizer(spec, path: Optional[Path]):
    from peer.training.data import load_corpus

    data = spec.data
    if path is None and data.tokenizer == "bytes":
        return spec, None
    t0 = time.monotonic()
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise TokenizerError(f"--tokenizer {str(path)!r}: {e.strerror or e}") from None
        if data.tokenizer == "bytes":
            spec = spec.replace(data={"tokenizer": "bpe"}, model={"vocab_size": Tokenizer("bpe", raw).vocab_size})
    else:
        corpus = load_corpus(data.corpus, data.val_fraction, text_field=data.text_field)
        if corpus.tokenizer != "bytes" or corpus.split == "shards":
            raise TokenizerError(f"cannot train a tokenizer on the pre-tokenized corpus {data.corpus}: pass --tokenizer PATH")
        raw = train_bpe(corpus.train.numpy().tobytes(), spec.model.vocab_size)
    tok = load_tokenizer(raw, data.tokenizer_sha256 or None, spec.model.vocab_size, source=str(path or "the trained tokenizer"))
    how = f"loaded {path}" if path is not None else f"trained on {data.corpus} in {time.monotonic() - t0:.1f} s"
    logging.getLogger("voloco.coordinator").info(f"tokenizer: BPE, {tok.vocab_size} tokens, {how}; sha256 {tok.sha256}")
    return spec.replace(data={"tokenizer_sha256": tok.sha256}), raw
