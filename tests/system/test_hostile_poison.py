"""A groupmate poisons its payload (values x1e4) in a real swarm of 3 honest peers: every honest peer
keeps running and ends with the same parameters, the loss still drops, the attacker is clipped."""

import pytest

from bench import hostile as bh

pytestmark = pytest.mark.slow


def test_poisoned_payload_is_clipped_and_honest_peers_go_on(tmp_path):
    spec = bh.make_spec(bh.CONFIGS["quick"])
    r = bh.run_attack(bh.ATTACKS["poison-1e4"], spec, rounds=3, workdir=tmp_path, timeout=240)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(tmp_path.glob("peer*.log")))
    assert r["honest"] == 3 and r["exit_codes"] == [0, 0, 0], logs  # no honest process exited with an error
    assert r["honest_ok"] == 3 and r["rounds"] == 3, logs
    assert r["hashes_equal"], r
    assert r["val_loss"] < r["initial_val_loss"] - 0.1, r  # the loss drops (it went to 1.6e8 before the clipping)
    assert r["attacker_clipped"], r
    # clipping answers its size: no round refused it for that (a fresh sender may still be refused in a
    # round where its direction does not yet agree enough with the others', as an honest one may be)
    size = ("non-finite", "at or above the bound", "outer step would leave")
    reasons = [why for whys in r["attacker_excluded_why"].values() for why in whys]
    assert not [why for why in reasons if any(s in why for s in size)], r
