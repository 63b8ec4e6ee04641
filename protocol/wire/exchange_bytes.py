"""What the exchange would cost by formula, for the simulation's byte counts (peer/round/simulate.py)
and the benchmarks that set SparseLoCo's all-gather against a data-parallel all-reduce
(tests/round/test_simulate.py)."""

from __future__ import annotations

__all__ = ["allreduce_bytes_per_step", "allgather_bytes_per_round"]


def allreduce_bytes_per_step(num_params: int, replicas: int, bytes_per_value: int = 4) -> float:
    """Bytes one peer sends (and receives) in a ring all-reduce of ``num_params`` values.

    A ring all-reduce is a reduce-scatter then an all-gather, each R−1 steps of 1/R of the
    tensor: 2·(R−1)/R · bytes_per_value · num_params per peer. 0 for a single replica.
    """
    if replicas <= 1:
        return 0.0
    return 2.0 * (replicas - 1) / replicas * bytes_per_value * num_params


def allgather_bytes_per_round(payload_bytes: int, group: int) -> int:
    """Bytes one member sends (≈ receives) in the exchange's all-gather: its payload to G−1 members."""
    return max(0, group - 1) * payload_bytes
