"""A stage listener against strangers: stalled connections before the handshake cost little and
lock nobody out, and a stranger who copies a hello's public fields is not taken for a neighbour.
Loopback TCP in one process, a few seconds."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
from types import SimpleNamespace

import pytest

from peer.chain.errors import HandshakeRejected, LinkProtocolError
from peer.chain.links import LinkAuth, StageIdentity, connect_link, link_codec, run
from peer.chain.listener import StageListener
from protocol.chain import link_auth
from protocol.chain.frames import HANDSHAKE_MAX_BYTES, FrameFormat, Hello
from protocol.wire.signed import Signer

HOST = "127.0.0.1"
FMT = FrameFormat(micro_batch=16, seq_len=512, k=512, d_model=512, vocab_size=256)  # frames up to ~16.8 MiB
CODEC = link_codec(FMT.d_model, FMT.k, seed=0)
STALLED = 16


def ident(stage, round_no=3, chain="ch-guard"):
    return StageIdentity(run_digest="run-digest", chain_id=chain, stage=stage, round=round_no)


NO_CHAIN = StageIdentity(run_digest="", chain_id="", stage=-1, round=-1)  # a stage's listener before its first chain


def dial_soon(port, local):
    """Stage 0 dialling ``port`` as ``local``, in the background."""
    return asyncio.ensure_future(connect_link(HOST, port, local=local, role="upstream", fmt=FMT, codec=CODEC, timeout=5,
                                              handshake_timeout=5))


async def take(listener, dialing):
    """The link ``dialing`` opened, as the listener accepted it: (its round, its name); both ends closed."""
    link = await dialing
    accepted = await listener.accept(timeout=5)
    taken = (accepted.local.round, accepted.name.split(" (")[0])
    await link.close()
    await accepted.close()
    return taken


def listen(local=None, **kwargs):
    return StageListener.start(HOST, 0, local=ident(1) if local is None else local, role="downstream", fmt=FMT,
                               codec=CODEC, timeout=5, **kwargs)


def dial(port, auth=None, stage=0):
    return connect_link(HOST, port, local=ident(stage), role="upstream", fmt=FMT, codec=CODEC, timeout=5,
                        handshake_timeout=5, auth=auth)


async def stall(port, prefix: int, body: int):
    """A connection that announces a frame of ``prefix`` bytes, sends ``body`` of them, and stalls."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(struct.pack(">I", prefix) + b"\x00" * body)
    await writer.drain()
    return writer


def test_stalled_connections_before_the_handshake_are_bounded_and_an_honest_one_still_gets_in():
    async def main():
        listener = await listen(handshake_timeout=30)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        # half announce a huge frame and send 1 MiB of it; half stay just under the handshake limit
        writers = [await stall(listener.port, FMT.max_frame_bytes - 8, 1 << 20) for _ in range(STALLED // 2)]
        writers += [await stall(listener.port, HANDSHAKE_MAX_BYTES - 8, HANDSHAKE_MAX_BYTES - 100) for _ in range(STALLED // 2)]
        await asyncio.sleep(0.5)
        held = tracemalloc.get_traced_memory()[1] - base
        pending = len(listener._handshakes)
        link = await dial(listener.port)  # an honest neighbour, while the strangers still hold their sockets
        accepted = await listener.accept(timeout=5)
        tracemalloc.stop()
        for w in writers:
            w.close()
        await link.close()
        await accepted.close()
        await listener.close()
        return held, pending, listener.rejected

    held, pending, rejected = run(main())
    assert held < 4 << 20, f"{held / 2**20:.1f} MiB held for {STALLED} stalled connections"
    assert pending <= 4
    assert sum("exceeds the limit" in r for r in rejected) == STALLED // 2  # refused at the length prefix
    assert sum("dropped for a newer connection" in r for r in rejected) >= STALLED // 2 - 4


def test_silent_connections_time_out_within_the_handshake_deadline():
    async def main():
        listener = await listen(handshake_timeout=0.5)
        writers = [(await asyncio.open_connection(HOST, listener.port))[1] for _ in range(3)]
        await asyncio.sleep(1.5)
        pending = len(listener._handshakes)
        for w in writers:
            w.close()
        await listener.close()
        return pending, listener.rejected

    pending, rejected = run(main())
    assert pending == 0 and sum("no complete frame within 0.5 s" in r for r in rejected) == 3


@pytest.fixture(scope="module")
def keys():
    return {name: Signer.generate() for name in ("stage0", "stage1", "stranger")}


def test_only_the_peer_the_chain_names_gets_in(keys):
    s0, s1, stranger = keys["stage0"], keys["stage1"], keys["stranger"]

    async def attempt(listener_key, dialer_auth):
        listener = await listen(auth=LinkAuth(listener_key, s0.peer_id))
        try:
            link = await dial(listener.port, auth=dialer_auth)
            accepted = await listener.accept(timeout=5)
            await link.close()
            await accepted.close()
            return "ok", listener.rejected
        except (HandshakeRejected, LinkProtocolError) as e:
            return type(e).__name__ + ": " + e.reason, listener.rejected
        finally:
            await listener.close()

    # the named stage 0, dialling the named stage 1: both proofs hold
    assert run(attempt(s1, LinkAuth(s0, s1.peer_id)))[0] == "ok"
    # a stranger with the public hello fields but no key: refused with the reason
    outcome, rejected = run(attempt(s1, None))
    assert outcome.startswith("HandshakeRejected") and "authenticates its neighbours" in outcome
    # a stranger signing with its own key as stage 0's peer id
    impostor = SimpleNamespace(peer_id=s0.peer_id, public_key=stranger.public_key, sign=stranger.sign)
    outcome, rejected = run(attempt(s1, LinkAuth(impostor, s1.peer_id)))
    assert outcome.startswith("HandshakeRejected") and "not the peer the chain names" in outcome
    assert any("not the peer the chain names" in r for r in rejected)
    # a listener that is not the named stage 1: the honest dialer refuses it
    outcome, _ = run(attempt(stranger, LinkAuth(s0, s1.peer_id)))
    assert outcome.startswith("LinkProtocolError") and "listener is not the peer" in outcome


def test_a_listener_without_proof_is_refused_by_an_authenticating_dialer(keys):
    async def main():
        listener = await listen()  # answers hello_ok to anyone: not a proof of anything
        try:
            await dial(listener.port, auth=LinkAuth(keys["stage0"], keys["stage1"].peer_id))
        except LinkProtocolError as e:
            return e.reason
        finally:
            await listener.close()

    assert "did not prove" in run(main())


def test_a_signature_is_bound_to_its_side_and_its_nonces(keys):
    s0, s1 = keys["stage0"], keys["stage1"]
    hello = Hello(run="r", chain="c", stage=0, round=3, role="upstream", nonce=b"\x01" * 32)
    key, sig = link_auth.prove(s0, "dialer", hello, s0.peer_id, s1.peer_id, b"\x02" * 32)
    link_auth.check(s0.peer_id, key, sig, "dialer", hello, s0.peer_id, s1.peer_id, b"\x02" * 32)
    for side, nonce in (("listener", b"\x02" * 32), ("dialer", b"\x03" * 32)):  # reflected, replayed
        with pytest.raises(link_auth.LinkAuthError, match="does not verify"):
            link_auth.check(s0.peer_id, key, sig, side, hello, s0.peer_id, s1.peer_id, nonce)
    with pytest.raises(link_auth.LinkAuthError, match="not the peer"):
        link_auth.check(s1.peer_id, key, sig, "dialer", hello, s0.peer_id, s1.peer_id, b"\x02" * 32)


def test_handshake_frames_round_trip_and_their_fields_are_bounded():
    from protocol.errors import FrameError
    from protocol.chain.frames import Auth, Challenge, FrameDecoder, encode_frame

    frames = [Hello(run="r", chain="c", stage=0, round=3, role="upstream", nonce=b"\x01" * 32),
              Challenge(b"\x02" * 32, b"k" * 600, b"s" * 256), Auth(b"k" * 600, b"s" * 256)]
    assert FrameDecoder(FMT, HANDSHAKE_MAX_BYTES).feed(b"".join(encode_frame(f) for f in frames)) == frames
    for bad in (Challenge(b"\x02" * 31, b"k", b"s"), Auth(b"k" * 1025, b"s"), Auth(b"k", b""),
                Hello(run="r", chain="c", stage=0, round=3, role="upstream", nonce=b"\x01" * 16)):
        with pytest.raises(FrameError, match="allowed length"):
            FrameDecoder(FMT).feed(encode_frame(bad))
    with pytest.raises(FrameError, match="exceeds the limit of 4096"):
        FrameDecoder(FMT, HANDSHAKE_MAX_BYTES).feed(struct.pack(">I", HANDSHAKE_MAX_BYTES + 1))


def test_a_link_left_queued_from_an_earlier_round_is_never_accepted_later():
    """A link that passed the handshake but was never accepted (its chain broke first) is dropped when
    the listener is retargeted to a later round (``StageListener.retarget``): otherwise, when the chain
    re-forms, ``accept`` would hand out that dead link first while the new one sits in the queue and
    its dialer waits ``link_timeout`` (30 s) for a frame."""
    async def main():
        listener = await listen()
        stale = await dial(listener.port)  # passed the handshake at round 3, never accepted
        await asyncio.sleep(0.2)
        await stale.close()
        later = StageIdentity(run_digest="run-digest", chain_id="ch-guard", stage=1, round=9)
        dropped = await listener.retarget(later, None)
        fresh = await connect_link(HOST, listener.port, local=StageIdentity("run-digest", "ch-guard", 0, 9),
                                   role="upstream", fmt=FMT, codec=CODEC, timeout=5, handshake_timeout=5)
        accepted = await listener.accept(timeout=5)
        got_round = accepted.local.round
        # the same identity again (a chain re-formed at the same round): a link whose dialer has
        # gone is skipped, one that is open is handed out
        gone = await connect_link(HOST, listener.port, local=StageIdentity("run-digest", "ch-guard", 0, 9),
                                  role="upstream", fmt=FMT, codec=CODEC, timeout=5, handshake_timeout=5)
        await asyncio.sleep(0.2)
        await gone.close(bye=False)
        live = await connect_link(HOST, listener.port, local=StageIdentity("run-digest", "ch-guard", 0, 9),
                                  role="upstream", fmt=FMT, codec=CODEC, timeout=5, handshake_timeout=5)
        await asyncio.sleep(0.2)
        second = await listener.accept(timeout=5)
        second_peer, live_peer = second.peer, live.writer.get_extra_info("sockname")
        for link in (fresh, accepted, live, second):
            await link.close()
        await listener.close()
        return dropped, got_round, second_peer, live_peer

    dropped, got_round, second_peer, live_peer = run(main())
    assert dropped == 1
    assert got_round == 9
    assert second_peer == f"{live_peer[0]}:{live_peer[1]}"


def test_a_hello_a_round_ahead_waits_for_this_stage():
    """The stage that concluded a round first dials its neighbour for the next one at once; the
    neighbour, a moment behind, takes that link when it reaches the round instead of rejecting the
    hello and making it redial (``StageListener._reach``). A hello for a round this stage does not
    reach within the handshake's deadline is rejected with the reason, as before."""
    async def main():
        listener = await listen(handshake_timeout=3)
        dialing = dial_soon(listener.port, ident(0, 4))
        await asyncio.sleep(0.5)
        held = not dialing.done()
        await listener.retarget(ident(1, 4), None)
        taken = ((await take(listener, dialing))[0], list(listener.rejected))
        with pytest.raises(HandshakeRejected, match="peer is at round 5, this stage at round 4"):
            await dial_soon(listener.port, ident(0, 5))
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(HandshakeRejected, match="another-chain"):  # not the neighbour even then: not held
            await dial_soon(listener.port, ident(0, 5, chain="another-chain"))
        assert asyncio.get_running_loop().time() - t0 < 1.0
        await listener.close()
        return held, taken

    held, (round_taken, rejected_before) = run(main())
    assert held, "the hello of a later round was answered before this stage reached it"
    assert round_taken == 4 and rejected_before == []


def test_a_hello_of_a_round_this_stage_has_ended_is_refused():
    """Between a round's end and the next round's ``retarget`` (``StageListener.end_round``) a hello of
    the ended round is refused at once, with the reason, and a link of that round never accepted is
    closed: a neighbour that missed the round's exchange still trains it and must catch up, not link
    up with a round this stage has left (it lost that link at our next retarget, and both ends then
    waited ``round_wait`` for each other: CI, 2026-12-02). A hello of the next round is held until
    this stage gets there, as before."""
    async def main():
        listener = await listen(local=ident(1, 4), handshake_timeout=3)
        queued = await connect_link(HOST, listener.port, local=ident(0, 4), role="upstream", fmt=FMT, codec=CODEC,
                                    timeout=5, handshake_timeout=5)
        await asyncio.sleep(0.2)
        closed = await listener.end_round()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(HandshakeRejected, match="ended round 4"):
            await dial_soon(listener.port, ident(0, 4))
        refused_in = asyncio.get_running_loop().time() - t0
        with pytest.raises(HandshakeRejected, match="another-chain"):  # not the neighbour: refused for that
            await dial_soon(listener.port, ident(0, 4, chain="another-chain"))
        dialing = dial_soon(listener.port, ident(0, 5))
        await asyncio.sleep(0.5)
        held = not dialing.done()
        await listener.retarget(ident(1, 5), None)
        round_taken = (await take(listener, dialing))[0]
        # the same identity again (a round this stage found no group for, trained once more): refused
        # until retarget names it again, then taken
        await listener.end_round()
        with pytest.raises(HandshakeRejected, match="ended round 5: catch up"):
            await dial_soon(listener.port, ident(0, 5))
        await listener.retarget(ident(1, 5), None)
        round_again = (await take(listener, dial_soon(listener.port, ident(0, 5))))[0]
        await queued.close(bye=False)
        await listener.close()
        return closed, refused_in, held, round_taken, round_again

    closed, refused_in, held, round_taken, round_again = run(main())
    assert closed == 1
    assert refused_in < 1.0, "a hello of the ended round was held, not refused"
    assert held and round_taken == 5 and round_again == 5


def test_a_hello_before_this_stage_has_a_chain_waits_for_it():
    """A stage's listener starts before its first chain (its port is announced with it), so its
    neighbour, told of the chain first, may dial it before it knows its chain: that hello is held
    until ``retarget`` names the chain, not rejected ("peer trains run spec …, not ''") and redialled.
    A hello that is still not this stage's neighbour's then is rejected as before."""
    async def main():
        listener = await listen(local=NO_CHAIN, handshake_timeout=3)
        dialing = dial_soon(listener.port, ident(0, 0))
        stranger = dial_soon(listener.port, ident(0, 0, chain="another-chain"))
        await asyncio.sleep(0.5)
        held = not dialing.done() and not stranger.done()
        await listener.retarget(ident(1, 0), None)
        name = (await take(listener, dialing))[1]
        with pytest.raises(HandshakeRejected, match="another-chain"):
            await stranger
        await listener.close()
        return held, (name, list(listener.rejected))

    held, (name, rejected) = run(main())
    assert held, "a hello was answered before this stage knew its chain"
    assert name == "stage 1 <-> stage 0"
    assert len(rejected) == 1 and "another-chain" in rejected[0], rejected


def test_a_hello_before_this_stage_has_a_chain_waits_on_for_a_round_past_its_first():
    """A hello held before this stage had a chain that names a round after the one ``retarget`` gives
    it is held on as any hello of a later round (judged by what this stage is now, not by the
    identity it had when the connection came), and taken there."""
    async def main():
        listener = await listen(local=NO_CHAIN, handshake_timeout=3)
        dialing = dial_soon(listener.port, ident(0, 1))
        await asyncio.sleep(0.3)
        await listener.retarget(ident(1, 0), None)
        await asyncio.sleep(0.3)
        held = not dialing.done()
        await listener.retarget(ident(1, 1), None)
        taken = ((await take(listener, dialing))[0], list(listener.rejected))
        await listener.close()
        return held, taken

    held, (round_taken, rejected) = run(main())
    assert held and round_taken == 1 and rejected == [], (held, round_taken, rejected)


def test_a_neighbour_that_dials_again_and_again_holds_one_queued_link():
    """Every connection that passed the handshake waited in an unbounded queue until the stage accepted
    one: a neighbour dialing in a loop for a round held a socket and a link per dial. Now the newest
    link replaces the one queued (peer/chain/listener.py), and the stage accepts that one."""
    async def main():
        listener = await listen()
        links = [await dial(listener.port) for _ in range(6)]
        await asyncio.sleep(0.2)
        queued = listener._queue.qsize()
        accepted = await listener.accept(timeout=5)
        for link in links:
            await link.close()
        await accepted.close()
        await listener.close()
        return queued

    assert run(main()) == 1


def test_the_reasons_of_failed_handshakes_kept_are_bounded():
    from peer.chain.listener import MAX_REJECTED

    async def main():
        listener = await listen()
        for _ in range(MAX_REJECTED + 10):
            _, writer = await asyncio.open_connection(HOST, listener.port)
            writer.write(b"\x00\x00\x00\x02\xc1\xc1")  # a frame that is no msgpack
            await writer.drain()
            writer.close()
        await asyncio.sleep(0.5)
        kept = len(listener.rejected)
        await listener.close()
        return kept

    assert 0 < run(main()) <= MAX_REJECTED


def test_a_flood_of_connections_from_one_address_evicts_its_own_handshakes():
    """With 4 handshakes pending, a new connection closes the oldest of the address holding the most,
    so empty connections from one host cannot push out a neighbour's handshake from another."""
    async def main():
        listener = await listen(handshake_timeout=30)
        _, neighbour = await asyncio.open_connection(HOST, listener.port, local_addr=("127.0.0.1", 0))
        await asyncio.sleep(0.1)
        flood = []
        for _ in range(12):
            flood.append((await asyncio.open_connection(HOST, listener.port, local_addr=("127.0.0.2", 0)))[1])
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        hosts = sorted(link.writer.get_extra_info("peername")[0] for link in listener._handshakes.values())
        for writer in [neighbour] + flood:
            writer.close()
        await listener.close()
        return hosts

    assert run(main()) == ["127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.2"]
