"""The CUDA path in real processes: a peer that trains on a GPU and one that trains on the CPU, over
hivemind on loopback, end every round they share on the same θ.

The GPU peer's inner steps run in bf16 autocast (``inner.precision = "auto"``) and it encodes its
pseudo-gradient on the GPU; the CPU peer trains in fp32. Both decode the same agreed bytes and
apply the outer step on the CPU in float32, so their parameter hashes match round by round.

Skipped where ``torch.cuda.is_available()`` is False (CI, laptops).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.swarm_harness import Swarm, assert_groups_identical, refused_by_checks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]


@pytest.mark.parametrize("strategy,compiled", [("sparseloco", False), ("diloco", False), ("sparseloco", True)])
def test_a_cuda_peer_and_a_cpu_peer_share_every_round_bit_identically(tmp_path, strategy, compiled):
    """``compiled``: the GPU peer runs with --compile (its forward pass through torch.compile; the
    default on CUDA), else with --no-compile."""
    swarm = Swarm(tmp_path, strategy=strategy)
    try:
        swarm.add_peer("gpu", "--device", "cuda", "--compile" if compiled else "--no-compile")
        swarm.add_peer("cpu", "--device", "cpu")
        swarm.wait(lambda: min(swarm.round_of("gpu"), swarm.round_of("cpu")) >= 4, 240, "four rounds of both peers")
        swarm.wait_shared(("gpu", "cpu"), 3, 120, "rounds of both peers in one group")
        gpu, cpu = swarm.status("gpu"), swarm.status("cpu")
        assert gpu["device"].startswith("cuda") and gpu["precision"] == "bf16", (gpu["device"], gpu["precision"])
        assert cpu["device"] == "cpu" and cpu["precision"] == "fp32", (cpu["device"], cpu["precision"])
        assert gpu["compiled"] is compiled and cpu["compiled"] is False
        assert assert_groups_identical([gpu, cpu]) >= 3
        start = max(s["initial_val_loss"] for s in (gpu, cpu))
        for s in (gpu, cpu):
            assert s["val_loss"] < start - 0.3, (s["device"], start, s["val_loss"])
    finally:
        swarm.close()


SMALL = ("--max-memory-gb", "0.009")  # below the tiny run's full replica: these peers form a chain


@pytest.mark.parametrize("stage_devices", [("cuda", "cuda"), ("cuda", "cpu")])
def test_a_chain_on_cuda_trains_beside_a_full_cuda_peer_and_ends_shared_rounds_on_its_theta(tmp_path, stage_devices):
    """Two chain stages (both on the GPU, or one on the GPU and one on the CPU) and a full peer on the
    GPU: the chain trains (activations cross its link) and every round the three share ends on one θ.
    Before chain stages moved their batch to their device, a CUDA stage died at its first step."""
    swarm = Swarm(tmp_path, strategy="sparseloco", inner_steps=20)
    try:
        swarm.add_peer("full", "--device", "cuda")
        swarm.add_peer("s1", "--device", stage_devices[0], *SMALL)
        swarm.add_peer("s2", "--device", stage_devices[1], *SMALL)
        shared = lambda: [r for r in (swarm.status("full") or {}).get("history", [])  # noqa: E731
                          if len(r["group"]) == 3]
        swarm.wait(lambda: (swarm.status("s1") or {}).get("chain") is not None and len(shared()) >= 2, 300,
                   "rounds of the chain with the full peer")
        full, s1, s2 = swarm.status("full"), swarm.status("s1"), swarm.status("s2")
        assert s1["chain"] == s2["chain"]
        assert [s1["device"].split(":")[0], s2["device"].split(":")[0]] == list(stage_devices)
        assert full["device"].startswith("cuda")
        assert s1["link_tokens"] > 0 and s2["link_tokens"] > 0
        for s in (full, s1, s2):  # what the process ran on, not only the flag it was given
            on_gpu = s["device"].startswith("cuda")
            assert (s["device_peak_bytes"] or 0) > 0 if on_gpu else s["device_peak_bytes"] is None, s
            assert s["precision"] == ("bf16" if on_gpu else "fp32"), s
        assert sorted(tuple(s["part"]) for s in (s1, s2))[0][0] == 0  # both stages of one chain, one of them first
        assert assert_groups_identical([full, s1, s2]) >= 2
        for r in shared():  # a stage's update left out only by the round's checks, alike on every member
            assert all(refused_by_checks(r, p) for p in r["excluded"]), r["excluded"]
        for name in ("s1", "s2"):
            assert "Traceback" not in swarm.peers[name].text()
    finally:
        swarm.close()
