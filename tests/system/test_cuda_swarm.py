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

from tests.support.swarm_harness import Swarm, assert_groups_identical

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]


@pytest.mark.parametrize("strategy,compiled", [("sparseloco", False), ("diloco", False), ("sparseloco", True)])
def test_a_cuda_peer_and_a_cpu_peer_share_every_round_bit_identically(tmp_path, strategy, compiled):
    """``compiled``: the GPU peer runs with --compile (its forward pass through torch.compile)."""
    swarm = Swarm(tmp_path, strategy=strategy)
    try:
        swarm.add_peer("gpu", "--device", "cuda", *(["--compile"] if compiled else []))
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
