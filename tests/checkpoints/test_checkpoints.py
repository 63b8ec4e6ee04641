"""Checkpoints on disk are untrusted: every load returns exactly what was saved or refuses the file.

A real peer checkpoint (θ, a strategy's buffers, AdamW state, the stream position) is written by
``peer.checkpoints.contents.save``; its bytes are then damaged in many ways, a save is killed mid-way, and
metadata of the wrong types is written with a valid checksum. Seconds, no network.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from peer.checkpoints import contents as checkpoints
from peer.training.data import load_corpus
from peer.training.model import build_model
from peer.training.roles import FullReplica
from peer.outer.engine import RoundEngine
from peer.checkpoints.files import (
    CHECKPOINT_NAME, PREVIOUS_NAME, CheckpointError, load_checkpoint, read_checkpoint, remove_stale_temp, save_checkpoint,
)
from protocol.spec import RunSpec

SPEC = RunSpec().replace(
    model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
    outer={"strategy": "diloco", "inner_steps": 2},  # DiLoCo: shared state (momentum) in the file too
    data={"batch_size": 2, "val_batches": 1},
)
MUTATIONS = int(os.environ.get("VOLOCO_FUZZ_MUTATIONS", "300"))
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    text = tmp_path_factory.mktemp("corpus") / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    return load_corpus(text, SPEC.data.val_fraction)


def make_peer(corpus, spec=SPEC, seed=0):
    role = FullReplica(spec, build_model(spec.model, spec.seed), torch.device("cpu"), corpus, "peer-a")
    gen = torch.Generator().manual_seed(seed)
    theta = {n: torch.randn(s, generator=gen) for n, s in spec.param_shapes().items()}
    return role, RoundEngine(role.strategy, theta)


def trained_peer(corpus, round_no=3):
    role, engine = make_peer(corpus)
    role.load_theta(engine.theta)
    for _ in range(2):  # AdamW state and a stream position worth checking
        role.inner_step(*role.stream.next_batch())
    engine.strategy.momentum = {n: torch.randn_like(t) for n, t in engine.strategy.momentum.items()}
    engine.install({n: p.detach().clone() for n, p in role.params.items()}, round_no)
    return role, engine


def same(a, b) -> bool:
    """Bit-identical tensor maps (dtype and shape included)."""
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_round_trips_bit_for_bit_and_the_previous_one_is_kept(tmp_path, corpus):
    role, engine = trained_peer(corpus, round_no=3)
    engine.standing = {"peer-a": 3, "peer-b": 1}  # the lineage's standing table travels with θ
    engine.evidence = {"peer-c": (2164, 1)}  # and so do fresh senders' pooled scores
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=123)
    first = read_checkpoint(tmp_path / CHECKPOINT_NAME)
    engine.install({n: t + 1 for n, t in engine.theta.items()}, 4)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=456)
    assert {p.name for p in tmp_path.iterdir()} == {CHECKPOINT_NAME, PREVIOUS_NAME}
    newest, previous = read_checkpoint(tmp_path / CHECKPOINT_NAME), read_checkpoint(tmp_path / PREVIOUS_NAME)
    assert same(previous[0], first[0]) and previous[1] == first[1] and previous[1]["round"] == 3
    assert newest[1]["round"] == 4 and newest[1]["tokens"] == 456

    role2, engine2 = make_peer(corpus, seed=1)
    assert checkpoints.restore(tmp_path, SPEC, engine2, role2) == 456
    assert engine2.round == 4 and engine2.params_hash() == engine.params_hash()
    assert engine2.standing == {"peer-a": 3, "peer-b": 1} and engine2.evidence == {"peer-c": (2164, 1)}
    assert all(torch.equal(engine2.strategy.momentum[n], engine.strategy.momentum[n]) for n in engine.strategy.momentum)
    assert role2.stream.state_dict() == role.stream.state_dict() and role2.trainer.step_count == role.trainer.step_count


def test_every_mutated_checkpoint_loads_exactly_or_is_refused(tmp_path, corpus, caplog):
    role, engine = trained_peer(corpus)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=7)
    original = (tmp_path / CHECKPOINT_NAME).read_bytes()
    saved_tensors, saved_meta = read_checkpoint(tmp_path / CHECKPOINT_NAME)
    header_end = 8 + int.from_bytes(original[:8], "little")
    rng = random.Random(0)
    target = tmp_path / "mutated"
    target.mkdir()
    outcomes = {"refused": 0, "exact": 0}
    for i in range(MUTATIONS):
        data = bytearray(original)
        kind = i % 5
        if kind == 0:  # a few bytes anywhere
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:  # a byte of the header (offsets, shapes, dtypes, metadata, checksum)
            data[rng.randrange(header_end)] = rng.randrange(256)
        elif kind == 2:  # a float's bits in the data, e.g. into a NaN or an infinity
            pos = header_end + rng.randrange(len(data) - header_end - 3)
            data[pos : pos + 4] = rng.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", os.urandom(4)])
        elif kind == 3:  # truncated, as by a full disk
            data = data[: rng.randrange(len(data))]
        else:  # the header's length prefix
            data[rng.randrange(8)] = rng.randrange(256)
        (target / CHECKPOINT_NAME).write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger="voloco.state"):
            found = load_checkpoint(target)  # never raises
        if found is None:
            outcomes["refused"] += 1
        else:
            assert same(found[0], saved_tensors) and found[1] == saved_meta, f"mutation {i} (kind {kind}) loaded altered data"
            outcomes["exact"] += 1
    assert outcomes["refused"] >= MUTATIONS * 0.9, outcomes
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refusing checkpoint")]
    assert len(refusals) == outcomes["refused"]  # one line per refused file


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, corpus, caplog):
    role, engine = trained_peer(corpus, round_no=5)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=50)
    good_hash = engine.params_hash()
    engine.install({n: t * 2 for n, t in engine.theta.items()}, 6)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=60)
    newest = tmp_path / CHECKPOINT_NAME
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0x40
    newest.write_bytes(bytes(data))

    role2, engine2 = make_peer(corpus, seed=1)
    with caplog.at_level(logging.WARNING):
        assert checkpoints.restore(tmp_path, SPEC, engine2, role2) == 50
    assert engine2.round == 5 and engine2.params_hash() == good_hash
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "checksum" in lines[0] and f"falling back to {PREVIOUS_NAME}" in lines[0], lines


def test_a_non_finite_state_is_never_written_nor_loaded(tmp_path, corpus, caplog):
    role, engine = trained_peer(corpus)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=1)
    before = (tmp_path / CHECKPOINT_NAME).read_bytes()
    name = next(iter(engine.theta))
    poisoned = dict(engine.theta, **{name: torch.full_like(engine.theta[name], float("nan"))})
    assert save_checkpoint(tmp_path, poisoned, {"round": 9}) is None
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == before and not (tmp_path / PREVIOUS_NAME).exists()

    # a file with a NaN whose checksum was computed over the NaN (written by hand): refused at load
    from safetensors.torch import save as st_save

    from peer.checkpoints.files import checkpoint_digest

    meta_json = json.dumps({"round": 9})
    forged = st_save(poisoned, metadata={"voloco": meta_json, "voloco_sha256": checkpoint_digest(poisoned, meta_json)})
    (tmp_path / CHECKPOINT_NAME).write_bytes(forged)
    with pytest.raises(CheckpointError, match="non-finite"):
        read_checkpoint(tmp_path / CHECKPOINT_NAME)


@pytest.mark.parametrize(
    "field, value",
    [("stream", [1, 2]), ("optimizer", "adamw"), ("optimizer", {"param_groups": 3, "scalars": {}}),
     ("round", "7"), ("part", None), ("tokens", -1), ("standing", {"peer-a": -3}), ("standing", [1]), ("evidence", {"peer-a": [0, 1]}),
     (None, ["not", "an", "object"])],
)
def test_metadata_of_the_wrong_type_is_refused_cleanly_and_nothing_is_loaded(tmp_path, corpus, caplog, field, value):
    role, engine = trained_peer(corpus)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=1)
    tensors, meta = read_checkpoint(tmp_path / CHECKPOINT_NAME)
    meta = value if field is None else dict(meta, **{field: value})
    (tmp_path / CHECKPOINT_NAME).unlink()
    save_checkpoint(tmp_path, tensors, meta)  # a valid checksum: only the types are wrong

    role2, engine2 = make_peer(corpus, seed=1)
    before = (engine2.params_hash(), role2.stream.state_dict(), role2.trainer.step_count)
    with caplog.at_level(logging.WARNING):
        assert checkpoints.restore(tmp_path, SPEC, engine2, role2) is None
        assert checkpoints.saved_part(tmp_path, SPEC) is None
    assert (engine2.params_hash(), role2.stream.state_dict(), role2.trainer.step_count) == before
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refusing checkpoint")]
    assert len(refusals) == 1 and any(w in refusals[0] for w in ("metadata", "does not fit", "standing")), refusals


def test_a_checkpoint_that_does_not_fit_is_rolled_back_and_the_previous_one_used(tmp_path, corpus):
    role, engine = trained_peer(corpus, round_no=2)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=20)
    good = engine.params_hash()
    tensors, meta = read_checkpoint(tmp_path / CHECKPOINT_NAME)
    # the newest names another shard's stream: everything before the stream was already loaded
    save_checkpoint(tmp_path, {k: v + 1 if k.startswith("shared.") else v for k, v in tensors.items()},
                    dict(meta, round=3, stream=dict(meta["stream"], shard="someone-else")))
    role2, engine2 = make_peer(corpus, seed=1)
    assert checkpoints.restore(tmp_path, SPEC, engine2, role2) == 20
    assert engine2.round == 2 and engine2.params_hash() == good
    assert all(torch.equal(engine2.strategy.momentum[n], engine.strategy.momentum[n]) for n in engine.strategy.momentum)

    other = SPEC.replace(seed=SPEC.seed + 1)  # another run spec: refused, nothing left to fall back to
    role3, engine3 = make_peer(corpus, spec=other)
    assert checkpoints.restore(tmp_path, other, engine3, role3) is None and engine3.round == 0


def test_the_temp_file_of_a_killed_save_is_removed_at_start(tmp_path, corpus):
    role, engine = trained_peer(corpus, round_no=1)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=10)
    # a save SIGKILLed after writing its temp file, before the rename (a real process, a real kill)
    child = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from peer.checkpoints import files as state
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        state.save_checkpoint(Path({str(tmp_path)!r}), {{"theta.x": torch.ones(3)}}, {{"round": 2}})
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    leftovers = list(tmp_path.glob(".checkpoint-*.tmp"))
    assert len(leftovers) == 1

    role2, engine2 = make_peer(corpus, seed=1)
    assert checkpoints.restore(tmp_path, SPEC, engine2, role2) == 10 and engine2.round == 1
    assert not list(tmp_path.glob(".checkpoint-*.tmp"))
    assert remove_stale_temp(tmp_path) == 0 and remove_stale_temp(None) == 0


@pytest.mark.parametrize("damage", ["lr is a string", "a group key is missing", "exp_avg of another shape", "state of parameter 999"])
def test_optimizer_state_that_would_fail_mid_training_is_refused_at_start(tmp_path, corpus, damage):
    role, engine = trained_peer(corpus)
    checkpoints.save(tmp_path, SPEC, engine, role, tokens=1)
    tensors, meta = read_checkpoint(tmp_path / CHECKPOINT_NAME)
    group = meta["optimizer"]["param_groups"][0]
    if damage == "lr is a string":
        group["lr"] = "fast"
    elif damage == "a group key is missing":
        del group["weight_decay"]
    elif damage == "exp_avg of another shape":
        tensors["optimizer.0.exp_avg"] = torch.zeros(3, 3)
    else:
        tensors["optimizer.999.exp_avg"] = torch.zeros(1)
    (tmp_path / CHECKPOINT_NAME).unlink()
    save_checkpoint(tmp_path, tensors, meta)
    role2, engine2 = make_peer(corpus, seed=1)
    assert checkpoints.restore(tmp_path, SPEC, engine2, role2) is None and engine2.round == 0
    assert role2.trainer.optimizer.state_dict()["state"] == {}  # rolled back: nothing of it was loaded
