"""peer/exchange/set_lists.py without a network: a set's list and one owner's envelope served from a
set held whole or from what we fetched as a list, checked by the asker under the set's name;
malformed asks and sets we do not hold get a code, and what we keep to serve on stays bounded."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture

from peer.exchange.bounds import keep_bounded
from peer.exchange.set_lists import KEEP_LISTS, KEEP_MEMBERS
from protocol.round.group_sets import DIGEST_CHARS, pack_set, set_digest
from protocol.round.set_manifests import open_manifest, open_member, pack_manifest
from tests.exchange.test_exchange_bounds import MATE, collect, context, gatherer
from tests.protocol.test_group_sets import ROUND, agreed_set
from tests.support.agreement_sim import MAX_PAYLOAD, RUN


def server():
    g = gatherer()
    g._fetched, g._merged = OrderedDict(), OrderedDict()
    g._fetched_lists, g._fetched_members, g._packed_lists = OrderedDict(), OrderedDict(), OrderedDict()
    g._opened_lists, g._served_members = OrderedDict(), OrderedDict()
    g._max_group_size, g._max_payload_bytes, g._run = 16, MAX_PAYLOAD, RUN
    return g


def ask(buffer: bytes) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=buffer))


def answer(g, rpc, buffer: bytes):
    msgs = asyncio.run(collect(getattr(g, rpc)(ask(buffer), context(MATE))))
    if len(msgs) == 1 and msgs[0].code != averaging_pb2.NO_CODE:
        return msgs[0].code
    return b"".join(m.tensor_part.buffer for m in msgs)


def test_a_set_held_whole_is_served_as_its_list_and_one_envelope_at_a_time():
    g = server()
    binding, envelopes, payloads = agreed_set(0, 3)
    name = set_digest(binding.context, payloads)
    g._fetched[name.encode()] = pack_set(binding, envelopes)
    manifest = open_manifest(answer(g, "rpc_fetch_manifest", name.encode()), RUN, ROUND, name, 16)
    for owner in binding.members:
        envelope = answer(g, "rpc_fetch_member", name.encode() + owner)
        assert open_member(manifest, owner, envelope, MAX_PAYLOAD) == payloads[owner]


def test_a_list_fetched_is_served_on_with_only_the_envelopes_fetched():
    g = server()
    binding, envelopes, payloads = agreed_set(0, 3)
    name = set_digest(binding.context, payloads)
    a, b = binding.members[:2]
    keep_bounded(g._fetched_lists, name.encode(), pack_manifest(binding, envelopes), KEEP_LISTS, None)
    keep_bounded(g._fetched_members, (name.encode(), a), envelopes[a], KEEP_MEMBERS, None)
    assert open_manifest(answer(g, "rpc_fetch_manifest", name.encode()), RUN, ROUND, name, 16).digest == name
    assert answer(g, "rpc_fetch_member", name.encode() + a) == envelopes[a]
    assert answer(g, "rpc_fetch_member", name.encode() + b) == averaging_pb2.BAD_GROUP_ID


def test_unknown_sets_malformed_asks_and_a_garbled_set_get_a_code():
    g = server()
    g._fetched[b"g" * 32] = b"\xc1 not msgpack"
    for rpc, buffer in (("rpc_fetch_manifest", b"0" * 32), ("rpc_fetch_manifest", b"short"),
                        ("rpc_fetch_manifest", b"g" * 32), ("rpc_fetch_member", b"g" * 32 + b"owner"),
                        ("rpc_fetch_member", b"0" * 32), ("rpc_fetch_member", b"0" * 32 + b"x" * 65)):
        assert answer(g, rpc, buffer) == averaging_pb2.BAD_GROUP_ID, (rpc, buffer)


def test_what_is_kept_to_serve_on_is_bounded():
    kept = OrderedDict()
    for i in range(KEEP_MEMBERS + 10):
        keep_bounded(kept, i, b"x" * 1000, KEEP_MEMBERS, 20_000)
    assert len(kept) == 20 and list(kept)[-1] == KEEP_MEMBERS + 9
    lists = OrderedDict()
    for i in range(KEEP_LISTS + 5):
        keep_bounded(lists, i, b"x", KEEP_LISTS, None)
    assert len(lists) == KEEP_LISTS


def test_only_lists_and_envelopes_that_check_out_are_kept_to_serve_on():
    g = server()
    binding, envelopes, payloads = agreed_set(0, 3)
    name = set_digest(binding.context, payloads)
    a, b = binding.members[:2]
    g._keep_list(name, b"\xc1 garbage")
    g._keep_member(name, a, envelopes[a])  # no list of its set held: nothing to check it against
    assert not g._fetched_lists and not g._fetched_members
    g._keep_list(name, pack_manifest(binding, envelopes))
    g._keep_member(name, a, envelopes[b])  # b's envelope for a's entry
    g._keep_member(name, a, envelopes[a])
    assert list(g._fetched_lists) == [name.encode()] and list(g._fetched_members) == [(name.encode(), a)]


def test_a_list_is_checked_once_not_once_for_every_envelope_fetched_against_it(monkeypatch):
    """A 32-peer profile put a third of the averager's CPU in checking a list's signatures again for
    each envelope fetched against it; the list checked once is kept, bounded as the lists are."""
    import peer.exchange.set_lists as set_lists

    g = server()
    binding, envelopes, payloads = agreed_set(0, 3)
    name = set_digest(binding.context, payloads)
    opened = []
    real = set_lists.set_manifests.open_manifest
    monkeypatch.setattr(set_lists.set_manifests, "open_manifest", lambda *a: opened.append(a) or real(*a))
    g._keep_list(name, pack_manifest(binding, envelopes))
    for owner in binding.members:
        g._keep_member(name, owner, envelopes[owner])
    assert len(opened) == 1
    assert [owner for _, owner in g._fetched_members] == list(binding.members)
    g._keep_list(f"{0:032d}", pack_manifest(binding, envelopes))  # under a name it does not match: not kept
    assert list(g._opened_lists) == [name.encode()]
    for i in range(KEEP_LISTS):  # bounded as the raw lists are
        other, others_envelopes, others_payloads = agreed_set(0, 2, group_id=b"group-%d" % i)
        g._keep_list(set_digest(other.context, others_payloads), pack_manifest(other, others_envelopes))
    assert len(g._opened_lists) == len(g._fetched_lists) == KEEP_LISTS and name.encode() not in g._opened_lists


def test_an_envelope_is_made_once_and_the_one_copy_served_to_every_asker(monkeypatch):
    """Each request for one of our groups' envelopes hashed the payload and packed a copy of it (69 ms
    a request at 64 MiB); a set's name commits to its envelopes, so the first one made is kept."""
    import peer.exchange.set_lists as set_lists
    from types import SimpleNamespace

    g = server()
    digests, served = [], []
    monkeypatch.setattr(set_lists, "payload_digest", lambda p: digests.append(p) or b"d")
    agreement = SimpleNamespace(outcome=lambda: SimpleNamespace(payloads={b"o": b"p" * 1000}),
                                serve=lambda owner, digest: served.append(owner) or bytes(1000), binding=None)
    name = "1" * DIGEST_CHARS
    g._groups[b"g"] = SimpleNamespace(set_digest=name, agreement=agreement)
    got = [g._member_of(name.encode(), b"o") for _ in range(5)]
    assert len(digests) == 1 and len(served) == 1 and all(e is got[0] for e in got)
    assert g._member_of(name.encode(), b"nobody") is None


def test_a_merges_answer_carries_the_list_of_the_set_it_names_and_the_asker_fetches_it_without_a_call():
    """peer/exchange/ready_notices.py: a merge's question (``until=SET``, ``WITH_LIST``) is answered with
    the record that names our set and that set's list; the asker keeps the list once it checks out
    under that name, and its merge's fetch of it (``_fetch_manifest``) then makes no call."""
    from peer.exchange import ready_notices
    from protocol.dht.records import Progress, encode_body
    from protocol.round.timing import Timing

    binding, envelopes, payloads = agreed_set(0, 3)
    name = set_digest(binding.context, payloads)
    record = Progress(round=ROUND, step=3, state="exchanging", spec="s" * 16, loss=0.0, val_loss=0.0, tokens=0,
                      tokens_per_s=0.0, bytes_sent=0, bytes_received=0, params_hash="h", gathered_round=ROUND,
                      gathered=name)
    g = server()
    g._fetched[name.encode()] = pack_set(binding, envelopes)  # the set we named, held whole
    g.timing = Timing()
    g._init_ready_notices()
    g.note_progress(encode_body(record.to_wire()))

    def question(until=ready_notices.SET, flag=ready_notices.WITH_LIST):
        request = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=str(ROUND).encode()), weight=1.0,
                                              group_id=until, peer_id=flag)
        return asyncio.run(g.rpc_ready(request, context(MATE)))

    answer_ = question()
    assert open_manifest(answer_.group_id, RUN, ROUND, name, 16).digest == name
    assert question(flag=b"").group_id == b"" and question(until=ready_notices.DONE_Q).group_id == b""  # asked for, by a merge

    asker = server()
    asker._keep_named_list(answer_.tensor_part.buffer, ROUND, answer_.group_id)
    other = server()
    other._keep_named_list(answer_.tensor_part.buffer, ROUND + 1, answer_.group_id)  # names no set for that round
    forged = server()
    forged._keep_named_list(answer_.tensor_part.buffer, ROUND, pack_manifest(*agreed_set(4, 2)[:2]))  # not that set's
    assert name.encode() in asker._fetched_lists and not other._fetched_lists and not forged._fetched_lists
    checks = []
    asker._opened_list = lambda *a: checks.append(a)  # a list already held is not checked again
    asker._keep_named_list(answer_.tensor_part.buffer, ROUND, answer_.group_id)
    assert not checks
    # a list of another round, named by a record for the asked one, is not kept (it would push others out)
    late = Progress(**{**record.__dict__, "gathered_round": ROUND + 1})
    stale = server()
    stale._keep_named_list(encode_body(late.to_wire()), ROUND + 1, answer_.group_id)
    assert not stale._fetched_lists

    def no_call(*args, **kwargs):
        raise AssertionError("fetched over the network")

    asker._fetch_raw = no_call
    future = MPFuture()
    asyncio.run(asker._fetch_manifest("some peer", name, 1.0, future))
    assert open_manifest(future.result(), RUN, ROUND, name, 16).digest == name
