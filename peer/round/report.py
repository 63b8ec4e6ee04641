"""What a peer tells people: one log line a round, its status as JSON, its running totals."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import torch

from peer.outer.robust import REFUSED
from protocol.round import reconcile
from swarm.cpu_meter import HelperCpu
from swarm.console import human_bytes
from swarm.jsonout import write_atomic

logger = logging.getLogger("voloco.peer")


@dataclass
class RoundRecord:
    round: int
    params_hash: str
    group: List[str]
    contributors: int
    excluded: Dict[str, str]
    bytes_sent: int  # payload bytes of the round's exchange: the gather, the sets and payloads fetched after it
    bytes_received: int
    loss: float
    val_loss: float
    seconds: float  # from the round's first inner step to its θ (with overlap, rounds' spans overlap)
    waited: float = 0.0  # seconds at the round's barrier, waiting for the peers of the round
    resynced: bool = False  # it started off the group's parameters and downloaded them after the round
    steps: int = 0  # inner steps trained for the round (fewer than H: closed early, peer/round/early_close.py)
    # sender -> the smallest scale the median-norm clip applied to one of its tensors, for the updates it
    # scaled (peer/outer/robust.py); this peer's own among them is what it lost of its round's update
    clipped: Dict[str, float] = field(default_factory=dict)
    short: Dict[str, int] = field(default_factory=dict)  # sender -> the inner steps its payload covered, where fewer than H
    overlapped: int = 0  # of them, steps taken while the previous round's exchange was still in flight
    util: float = float("nan")  # compute utilization since the previous round ended (peer/host/utilization.py)
    wire_sent: Optional[int] = None  # every TCP byte the peer's processes sent since the previous round ended
    wire_received: Optional[int] = None  # (swarm/wire/meter.py); None where the kernel's counters cannot be read
    sets: int = 1  # the groups' agreed sets θ was computed from: this peer's group's and other groups' (peer/round/merge.py)
    # CPU seconds of the round's exchange: the thread that ran it here (encode to outer step, evaluation
    # not counted; torch's intra-op worker threads neither: none with --threads 1), and the peer's DHT,
    # gather and p2p daemon processes since its previous record (a deferred round writes none: its
    # seconds count in the next record; swarm/cpu_meter.py)
    exchange_cpu: float = 0.0
    helpers_cpu: Optional[float] = None
    # of ``helpers_cpu``, the seconds from the end of the round's inner steps to its record: the helpers'
    # share of the exchange itself, without what they spent while the peer trained (serving others' reads,
    # heartbeats: a cost per second of wall time, not per round)
    helpers_exchange_cpu: Optional[float] = None
    exchange_s: float = 0.0  # wall seconds from the end of the round's inner steps to its record
    # of them: matchmaking and the group's gather (or, where it failed, taking a set named without us), then
    # the repair of the last round's union and the merge of this round's other groups' sets
    gather_s: float = 0.0
    merge_s: float = 0.0
    # when the round ended (Unix time, this host's clock): successive records' ``ended`` give the
    # rounds' period, what a run's rounds per hour follow (``seconds`` overlaps the next round's steps)
    ended: float = 0.0
    # members that held our requests, or strangers a later agreement round stopped waiting for (the
    # gather's ``held`` and ``lagged``): this peer's judgement, no mates of the next barrier
    held: List[str] = field(default_factory=list)

    def mates(self, me: str) -> Set[str]:
        """The round's groupmates, as the next barrier waits for them and a lineage counts them: every
        member but ``me``, those excluded for sending nothing in time (struck and refused in
        matchmaking: a new identity that joined only to hold the group would otherwise be waited for
        the whole allowance the next round, and be no stranger; tests/round/test_strangers.py) and those that
        held our requests (``held``: a new identity whose payload one member relayed was waited for 6.7 s
        the next round; a member that trains that round is still waited for as any peer of it)."""
        return set(self.group) - {me} - self.judged(me)

    def refused(self) -> Set[str]:
        """The senders whose contribution the round's checks refused (direction, values: ``robust.REFUSED``),
        not those excluded for how it was delivered (a fetch that timed out, a list that misstated parts:
        possibly another peer's doing); tests/round/test_strangers.py::test_a_sender_whose_update_was_refused_is_still_a_stranger."""
        return {s for s, why in self.excluded.items() if why.startswith(REFUSED)}

    def judged(self, me: str) -> Set[str]:
        """The round's members that are no mates: excluded for sending nothing in time, or ``held``."""
        silent = {m for m, why in self.excluded.items() if why == reconcile.SILENT}
        return (set(self.held) | silent) & (set(self.group) - {me})


class RoundMeters:
    """What a round cost that only counters tell: every TCP byte the peer's processes sent and received
    (``peer.wire``: swarm/wire/meter.py) and the CPU seconds of its helper processes, since the
    previous round ended, split where the round's inner steps ended (``exchange_began``)."""

    def __init__(self, peer):
        self._peer = peer
        self._wire_mark = (0, 0)  # the wire totals (sent, received) when the previous round ended
        # the DHT's process (p2pd is its child) and the gather's; the start-up's seconds are not a round's
        self._cpu = HelperCpu(lambda: (getattr(getattr(peer, n, None), "pid", None) for n in ("dht", "gatherer")))
        self._cpu.since_last()
        self._before: Optional[float] = 0.0  # helper seconds of the rounds' training since the last record
        self._began: Optional[float] = None  # when the last round's inner steps ended (monotonic)

    def exchange_began(self) -> None:
        """The round's inner steps ended: what the helpers spent until now was while the peer trained."""
        spent = self._cpu.since_last()
        self._before = None if spent is None or self._before is None else self._before + spent
        self._began = time.monotonic()

    def fill(self, record: RoundRecord) -> None:
        meter = getattr(self._peer, "wire", None)
        totals = meter.totals(fresh=False) if meter is not None else None  # new sockets: from the meter's next dump
        if totals is None:
            record.wire_sent = record.wire_received = None  # unknown
        else:
            (sent0, received0), self._wire_mark = self._wire_mark, (totals.sent, totals.received)
            record.wire_sent, record.wire_received = totals.sent - sent0, totals.received - received0
        exchange, before, self._before = self._cpu.since_last(), self._before, 0.0
        record.exchange_s = 0.0 if self._began is None else time.monotonic() - self._began
        record.helpers_exchange_cpu = exchange
        record.helpers_cpu = None if exchange is None or before is None else before + exchange


@dataclass
class Totals:
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    history: List[RoundRecord] = field(default_factory=list)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t))


def log_phases(round_no: int, t0: float, trained: float, encoded: float, waited: float, gathered: float,
               applied: float, evaluating: float, ended: float) -> None:
    """A debug line: how long each phase of round ``round_no`` took (monotonic times, in order)."""
    logger.debug(
        f"round {round_no} timing: train {trained - t0:.2f} s, encode {encoded - trained:.2f} s, "
        f"wait {waited - encoded:.2f} s, gather {gathered - waited:.2f} s, apply {applied - gathered:.2f} s, "
        f"eval {ended - evaluating:.2f} s"
    )


def log_round(record: RoundRecord, tokens_per_s: float) -> None:
    excluded = f" ({len(record.excluded)} excluded)" if record.excluded else ""
    if record.sets > 1:
        excluded += f" + {record.sets - 1} other group(s), {record.contributors} payloads"
    overlapped = f" ({record.overlapped} overlapped)" if record.overlapped else ""
    wire = "" if record.wire_sent is None else (
        f" (wire {human_bytes(record.wire_sent)} / {human_bytes(record.wire_received or 0)}, control plane included)")
    logger.info(
        f"round {record.round} done | group {len(record.group)}{excluded} "
        f"| loss {record.loss:.3f} | val {record.val_loss:.3f} | {tokens_per_s / 1e3:.1f}k tok/s "
        f"| sent {human_bytes(record.bytes_sent)} recv {human_bytes(record.bytes_received)}{wire} "
        f"| {record.steps} steps{overlapped} | util {record.util:.0%} | {record.seconds:.1f} s | θ {record.params_hash}"
    )


def write_status(path: Optional[Path], status: Dict[str, Any]) -> None:
    """The status as JSON in ``path``, replaced atomically (readers never see half a file)."""
    if path is None:
        return
    write_atomic(path, status)  # strict JSON: an unknown loss (NaN) is written as null


def states_of(views) -> str:
    """How many records of a view are in each (state, round), for a log line."""
    counts: Dict[str, int] = {}
    for v in views:
        key = f"{v.progress.state} in round {v.progress.round}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"
