import torch
import pytest

from peer.training.data import (
    DataError,
    TrainStream,
    decode,
    encode,
    load_corpus,
    stdlib_dir,
    val_batches,
)


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus("stdlib")


def _text_dir(tmp_path, n=40, size=400):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(n):
        where = root / "sub" if i % 2 else root
        ext = (".txt", ".md", ".py", ".rst", "")[i % 5]
        (where / f"f{i:03d}{ext}").write_text(f"file {i} " + "lorem ipsum dolor sit amet é " * (size // 29))
    return root


def test_tokenizer_roundtrip():
    text = "héllo, wörld ✓\n"
    ids = encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert len(ids) == len(text.encode("utf-8"))
    assert decode(ids) == text
    assert decode([0xFF, 0x41]) == "\ufffdA"


def test_stdlib_corpus(stdlib):
    assert stdlib.train.dtype == torch.uint8 and stdlib.val.dtype == torch.uint8
    assert stdlib.split == "file" and stdlib.val_files > 0 and stdlib.train_files > stdlib.val_files
    assert 1_000_000 < len(stdlib.train) <= 40 * 1024 * 1024
    frac = len(stdlib.val) / (len(stdlib.train) + len(stdlib.val))
    assert 0.03 < frac < 0.3
    assert load_corpus(None).digest() == stdlib.digest()  # None means the stdlib, and reading is deterministic


def test_stdlib_skips_site_packages_and_tests():
    from peer.training.data import _walk

    files = _walk(stdlib_dir(), stdlib=True)
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any(f.startswith(("site-packages/", "test/")) or "/test/" in f or "/tests/" in f for f in files)
    assert not any("_sysconfigdata" in f for f in files)
    assert "os.py" in files and "asyncio/events.py" in files


def test_directory_split_deterministic_and_disjoint(tmp_path):
    root = _text_dir(tmp_path)
    a, b = load_corpus(root), load_corpus(str(root))
    assert a.split == "file" and a.digest() == b.digest()
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train_files + a.val_files == 40 and a.val_files > 0
    # disjoint: every file's text is in exactly one side
    train, val = bytes(a.train.numpy()), bytes(a.val.numpy())
    for f in sorted(root.rglob("f*")):
        head = f.read_bytes()[:12]  # "file 7 lorem" is unique per file
        assert (head in train) != (head in val), f
    # the split depends on the relative path only: a copy elsewhere splits the same way
    other = tmp_path / "elsewhere"
    root.rename(other)
    assert load_corpus(other).digest() == a.digest()


def test_directory_skips_binaries_and_hidden(tmp_path):
    root = _text_dir(tmp_path, n=10)
    (root / "blob.bin").write_bytes(bytes(range(256)) * 10)
    (root / "nul.txt").write_bytes(b"abc\x00def" * 100)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n" * 100)
    c = load_corpus(root)
    assert c.train_files + c.val_files == 10
    data = bytes(c.train.numpy()) + bytes(c.val.numpy())
    assert b"\x00" not in data and b"refs/heads" not in data


def test_single_file_split_by_position(tmp_path):
    f = tmp_path / "book.txt"
    f.write_bytes(bytes(range(32, 127)) * 100)
    c = load_corpus(f, val_fraction=0.1)
    assert c.split == "position"
    assert len(c.val) == int(9500 * 0.1) and len(c.train) + len(c.val) == 9500
    assert bytes(c.train.numpy()) + bytes(c.val.numpy()) == f.read_bytes()


def test_max_bytes_truncates_deterministically(tmp_path):
    root = _text_dir(tmp_path)
    c = load_corpus(root, max_bytes=5000)
    assert c.truncated and len(c.train) + len(c.val) <= 5000
    assert load_corpus(root, max_bytes=5000).digest() == c.digest()
    assert not load_corpus(root).truncated


def test_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no utf-8 text"):
        load_corpus(empty)
    (empty / "x.bin").write_bytes(b"\x00\xff" * 100)
    with pytest.raises(DataError, match="no utf-8 text"):
        load_corpus(empty)
    blank = tmp_path / "blank.txt"
    blank.write_text("")
    with pytest.raises(DataError, match="no utf-8 text"):
        load_corpus(blank)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello world, this is short")
    c = load_corpus(tiny)
    with pytest.raises(DataError, match="fewer than one sequence"):
        TrainStream(c, seq_len=128, batch_size=2, seed=0, shard="a")
    with pytest.raises(DataError, match="fewer than one sequence"):
        val_batches(c, seq_len=128, batch_size=2, n_batches=1)
    assert issubclass(DataError, ValueError)
    # messages are one line and say what to do
    try:
        load_corpus(tmp_path / "nope")
    except DataError as e:
        assert "\n" not in str(e) and "pass" in str(e)


def test_stream_shapes_and_targets(stdlib):
    s = TrainStream(stdlib, seq_len=128, batch_size=16, seed=0, shard="peer-a")
    x, y = next(s)
    assert x.shape == y.shape == (16, 128) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert s.tokens_per_batch == 2048


def test_stream_reproducible_resumable_and_sharded(stdlib):
    a = TrainStream(stdlib, 64, 4, seed=1, shard="peer-a")
    first = [next(a) for _ in range(6)]
    again = TrainStream(stdlib, 64, 4, seed=1, shard="peer-a")
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, [next(again) for _ in range(6)]))

    resumed = TrainStream(stdlib, 64, 4, seed=1, shard="peer-a")
    part = TrainStream(stdlib, 64, 4, seed=1, shard="peer-a")
    for _ in range(3):
        next(part)
    resumed.load_state_dict(part.state_dict())
    assert resumed.state_dict()["batches"] == 3
    assert all(torch.equal(first[i][0], next(resumed)[0]) for i in range(3, 6))

    other_shard = TrainStream(stdlib, 64, 4, seed=1, shard="peer-b")
    other_seed = TrainStream(stdlib, 64, 4, seed=2, shard="peer-a")
    assert not torch.equal(first[0][0], next(other_shard)[0])
    assert not torch.equal(first[0][0], next(other_seed)[0])

    with pytest.raises(DataError, match="shard"):
        other_shard.load_state_dict(part.state_dict())


def test_val_batches_fixed_and_spread(stdlib):
    a = val_batches(stdlib, 128, 16, 8)
    b = val_batches(stdlib, 128, 16, 8)
    assert len(a) == 8 and all(x.shape == y.shape == (16, 128) for x, y in a)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    # evenly spaced: the first window starts the validation text, the last one ends it
    assert torch.equal(a[0][0][0], stdlib.val[:128].long())
    assert torch.equal(a[-1][1][-1], stdlib.val[-128:].long())
