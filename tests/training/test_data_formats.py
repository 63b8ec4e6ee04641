"""Corpus formats: .jsonl, .parquet and pre-tokenized shards; every bad-data error names its file."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from peer.training.data import DataError, TrainStream, load_corpus, val_batches
from peer.training.data_formats import META_NAME, Segments, write_tokens
from peer.training.tokenizer import BYTES, tokenize_corpus

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i % 5) for i in range(60)]


def _jsonl(path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


# ---- .jsonl ----------------------------------------------------------------------------------------------
def test_jsonl_file_reads_every_document(tmp_path):
    c = load_corpus(_jsonl(tmp_path / "docs.jsonl"))
    text = (c.train.numpy().tobytes() + c.val.numpy().tobytes()).decode()
    assert text == "".join(d + "\n\n" for d in DOCS)
    assert c.split == "position" and c.tokenizer == "bytes"


def test_jsonl_custom_field_and_blank_lines(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text('{"body": "alpha beta"}\n\n{"body": "gamma"}\n' * 40)
    c = load_corpus(p, text_field="body")
    assert b"alpha beta\n\ngamma\n\n" in c.train.numpy().tobytes()


def test_directory_of_jsonl_and_text_is_split_by_file(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(30):
        _jsonl(root / f"part{i:02d}.jsonl", DOCS[i:i + 3])
    (root / "notes.txt").write_text("plain text " * 50)
    c = load_corpus(root)
    assert c.split == "file" and c.train_files + c.val_files == 31


def test_bad_json_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: line 3 is not valid JSON"):
        load_corpus(p)


def test_missing_field_names_file_line_and_field(tmp_path):
    p = tmp_path / "nofield.jsonl"
    p.write_text('{"text": "ok"}\n{"content": "no"}\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl: line 2 has no field 'text'.*data\.text_field"):
        load_corpus(p)
    p.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl: line 1: field 'text' is a int, not a string"):
        load_corpus(p)
    p.write_text('["text"]\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl: line 1 has no field"):
        load_corpus(p)


def test_empty_jsonl_is_an_error_naming_it(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    _jsonl(root / "a.jsonl")
    (root / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl holds no documents"):
        load_corpus(root)


def test_unreadable_file_is_an_error_naming_it(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.txt").write_text("some text " * 100)
    os.symlink(root / "missing.txt", root / "dangling.txt")
    with pytest.raises(DataError, match=r"cannot read corpus file .*dangling\.txt"):
        load_corpus(root)


# ---- .parquet ----------------------------------------------------------------------------------------------
def _parquet(path, docs=DOCS, column="text"):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: docs, "n": list(range(len(docs)))}), str(path), row_group_size=16)
    return path


def test_parquet_reads_the_text_column(tmp_path):
    c = load_corpus(_parquet(tmp_path / "docs.parquet"))
    assert (c.train.numpy().tobytes() + c.val.numpy().tobytes()).decode() == "".join(d + "\n\n" for d in DOCS)
    c2 = load_corpus(_parquet(tmp_path / "other.parquet", column="content"), text_field="content")
    assert c2.digest() == c.digest()


def test_parquet_missing_column_and_corrupt_file(tmp_path):
    p = _parquet(tmp_path / "docs.parquet", column="body")
    with pytest.raises(DataError, match=r"docs\.parquet has no column 'text' \(columns: body, n\)"):
        load_corpus(p)
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"cannot read parquet file .*broken\.parquet"):
        load_corpus(bad)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    p = tmp_path / "docs.parquet"
    p.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"docs\.parquet: reading \.parquet needs pyarrow: pip install 'voloco\[parquet\]'"):
        load_corpus(p)


# ---- pre-tokenized shards -------------------------------------------------------------------------------
def _shards(tmp_path, n_train=5000, n_val=800, vocab=256, shard_tokens=1 << 28, name="tok"):
    rng = np.random.default_rng(0)
    out = tmp_path / name
    write_tokens(out, {"train": rng.integers(0, vocab, n_train), "val": rng.integers(0, vocab, n_val)},
                 {"dtype": "uint16", "tokenizer": "bytes", "tokenizer_sha256": "", "vocab_size": vocab, "val_bytes": 2 * n_val},
                 shard_tokens=shard_tokens)
    return out


def test_pretokenized_shards_are_memory_mapped(tmp_path):
    c = load_corpus(_shards(tmp_path))
    assert isinstance(c.train, np.memmap) and len(c.train) == 5000 and len(c.val) == 800
    assert c.split == "shards" and c.bytes_per_token == 2.0 and c.per_byte(4.0) == 2.0
    x, y = TrainStream(c, 32, 4, seed=0, shard="a").next_batch()
    assert x.dtype == torch.int64 and x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(val_batches(c, 32, 4, 2)) == 2
    assert tokenize_corpus(c, BYTES, 256) is c  # made with bytes: a bytes run takes it as it is


def test_segments_equal_the_concatenation(tmp_path):
    one = load_corpus(_shards(tmp_path, name="one"))
    many = load_corpus(_shards(tmp_path, shard_tokens=700, name="many"))
    assert isinstance(many.train, Segments) and len(many.train.arrays) == 8
    idx = np.arange(len(one.train)).reshape(50, 100)
    assert np.array_equal(many.train[idx], np.asarray(one.train)[idx])
    a = TrainStream(one, 64, 8, seed=3, shard="p")
    b = TrainStream(many, 64, 8, seed=3, shard="p")
    for _ in range(5):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))


def test_per_peer_shards_are_deterministic(tmp_path):
    c = load_corpus(_shards(tmp_path))
    first = [TrainStream(c, 32, 4, seed=7, shard="peer-A").next_batch()[0] for _ in range(2)]
    assert torch.equal(first[0], first[1])  # same peer, same stream
    other = TrainStream(c, 32, 4, seed=7, shard="peer-B").next_batch()[0]
    assert not torch.equal(first[0], other)  # another peer, another stream
    s = TrainStream(c, 32, 4, seed=7, shard="peer-A")
    batches = [s.next_batch()[0] for _ in range(4)]
    resumed = TrainStream(c, 32, 4, seed=7, shard="peer-A")
    resumed.load_state_dict({"seed": 7, "shard": "peer-A", "batches": 2})
    assert torch.equal(resumed.next_batch()[0], batches[2])


def test_token_ids_out_of_vocab_name_the_shard(tmp_path):
    out = _shards(tmp_path, vocab=300)
    meta = json.loads((out / META_NAME).read_text())
    meta["vocab_size"] = 200  # the shards hold ids up to 299
    (out / META_NAME).write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"token shard .*train-00000\.bin holds id \d+, outside the vocabulary of 200"):
        load_corpus(out)


def test_empty_or_truncated_shard_is_an_error(tmp_path):
    out = _shards(tmp_path)
    (out / "val-00000.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"token shard .*val-00000\.bin is empty"):
        load_corpus(out)
    out = _shards(tmp_path, name="cut")
    with open(out / "train-00000.bin", "r+b") as f:
        f.truncate(999)
    with pytest.raises(DataError, match=r"train-00000\.bin has 999 bytes, not 5000 uint16 tokens"):
        load_corpus(out)
    (out / META_NAME).write_text("{not json")
    with pytest.raises(DataError, match=r"cannot read .*meta\.json"):
        load_corpus(out)


def test_shard_names_cannot_leave_the_directory(tmp_path):
    out = _shards(tmp_path)
    meta = json.loads((out / META_NAME).read_text())
    meta["train"][0]["file"] = "../../etc/passwd.bin"
    (out / META_NAME).write_text(json.dumps(meta))
    with pytest.raises(DataError, match="bad train shard entry"):
        load_corpus(out)


def test_voloco_tokenize_bytes_roundtrip(tmp_path, capsys):
    from voloco.cli import main

    src = _jsonl(tmp_path / "docs.jsonl")
    assert main(["tokenize", str(src), str(tmp_path / "out")]) == 0
    c = load_corpus(tmp_path / "out")
    text = load_corpus(src)
    assert np.array_equal(np.asarray(c.train), text.train.numpy()) and c.tokenizer == "bytes"
    assert main(["tokenize", str(tmp_path / "missing.jsonl"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
