"""protocol/round/named_sets.py: what records named of their groups' sets, kept across reads,
bounded by the view and a few rounds a peer."""

from __future__ import annotations

from types import SimpleNamespace

from protocol.dht.records import Progress
from protocol.round.named_sets import NamedSets, named_late, settled


def _view(peer, gathered_round, name, source="a" * 16, at=None):
    # (a record at a later round than its gather: concluded, unless ``at`` says otherwise)
    return SimpleNamespace(peer_id=peer, progress=SimpleNamespace(
        round=gathered_round + 1 if at is None else at, gathered_round=gathered_round, gathered=name, gathered_from=source))


def test_a_record_of_a_round_is_kept_after_the_peer_moved_on():
    named = NamedSets()
    named.note([_view("p", 5, "s5")])
    named.note([_view("p", 6, "s6")])
    assert named.record("p", 5, "s5").gathered_from == "a" * 16
    assert named.record("p", 6, "s6") is not None
    assert named.record("p", 5, "s6") is None  # another name for that round: not what it said
    assert named.record("q", 5, "s5") is None


def test_memory_is_bounded_by_rounds_and_by_the_peers_of_the_last_read():
    named = NamedSets(rounds=2)
    for r in range(1, 40):  # a peer naming a new round at every read keeps its last two
        named.note([_view("p", r, f"s{r}"), _view("q", 1, "q1")])
    assert [r for r in range(1, 40) if named.record("p", r, f"s{r}")] == [38, 39]
    assert named.record("q", 1, "q1") is not None
    named.note([_view("p", 39, "s39")])  # q left the view: forgotten
    assert named.record("q", 1, "q1") is None and named.record("p", 38, "s38") is not None


def test_records_that_name_no_set_are_not_kept():
    named = NamedSets()
    named.note([_view("p", 0, ""), _view("p", 3, "")])
    assert named.record("p", 0, "") is None and named.record("p", 3, "") is None


def test_a_record_still_in_its_rounds_merge_is_not_kept():
    named = NamedSets()
    merging = _view("p", 5, "s5", at=5)
    assert not settled(merging.progress) and settled(_view("p", 5, "s5").progress)
    named.note([merging])
    assert named.record("p", 5, "s5") is None
    named.note([_view("p", 5, "s5")])
    assert named.record("p", 5, "s5") is not None
    assert NamedSets(rounds=0).rounds == 1  # never unbounded


BASE, OTHER = "b" * 16, "c" * 16


def _record(peer, rnd, gathered_round, gathered, before="", source=BASE, part=-1, state="training"):
    return SimpleNamespace(peer_id=peer, progress=Progress(
        round=rnd, step=0, state=state, spec="", loss=0.0, val_loss=0.0, tokens=0, tokens_per_s=0.0, bytes_sent=0,
        bytes_received=0, params_hash="", part=part, gathered_round=gathered_round, gathered=gathered,
        gathered_before=before, gathered_from=source))


def test_sets_named_late_are_those_of_our_part_concluded_on_our_base():
    """A group that named its set after our merge stopped waiting (peer/round/union.py ``take_named_sets``,
    which bounds what names only strangers give cost: tests/round/test_late_sets.py)."""
    views = [
        _record("b1", 6, 5, "setB"), _record("b2", 6, 5, "setB"),  # concluded round 5 from our base
        _record("a1", 6, 5, "setA"),  # our own group's set: held
        _record("x", 6, 5, "setX"),  # a stranger naming a set: named here, its cost bounded by the caller
        _record("c1", 6, 5, "setC", source=OTHER),  # applied to another θ: another lineage
        _record("d1", 5, 5, "setD"),  # still merging round 5: not concluded, the claim may be withdrawn
        _record("s1", 6, 5, "setS", part=2),  # a slice owner: another part's sets
    ]
    assert named_late(views, 5, BASE, {"setA"}, -1) == {"setB": ["b1", "b2"], "setX": ["x"]}
    assert named_late(views, 5, "", {"setA"}, -1) == {}  # no base of our own: nothing to apply to


def test_a_peer_that_named_its_next_set_counts_by_what_an_earlier_read_kept():
    kept = NamedSets()
    kept.note([_record("b1", 6, 5, "setB")])
    later = [_record("b1", 7, 6, "setB6", before="setB", source=OTHER)]  # its round 6 set, applied to round 6's θ
    kept.note(later)
    assert named_late(later, 5, BASE, (), -1, kept) == {"setB": ["b1"]}
    assert named_late(later, 5, BASE, (), -1) == {}  # nothing kept: its base for round 5 is unknown
