"""The DHT key layout: one well-known key lists the runs; everything else lives under a run's id."""

RUNS_KEY = "voloco_runs"  # subkey: run id, value: the run spec (protocol/spec.py, msgpack)


def spec_key(run_id: str) -> str:
    """The run spec, published by the coordinator."""
    return f"{run_id}_spec"


def peers_key(run_id: str) -> str:
    """Progress records, one subkey per peer id (see protocol/records.py)."""
    return f"{run_id}_peers"


def averager_prefix(run_id: str) -> str:
    """hivemind's matchmaking and state-sharing prefix (no dots allowed there)."""
    return f"{run_id}_avg"
