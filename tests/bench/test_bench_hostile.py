"""bench/hostile.py on its quick configuration: real processes, the clean run and one poisoned run, the table."""

import json
import re
import threading
from pathlib import Path

import pytest

from bench import hostile as bh
from bench import hostile_peers as hp


@pytest.mark.slow
def test_quick_clean_and_poisoned(tmp_path, capsys):
    out = tmp_path / "h.json"
    # two hostile processes: N honest peers and K of the attack are each started from one place
    assert bh.main(["--quick", "--attacks", "poison-1e29", "--hostile", "2", "--workdir", str(tmp_path / "runs"),
                    "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "attacker excluded/clipped" in text and "poison-1e29" in text
    results = {r["attack"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(results) == ["clean", "honest-only", "poison-1e29"]  # the clean runs are added
    clean, poisoned = results["clean"], results["poison-1e29"]
    assert clean["honest"] == 5 and poisoned["honest"] == 3 and poisoned["hostile_peers"] == 2
    for r in (clean, poisoned):
        assert r["honest_ok"] == r["honest"] and r["hashes_equal"] and r["rounds"] == 3, (r, what_happened(tmp_path / "runs" / r["attack"]))
        assert r["val_loss"] < r["initial_val_loss"]
        assert r["honest_peak_rss_mib"] > 50  # a peer with torch, its DHT process and p2p daemon
    assert len(poisoned["attacker_excluded"]) == 2 and not clean["attacker_excluded"]
    assert results["honest-only"]["honest"] == 3 and results["honest-only"]["honest_ok"] == 3
    # the poison counted would wreck the loss; the bound leaves room for the noise of 3 rounds of a tiny
    # model, where an honest round-0 update refused by the direction check costs a few percent (three
    # runs here: 1.007-1.026, 1.026 with one refused; CI once 1.061)
    assert poisoned["loss_vs_honest"] < 1.10
    # counted, not asserted 0: on this tiny model (3 rounds of H = 10) an honest update's direction can
    # be unclear in round 0 (CI saw one refused in a clean run of 5); the demo model's runs refused none
    assert isinstance(clean["honest_refused"], int) and isinstance(poisoned["honest_refused"], int)


def what_happened(run: Path) -> str:
    """The lines of a run's peer logs that tell how their parameters could have parted."""
    pattern = re.compile(r"done \||no group|merged|download|installed|refused|resync|start|excluded|not waiting|Error")
    return "\n".join(f"{log.stem}: {line[:220]}" for log in sorted(run.glob("peer*.log"))
                     for line in log.read_text(errors="replace").splitlines() if pattern.search(line))


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        bh.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--quick", "--attacks", "--honest", "--hostile", "--rounds", "--seeds", "--timeout", "--workdir", "--json", "--table", "--as-peer"):
        assert flag in text


def test_scale_payload_keeps_the_payload_well_formed():
    import torch

    from peer.outer.strategies import make_strategy
    from protocol.spec import RunSpec

    spec = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8})
    for strategy in ("sparseloco", "diloco", "dct"):
        s = make_strategy(spec.replace(outer={"strategy": strategy}))
        gen = torch.Generator().manual_seed(0)
        data, pending = s.encode({n: torch.randn(sh, generator=gen) * 1e-2 for n, sh in s.layout.items()}, 0)
        scaled = s.decode(hp.scale_payload(data, 1e2), 0)
        for name, t in pending.sent.items():
            want = t * 1e2  # exact for float32 wires; DCT's fp16 coefficients are rounded again after the scaling
            assert float((scaled[name] - want).abs().max()) <= 1e-2 * float(want.abs().max()) + 1e-9


def test_each_attack_is_compared_with_a_clean_run_of_as_many_honest_trainers():
    assert bh.ATTACKS["poison-1e4"].baseline == "clean" and bh.ATTACKS["state-poison"].baseline == "clean"
    for name in ("stall", "forged-round", "framer", "invented-owners", "forged-records", "record-flood"):
        assert bh.ATTACKS[name].baseline == "honest-only", name
    runs = [dict(attack=a, val_loss=v, mean_round_s=t) for a, v, t in
            [("clean", 2.0, 10.0), ("honest-only", 2.2, 8.0), ("poison-1e4", 2.02, 11.0), ("stall", 2.2, 12.0)]]
    bh.compare(runs)
    by = {r["attack"]: r for r in runs}
    # loss: against 3 honest peers (equal honest tokens) and against 4; time: as many training processes
    assert by["poison-1e4"]["loss_vs_honest"] == pytest.approx(2.02 / 2.2) and by["poison-1e4"]["loss_vs_clean"] == pytest.approx(1.01)
    assert by["poison-1e4"]["time_vs_clean"] == pytest.approx(1.1)
    assert by["stall"]["loss_vs_honest"] == pytest.approx(1.0) and by["stall"]["time_vs_clean"] == pytest.approx(1.5)


def test_seeds_are_paired_with_their_own_clean_runs_and_reported_as_mean_and_std(tmp_path, capsys):
    def run(attack, seed, val, t):
        return dict(attack=attack, seed=seed, val_loss=val, mean_round_s=t, rounds=3, target_rounds=3,
                    hashes_equal=True, honest=3, honest_ok=3, attacker_excluded=["x"] if attack == "negate" else [])

    runs = [run("clean", 0, 2.0, 10.0), run("honest-only", 0, 2.2, 8.0), run("negate", 0, 2.2, 8.0),
            run("clean", 1, 3.0, 10.0), run("honest-only", 1, 3.3, 8.0), run("negate", 1, 3.63, 12.0)]
    for seed in (0, 1):
        bh.compare([r for r in runs if r["seed"] == seed])
    rows = {r["attack"]: r for r in bh.over_seeds(runs)}
    negate = rows["negate"]
    # per seed: +0 % and +10 % against that seed's honest-only, not against the mean of the clean runs
    assert negate["loss_vs_honest"] == pytest.approx(1.05) and negate["loss_vs_honest_std"] == pytest.approx(0.05)
    assert negate["honest"] == negate["honest_ok"] == 6 and negate["seeds"] == [0, 1] and negate["attacker_excluded"] == ["x"]
    out = tmp_path / "h.json"
    out.write_text(json.dumps(dict(results=runs)))
    assert bh.main(["--table", str(out)]) == 0
    text = capsys.readouterr().out
    assert "+5.00 % ± 5.00" in text and "over 2 seeds" in text


def test_a_served_state_poison_changes_theta_but_not_its_layout(monkeypatch):
    import torch

    from peer.round.state_sync import StateSync

    monkeypatch.setattr(StateSync, "shareable_state", lambda self: ({"round": 3}, [torch.ones(4, 4), torch.zeros(2)]))
    hp.serve_poison("shift")
    meta, tensors = StateSync.shareable_state(None)
    assert meta == {"round": 3} and [t.shape for t in tensors] == [(4, 4), (2,)]
    assert all(bool(torch.isfinite(t).all()) for t in tensors) and not torch.equal(tensors[0], torch.ones(4, 4))
    with pytest.raises(SystemExit):
        hp.serve_poison("bogus")


def test_noise_sends_each_tensor_at_its_honest_norm_and_a_new_direction_each_round(monkeypatch):
    import torch

    from peer.outer.engine import RoundEngine

    monkeypatch.setattr(RoundEngine, "encode", RoundEngine.encode)  # put back after the test
    hp.noise("")
    seen = []

    class Strategy:
        layout = ["w", "b"]

        def encode(self, delta, round_no, steps=None):
            seen.append(dict(delta))
            return b"", None

    class Engine:
        round, strategy, lock, _open = 0, Strategy(), threading.Lock(), "unset"

    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(32, 16, generator=gen), "b": torch.randn(16, generator=gen)}
    trained = {n: t - 0.01 * torch.randn(t.shape, generator=gen) for n, t in start.items()}
    engine = Engine()
    RoundEngine.encode(engine, start, trained)
    assert engine._open is None  # the strategy's pending: the round's payload is the open one, as RoundEngine's
    engine.round = 1
    RoundEngine.encode(engine, start, trained)
    for name in start:
        honest = start[name] - trained[name]
        sent = [s[name] for s in seen]
        for d in sent:
            assert float(d.norm()) == pytest.approx(float(honest.norm()), rel=1e-4)
            assert abs(float(torch.nn.functional.cosine_similarity(d.flatten(), honest.flatten(), dim=0))) < 0.5
        assert not torch.equal(sent[0], sent[1])


def test_garbage_peer_trains_the_unchanged_peer_on_random_text(tmp_path):
    argv = bh.garbage_peer(bh.Run("JOIN", "", 3, ["--join", "JOIN", "--threads", "1"], tmp_path))
    assert argv[1:4] == ["-m", "voloco", "peer"] and argv[-2] == "--data"
    data = Path(argv[-1]).read_bytes()
    assert len(data) == 4 << 20 and b"\x00" not in data and max(data) < 128
    data.decode("utf-8")  # the corpus reader takes only utf-8 text


def test_hostile_peers_join_late_only_in_the_late_attacks():
    assert bh.ATTACKS["negate-late"].hostile_late and not bh.ATTACKS["negate"].hostile_late
    assert bh.ATTACKS["state-poison"].late and not bh.ATTACKS["state-poison"].hostile_late
    assert all(bh.ATTACKS[n].peer for n in ("noise", "garbage", "negate-late"))


def test_a_table_from_before_the_rename_reads_clean_3_as_honest_only(tmp_path, capsys):
    runs = [dict(attack=a, seed=0, val_loss=v, mean_round_s=8.0, rounds=3, target_rounds=3, hashes_equal=True,
                 honest=3, honest_ok=3) for a, v in (("clean", 2.0), ("clean-3", 2.2), ("negate", 2.2))]
    out = tmp_path / "old.json"
    out.write_text(json.dumps(dict(results=runs)))
    assert bh.main(["--table", str(out)]) == 0
    text = capsys.readouterr().out
    assert "honest-only" in text and "+0.00 %" in text


def test_several_k_share_one_honest_only_run_per_seed_and_get_a_row_each(tmp_path, capsys):
    def run(attack, k, val, t):
        return dict(attack=attack, k=k, seed=0, val_loss=val, mean_round_s=t, rounds=3, target_rounds=3,
                    hashes_equal=True, honest=3, honest_ok=3)

    runs = [run("honest-only", 0, 2.0, 8.0), run("clean", 1, 1.9, 10.0), run("negate", 1, 2.02, 10.0),
            run("clean", 3, 1.8, 16.0), run("negate", 3, 2.2, 20.0)]
    out = tmp_path / "k.json"
    out.write_text(json.dumps(dict(results=runs)))
    assert bh.main(["--table", str(out)]) == 0
    text = capsys.readouterr().out
    assert "+1.00 %" in text and "+10.00 %" in text and "1.25x" in text
    bh.compare(runs[:3])
    bh.compare(runs[:1] + runs[3:])
    rows = {(r["attack"], r["k"]): r for r in bh.over_seeds(runs)}
    assert rows[("negate", 1)]["loss_vs_honest"] == pytest.approx(1.01) and rows[("negate", 3)]["loss_vs_honest"] == pytest.approx(1.1)
    assert rows[("negate", 3)]["time_vs_clean"] == pytest.approx(1.25)  # against the clean run of its own K


def test_a_bad_hostile_count_is_a_clear_error(capsys):
    for bad in ("0", "x", ","):
        with pytest.raises(SystemExit):
            bh.main(["--hostile", bad, "--quick"])
        assert "--hostile" in capsys.readouterr().err


def test_only_the_hostile_processes_run_niced_and_a_bad_niceness_is_a_clear_error(monkeypatch, tmp_path, capsys):
    started = []

    class Started:  # records each process's argv instead of starting it
        def __init__(self, name, argv, log):
            started.append((name, argv))
            log.write_text("")
            self.proc = type("P", (), dict(poll=lambda self: 0, pid=1000 + len(started)))()

        def stop(self, grace):
            pass

    import voloco.demo as demo
    monkeypatch.setattr(demo, "Child", Started)
    monkeypatch.setattr(demo, "coordinator_up", lambda workdir, toml, children: ("/ip4/127.0.0.1/tcp/1/p2p/x", ""))
    niced = []
    monkeypatch.setattr(bh, "deprioritize", lambda pid, nice: niced.append((pid, nice)))
    spec = bh.make_spec(bh.CONFIGS["quick"])
    bh.run_attack(bh.ATTACKS["silent-fresh"], spec, 2, tmp_path / "run", timeout=1.0, honest=2, hostile=1, nice=19)
    assert len(started) == 3 and niced == [(1003, 19)]  # the coordinator is not a Child here; peer 2 is hostile
    with pytest.raises(SystemExit):
        bh.main(["--quick", "--nice-hostile", "20"])
    assert "--nice-hostile" in capsys.readouterr().err


def test_the_clean_run_of_n_plus_k_is_added_only_where_an_attacker_trains(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(bh, "run_attack", lambda attack, *a, **k: ran.append(attack.name) or dict(
        attack=attack.name, rounds=2, target_rounds=2, val_loss=2.0, honest=3, honest_ok=3, wall_s=1.0,
        mean_round_s=1.0, hashes_equal=True, initial_val_loss=5.0))
    assert bh.main(["--quick", "--attacks", "stall", "--workdir", str(tmp_path)]) == 0
    assert ran == ["honest-only", "stall"]
    ran.clear()
    assert bh.main(["--quick", "--attacks", "stall,negate", "--workdir", str(tmp_path)]) == 0
    assert ran == ["honest-only", "clean", "stall", "negate"]


def test_an_attacked_run_on_the_honest_only_theta_is_counted_and_sequential_runs_have_no_overlap():
    def run(attack, seed, final_hash):
        return dict(attack=attack, seed=seed, k=0 if attack == "honest-only" else 1, val_loss=2.0, mean_round_s=8.0,
                    rounds=3, target_rounds=3, hashes_equal=True, honest=3, honest_ok=3, final_hash=final_hash)

    runs = [run("honest-only", 0, "aa"), run("stall", 0, "aa"), run("honest-only", 1, "bb"), run("stall", 1, "cc")]
    for seed in (0, 1):
        bh.compare([r for r in runs if r["seed"] == seed])
    assert [r["same_theta"] for r in runs] == [None, True, None, False]
    assert {r["attack"]: r["same_theta"] for r in bh.over_seeds(runs)} == {"honest-only": "-", "stall": "1/2"}
    spec = bh.make_spec(bh.CONFIGS["quick"], seed=1, sequential=True)
    assert not spec.outer.overlap and spec.outer.min_inner_fraction == 1.0 and spec.seed == 1
    assert bh.make_spec(bh.CONFIGS["quick"]).outer.overlap  # the spec's default otherwise


def test_baselines_from_other_runs_pool_each_seeds_honest_runs_into_their_mean(tmp_path, capsys):
    def run(attack, seed, val, t=8.0):
        return dict(attack=attack, seed=seed, val_loss=val, mean_round_s=t, round_period_s=t / 2, rounds=3,
                    target_rounds=3, hashes_equal=True, honest=3, honest_ok=3, k=0 if attack == "honest-only" else 1)

    table, other = tmp_path / "table.json", tmp_path / "other.json"
    table.write_text(json.dumps(dict(results=[run("honest-only", 0, 2.0), run("stall", 0, 2.1, 12.0)])))
    # another run's honest runs of seed 0 (and one of a seed the table has not: left out)
    other.write_text(json.dumps(dict(results=[run("honest-only", 0, 2.2, 10.0), run("honest-again", 0, 2.1, 12.0),
                                              run("stall", 0, 9.9), run("honest-only", 5, 9.9)])))
    assert bh.main(["--table", str(table), "--baselines-from", str(other)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line[:1].isalpha()}
    assert "2.1000" in rows["honest-only"] and "9/9" in rows["honest-only"] and "5.0 s" in rows["honest-only"]  # three runs
    assert "+0.00 %" in rows["stall"] and "1.20x" in rows["stall"]  # the other file's stall run is not the table's
    with pytest.raises(SystemExit):
        bh.main(["--baselines-from", str(other)])
    assert "needs --table" in capsys.readouterr().err
    sequential = tmp_path / "sequential.json"  # runs of another mode: their honest runs are no baseline of these
    sequential.write_text(json.dumps(dict(results=[run("honest-only", 0, 2.0)], sequential=True)))
    with pytest.raises(SystemExit):
        bh.main(["--table", str(table), "--baselines-from", str(sequential)])
    assert "differ from the table's in sequential" in capsys.readouterr().err


def test_round_period_counts_the_first_round_and_not_overlapping_spans():
    """A round's period is wall time from the first step to the last round's end, over the rounds:
    records whose spans overlap (overlap) do not add up, and records without ``ended`` give None."""
    history = [dict(seconds=12.0, ended=112.0), dict(seconds=15.0, ended=122.0), dict(seconds=14.0, ended=130.0)]
    assert bh.round_period(history) == pytest.approx((130.0 - 100.0) / 3)
    assert bh.round_period(history, after_first=True) == pytest.approx((130.0 - 112.0) / 2)
    assert bh.round_period(history[:1], after_first=True) is None
    assert bh.round_period([dict(seconds=12.0)]) is None and bh.round_period([]) is None
    runs = [dict(attack=a, val_loss=2.0, mean_round_s=t, round_period_s=p) for a, t, p in
            [("honest-only", 10.0, 8.0), ("stall", 14.0, 10.0)]]
    bh.compare(runs)
    stall = runs[1]
    assert stall["time_vs_clean"] == pytest.approx(1.4) and stall["period_vs_clean"] == pytest.approx(1.25)


def test_a_deprioritized_session_yields_the_cpu_to_other_sessions_not_only_within_its_own():
    """bench/common.py's ``deprioritize``: a peer started with a session of its own (voloco/demo.py's
    ``Child``) and niced only per process still took a full CPU share from the honest peers' sessions
    under Linux autogroup; its session's group must be niced too."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from bench.common import deprioritize

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        deprioritize(proc.pid, 19)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 19
        group = Path(f"/proc/{proc.pid}/autogroup")
        if group.exists():  # Linux with autogroup: the session is niced as a whole
            assert group.read_text().split()[-1] == "19"
    finally:
        proc.kill()
        proc.wait()


def test_covert_keeps_indices_and_signs_of_the_inner_bins_and_negates_the_outer_ones_at_the_honest_norm():
    import torch

    from peer.outer.strategies import make_strategy
    from protocol.spec import RunSpec

    strategy = make_strategy(RunSpec(run_id="covert"))
    gen = torch.Generator().manual_seed(0)
    data, _ = strategy.encode({n: torch.randn(s, generator=gen) for n, s in strategy.layout.items()}, 0)
    honest, bad = strategy.decode(data, 0), strategy.decode(hp.covert_payload(data), 0)
    flipped = 0
    for name, h in honest.items():
        b = bad[name]
        assert torch.equal(h != 0, b != 0)  # the same coordinates
        against = (torch.sign(h) != torch.sign(b)) & (h != 0)
        if bool(against.any()):
            flipped += 1
            assert float(b.norm()) == pytest.approx(float(h.norm()), rel=1e-3)
            assert int(against.sum()) < int((h != 0).sum()) / 2  # most signs agree
            assert float((b[against] * h[against]).sum().neg()) > 0.99 * float((b * b).sum()) ** 0.5 * float(h[against].norm())
    assert flipped > len(honest) / 2


def test_negate_big_negates_the_largest_fifth_of_the_tensors_only(monkeypatch):
    import torch

    from peer.outer.engine import RoundEngine

    monkeypatch.setattr(RoundEngine, "encode", RoundEngine.encode)  # put back after the test
    hp.negate_big("")
    seen = []

    class Strategy:
        layout = {f"t{i}": (i + 1, 4) for i in range(10)}

        def encode(self, delta, round_no, steps=None):
            seen.append(dict(delta))
            return b"", None

    class Engine:
        round, strategy, lock, _open = 0, Strategy(), threading.Lock(), "unset"

    start = {n: torch.ones(s) for n, s in Strategy.layout.items()}
    trained = {n: torch.zeros(s) for n, s in Strategy.layout.items()}
    RoundEngine.encode(Engine(), start, trained)
    assert {n for n, d in seen[0].items() if bool((d < 0).all())} == {"t9", "t8"}
    assert all(bool((d > 0).all()) for n, d in seen[0].items() if n not in ("t9", "t8"))
    for bad in ("half", "0", "1.5", "nan"):
        with pytest.raises(SystemExit, match="a share of the tensors"):
            hp.negate_big(bad)
