"""Corpus file formats besides plain text: ``.jsonl`` records, ``.parquet`` shards, and pre-tokenized
shards (``voloco tokenize``) that are memory-mapped rather than read.

Documents of a ``.jsonl`` or ``.parquet`` file are its records' text field (``data.text_field``),
each followed by a blank line, as one text: the same corpus reader then splits and samples them
like text files. Any bad data is one DataError that names the file (and the line of a ``.jsonl``).

A pre-tokenized corpus is a directory holding ``meta.json`` and shards of raw token ids
(``train-00000.bin``, ``val-00000.bin``: little-endian uint8/uint16/uint32, no header): the sidecar
names the dtype, the tokenizer's kind and sha256, its vocabulary size, each shard's token count,
and how many bytes of text the validation tokens stand for (to report loss per byte).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

STRUCTURED = (".jsonl", ".parquet")
META_NAME = "meta.json"
TOKENS_FORMAT = "voloco-tokens"
DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
DOC_SEPARATOR = b"\n\n"
SHARD_TOKENS = 1 << 28  # tokens per shard that ``write_tokens`` writes at most (512 MiB of uint16)
_SHARD_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\.bin")
MAX_LINE = 64 << 20  # bytes of one .jsonl line


class DataError(ValueError):
    """A corpus that cannot be used; the message says what is wrong and what to do."""


# ---- .jsonl and .parquet -------------------------------------------------------------------------------
def read_documents(path: Path, limit: int, text_field: str) -> Tuple[bytes, bool]:
    """Up to ``limit`` bytes of the documents of a .jsonl or .parquet file; and whether it was cut."""
    if path.suffix == ".jsonl":
        return _read_jsonl(path, limit, text_field)
    return _read_parquet(path, limit, text_field)


def _read_jsonl(path: Path, limit: int, field: str) -> Tuple[bytes, bool]:
    out = bytearray()
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), start=1):
                if len(line) > MAX_LINE:
                    raise DataError(f"{path}: line {number} is longer than {MAX_LINE} bytes")
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, UnicodeDecodeError) as e:
                    raise DataError(f"{path}: line {number} is not valid JSON ({e})") from None
                _add(out, path, f"line {number}", record.get(field) if isinstance(record, dict) else None,
                     field, isinstance(record, dict) and field in record)
                if len(out) >= limit:
                    return bytes(out[:limit]), True
    except OSError as e:
        raise DataError(f"cannot read corpus file {path}: {e.strerror or e}") from None
    return bytes(out), False


def _add(out: bytearray, path: Path, where: str, text, field: str, present: bool) -> None:
    if not present:
        raise DataError(f"{path}: {where} has no field {field!r} (set data.text_field to the field holding the text)")
    if not isinstance(text, str):
        raise DataError(f"{path}: {where}: field {field!r} is a {type(text).__name__}, not a string")
    out += text.encode("utf-8", errors="replace") + DOC_SEPARATOR


def _read_parquet(path: Path, limit: int, column: str) -> Tuple[bytes, bool]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: pip install 'voloco[parquet]'") from None
    out = bytearray()
    try:
        shard = pq.ParquetFile(str(path))
        if column not in shard.schema_arrow.names:
            raise DataError(
                f"{path} has no column {column!r} (columns: {', '.join(shard.schema_arrow.names[:20])}): "
                f"set data.text_field to the column holding the text"
            )
        for group in range(shard.num_row_groups):
            values = shard.read_row_group(group, columns=[column]).column(0)
            for row, text in enumerate(values.to_pylist()):
                if text is None:
                    continue
                _add(out, path, f"row group {group} row {row}", text, column, True)
                if len(out) >= limit:
                    return bytes(out[:limit]), True
    except DataError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError and others on a bad file
        raise DataError(f"cannot read parquet file {path}: {str(e)[:300]}") from None
    return bytes(out), False


# ---- pre-tokenized shards ---------------------------------------------------------------------------
class Segments:
    """Several token arrays (memory-mapped shards) seen as one, indexed by arrays of positions."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = list(arrays)
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.dtype = self.arrays[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, idx) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty(idx.shape, dtype=self.dtype)
        for k in np.unique(which):
            mask = which == k
            out[mask] = self.arrays[k][idx[mask] - self.starts[k]]
        return out


def is_pretokenized(path: Path) -> bool:
    return path.is_dir() and (path / META_NAME).is_file()


def open_tokens(root: Path) -> Tuple[object, object, Dict]:
    """(train tokens, val tokens, meta) of a pre-tokenized directory, memory-mapped and checked:
    every shard exists, has the size its token count says and holds only ids below the vocabulary."""
    meta_path = root / META_NAME
    try:
        meta = json.loads(meta_path.read_bytes()[: 1 << 20])
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {meta_path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != TOKENS_FORMAT or meta.get("version") != 1:
        raise DataError(f"{meta_path} is not a voloco-tokens v1 sidecar: re-create it with `voloco tokenize`")
    dtype = DTYPES.get(meta.get("dtype"))
    vocab = meta.get("vocab_size")
    sha = meta.get("tokenizer_sha256", "")
    if dtype is None or not isinstance(vocab, int) or not 1 <= vocab <= np.iinfo(dtype).max + 1 or not isinstance(sha, str):
        raise DataError(f"{meta_path}: bad dtype, vocab_size or tokenizer_sha256: re-create it with `voloco tokenize`")
    if meta.get("tokenizer") not in ("bytes", "bpe"):
        raise DataError(f"{meta_path}: tokenizer must be 'bytes' or 'bpe'")
    splits = [_open_split(root, meta, name, np.dtype(dtype), vocab) for name in ("train", "val")]
    return splits[0], splits[1], meta


def _open_split(root: Path, meta: Dict, name: str, dtype: np.dtype, vocab: int):
    shards = meta.get(name)
    if not isinstance(shards, list) or not shards:
        raise DataError(f"{root / META_NAME} lists no {name} shards: re-create it with `voloco tokenize`")
    arrays = []
    for entry in shards:
        file, tokens = (entry.get("file"), entry.get("tokens")) if isinstance(entry, dict) else (None, None)
        if not isinstance(file, str) or not _SHARD_NAME.fullmatch(file) or not isinstance(tokens, int) or tokens < 0:
            raise DataError(f"{root / META_NAME}: bad {name} shard entry {str(entry)[:80]}")
        path = root / file
        try:
            size = path.stat().st_size
        except OSError as e:
            raise DataError(f"cannot read token shard {path}: {e.strerror or e}") from None
        if tokens == 0 or size == 0:
            raise DataError(f"token shard {path} is empty: re-create the shards with `voloco tokenize`")
        if size != tokens * dtype.itemsize:
            raise DataError(f"token shard {path} has {size} bytes, not {tokens} {dtype.name} tokens as {META_NAME} says")
        try:
            array = np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"cannot map token shard {path}: {e}") from None
        _check_range(array, vocab, path)
        arrays.append(array)
    return arrays[0] if len(arrays) == 1 else Segments(arrays)


def _check_range(array: np.ndarray, vocab: int, path: Path, step: int = 1 << 24) -> None:
    if vocab > np.iinfo(array.dtype).max:
        return  # every value of the dtype is a valid id
    for i in range(0, len(array), step):
        top = int(array[i:i + step].max())
        if top >= vocab:
            raise DataError(f"token shard {path} holds id {top}, outside the vocabulary of {vocab} (near token {i})")


def write_tokens(out_dir: Path, splits: Dict[str, np.ndarray], meta: Dict, shard_tokens: int = SHARD_TOKENS) -> Dict:
    """Write ``splits`` ({"train": ids, "val": ids}) as shards plus ``meta.json``; returns the meta."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(meta, format=TOKENS_FORMAT, version=1)
    for name, ids in splits.items():
        if len(ids) == 0:
            raise DataError(f"the {name} split has no tokens: use a larger input")
        entries: List[Dict] = []
        for n, start in enumerate(range(0, len(ids), shard_tokens)):
            part = np.ascontiguousarray(ids[start:start + shard_tokens], dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
            file = f"{name}-{n:05d}.bin"
            part.tofile(out_dir / file)
            entries.append({"file": file, "tokens": int(len(part))})
        meta[name] = entries
    (out_dir / META_NAME).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta


def dtype_for(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"
