"""Who of a group sends a payload in a round of at most K a part (peer/exchange/matchmaking.senders_of,
peer/round/draw.senders): each member decides with its own lineage and says so in its announcement;
the group reads the decision from the announcements, which every member holds alike."""

from __future__ import annotations

import torch
from hivemind.p2p import PeerID

from peer.exchange.matchmaking import senders_of
from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from peer.round import draw
from protocol.round import eligibility
from protocol.round.reconcile import announcement, parse_announcement
from protocol.spec import RunSpec
from protocol.wire.signed import Signer


def _peer(i: int) -> PeerID:
    return PeerID(Signer.generate().peer_id)


def test_the_senders_are_the_members_that_announced_a_part_whatever_each_member_starts_from():
    peers = [_peer(i) for i in range(4)]
    announced = {peers[0]: parse_announcement(announcement(3, "h1", part=-1)),
                 peers[1]: parse_announcement(announcement(3, "h2")),  # another θ, not sending: no part
                 peers[2]: parse_announcement(announcement(3, "h2", part=(0, 2))),
                 peers[3]: parse_announcement(announcement(3, "h1"))}
    senders, parts = senders_of(announced)
    assert senders == sorted([peers[0].to_bytes(), peers[2].to_bytes()])
    assert parts == {peers[0].to_bytes(): -1, peers[2].to_bytes(): (0, 2)}


def test_a_member_announces_its_part_only_when_its_lineage_lets_it_send():
    spec = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
                             outer={"max_contributions": 2})
    theta = {n: torch.zeros(s) for n, s in spec.param_shapes().items()}
    engine = RoundEngine(make_strategy(spec), theta)
    payload, _ = engine.encode(theta, {n: t + 0.01 for n, t in theta.items()})
    assert draw.senders(engine, "h", payload, "me") == {"senders": True, "part": -1}  # an empty table: everyone sends
    engine.install(theta, 0, eligibility={"-1": 1})  # p = 2^-20: almost nobody
    names = [f"peer{i}" for i in range(20)]
    sends = [draw.senders(engine, "h", payload, n)["part"] for n in names]
    assert sends.count(None) >= 19
    assert [n for n, part in zip(names, sends) if part is not None] == sorted(
        eligibility.contributors({n: -1 for n in names}, "h:0", engine.eligibility, engine.standing))
    off = RoundEngine(make_strategy(spec.replace(outer={"max_contributions": 0})), theta)
    assert draw.senders(off, "h", payload, "me") == {}
