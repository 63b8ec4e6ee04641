"""protocol/round/named_sets.py: what records named of their groups' sets, kept across reads,
bounded by the view and a few rounds a peer."""

from __future__ import annotations

from types import SimpleNamespace

from protocol.round.named_sets import NamedSets, settled


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
