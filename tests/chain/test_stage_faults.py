"""Bad input from a neighbour never crashes a chain stage (peer/chain/gpipe.py, peer/chain/links.py,
peer/chain/stage.py): whatever a neighbour sends that the stage cannot use (garbage bytes, NaN values,
another batch's ids, values that overflow, extreme gradients) ends the step with a StageError at
the schedule level, and with ChainBroken at the chain member's level: the reason logged, the link
closed, the parameters, the optimizer state and the step counter untouched."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
import torch

from peer.chain.stage import ChainBroken, ChainMember
from peer.chain.gpipe import run_inner_step
from peer.training.inner import InnerTrainer
from peer.training.model import build_model
from peer.training.resources import Resources
from peer.chain.errors import BatchMismatch, LinkProtocolError, NonFiniteGradients, NonFiniteOutput, StageError
from peer.chain.links import StageIdentity, connect_link, link_codec, run
from peer.chain.listener import StageListener
from protocol.chain.frames import LINK_VERSION, Activations, FrameDecoder, FrameFormat, Grads, Hello, HelloOk, encode_frame

from tests.chain.test_pipeline import RUN as PIPELINE_RUN
from tests.chain.test_pipeline import one_thread  # noqa: F401 - the module's autouse fixture: one intra-op thread

RUN = PIPELINE_RUN.replace(chain=dict(micro_batches=2, rank=8, link_timeout=5.0))
D, S, B, M = 32, 16, 4, 2
HOST = "127.0.0.1"
CHAIN = "ch-faults"


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (B, S), generator=g)
    return x, torch.roll(x, -1, dims=1)


def snapshot(stage, trainer):
    return (
        {n: p.detach().clone() for n, p in stage.named_parameters()},
        {k: {n: v.clone() for n, v in s.items()} for k, s in trainer.optimizer.state_dict()["state"].items()},
        [dict(g, params=None) for g in trainer.optimizer.state_dict()["param_groups"]],
        trainer.step_count,
    )


def assert_untouched(stage, trainer, before):
    params, opt_state, groups, steps = before
    assert trainer.step_count == steps
    for n, p in stage.named_parameters():
        assert torch.equal(p, params[n]) and p.grad is None, n
    after = trainer.optimizer.state_dict()
    assert [dict(g, params=None) for g in after["param_groups"]] == groups
    assert after["state"].keys() == opt_state.keys()
    for k, s in after["state"].items():
        for n, v in s.items():
            assert torch.equal(v, opt_state[k][n]), (k, n)


def ident(stage, round=0):
    return StageIdentity(RUN.digest(), CHAIN, stage, round)


def hello(stage, role):
    return Hello(run=RUN.digest(), chain=CHAIN, stage=stage, round=0, role=role, version=LINK_VERSION)


STEP = 1  # frames of the step after the one trained_stage made


def trained_stage(blocks):
    """A stage with one inner step behind it (so it has Adam moments to keep), on its own."""
    stage = build_model(RUN.model, RUN.seed, blocks=blocks)
    trainer = InnerTrainer(stage, RUN.inner)
    with torch.no_grad():
        h = torch.randn(B, S, D, generator=torch.Generator().manual_seed(9))
    x, y = batch(1)
    out = stage.forward_head(stage.forward_blocks(h), y)[1] if stage.is_last else stage.forward_blocks(stage.embed_tokens(x)).sum()
    trainer.optimizer.zero_grad(set_to_none=True)
    out.backward()
    trainer.apply_gradients()
    trainer.optimizer.zero_grad(set_to_none=True)
    return stage, trainer


# --- the schedule: a StageError, never anything else ----------------------------------------------


FMT = FrameFormat.for_run(RUN, micro_batch=B // M, k=D)
EXTREME = 3e38  # finite in bfloat16, and not much further from overflowing anything


@pytest.mark.parametrize(
    "case, error",
    [
        ("garbage", LinkProtocolError),
        ("nan", LinkProtocolError),
        ("other batch", BatchMismatch),
        ("overflowing activations", NonFiniteOutput),  # the gradient this stage would send overflows
    ],
)
def test_last_stage_fed_bad_activations_raises_a_stage_error(case, error):
    codec = link_codec(D, D, RUN.seed, torch.bfloat16)

    async def main():
        stage, trainer = trained_stage((2, 4))
        before = snapshot(stage, trainer)
        T = build_model(RUN.model, RUN.seed, blocks=(0, 1)).embed.weight.detach().clone()
        listener = await StageListener.start(HOST, 0, local=ident(1), role="downstream", fmt=FMT, codec=codec, timeout=5)
        reader, writer = await asyncio.open_connection(HOST, listener.port)
        writer.write(encode_frame(hello(0, "upstream")))
        link = await listener.accept(5)
        x, y = batch()
        values = torch.zeros(B // M, S, D, dtype=torch.bfloat16)
        if case == "garbage":
            payload = b"\x00\x00\x00\x09" + bytes(range(200, 209))
        elif case == "nan":
            values[0, 1, 2] = float("nan")
            payload = encode_frame(Activations(0, STEP, x[:2], values), FMT)
        elif case == "other batch":
            payload = encode_frame(Activations(0, STEP, x[2:], values), FMT)
        else:
            payload = encode_frame(Activations(0, STEP, x[:2], values + EXTREME), FMT)
        writer.write(payload)
        with pytest.raises(error):
            await run_inner_step(stage, trainer, T=T, micro_batches=M, batch=(x, y), upstream=link)
        assert link.closed
        assert_untouched(stage, trainer, before)
        writer.close()
        await listener.close()

    run(main())


def test_first_stage_fed_extreme_gradients_skips_the_update():
    """Gradients that are finite on the wire but overflow in the backward: no update, a StageError."""
    codec = link_codec(D, D, RUN.seed, torch.bfloat16)

    async def main():
        stage, trainer = trained_stage((0, 2))
        before = snapshot(stage, trainer)
        T = stage.embed.weight.detach().clone()

        async def downstream(reader, writer):
            await reader.read(1 << 16)  # our hello
            writer.write(encode_frame(HelloOk()))
            dec, frames = FrameDecoder(FMT), []
            while len(frames) < M:  # the M activations
                data = await reader.read(1 << 16)
                if not data:
                    return
                frames += dec.feed(data)
            for mb in range(M):
                writer.write(encode_frame(Grads(mb, STEP, torch.full((B // M, S, D), EXTREME, dtype=torch.bfloat16)), FMT))
            await writer.drain()
            await reader.read(1 << 16)

        server = await asyncio.start_server(downstream, HOST, 0)
        link = await connect_link(HOST, server.sockets[0].getsockname()[1], local=ident(0), role="upstream", fmt=FMT, codec=codec, timeout=5)
        x, y = batch()
        with pytest.raises(StageError) as failed:
            await run_inner_step(stage, trainer, T=T, micro_batches=M, batch=(x, y), downstream=link)
        assert isinstance(failed.value, NonFiniteGradients), failed.value
        assert_untouched(stage, trainer, before)
        await link.close()
        server.close()
        await server.wait_closed()

    run(main())


def test_own_bad_arguments_still_raise_value_error():
    stage, trainer = trained_stage((0, 4))
    with pytest.raises(ValueError, match="T must be"):
        run(run_inner_step(stage, trainer, T=torch.zeros(3, D), micro_batches=M, batch=batch()))
    with pytest.raises(ValueError, match="upstream link"):
        run(run_inner_step(trained_stage((2, 4))[0], trainer, T=stage.embed.weight, micro_batches=M, batch=batch()))


# --- the chain member: ChainBroken, the process carries on -----------------------------------------


class RawNeighbour:
    """The stage before the member, speaking raw bytes over a blocking socket."""

    def __init__(self, port):
        self.sock = socket.create_connection((HOST, port), timeout=5)
        self.sock.sendall(encode_frame(hello(1, "upstream")))
        dec, frames = FrameDecoder(FrameFormat.for_run(RUN, micro_batch=B // M, k=8)), []
        while not frames:
            data = self.sock.recv(1 << 16)
            assert data, "the member closed the connection during the handshake"
            frames = dec.feed(data)
        assert isinstance(frames[0], HelloOk), frames[0]

    def closed_by_peer(self, within=5.0):
        deadline = time.monotonic() + within
        self.sock.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except socket.timeout:
                continue
            except OSError:
                return True
        return False


@pytest.fixture
def member():
    resources = Resources(memory_bytes=1 << 30, bandwidth_mbps=100.0, source="declared")
    m = ChainMember(None, RUN, "peer-last", resources, HOST, 0, threading.Event())
    m.listener.local = ident(2)
    yield m
    m.shutdown()


WHY = {
    "garbage": "bad frame",
    "nan": "non-finite",
    "other batch": "not this stage's batch",
    "wrong shape": "expected",
    "truncated then closed": "truncated frame",
}


@pytest.mark.parametrize("case", list(WHY))
def test_chain_member_breaks_the_chain_and_keeps_its_state(member, case, caplog):
    fmt = member.fmt
    stage, trainer = trained_stage((2, 4))
    before = snapshot(stage, trainer)
    T = build_model(RUN.model, RUN.seed, blocks=(0, 1)).embed.weight.detach().clone()
    neighbour = RawNeighbour(member.listener.port)
    member.upstream = member._call(member.listener.accept(5), timeout=10)
    x, y = batch()
    coeffs = torch.zeros(B // M, S, member.k, dtype=torch.float16)
    if case == "garbage":
        payload = bytes(range(256)) * 4
    elif case == "nan":
        coeffs[1, 0, 0] = float("inf")
        payload = encode_frame(Activations(0, STEP, x[:2], coeffs), fmt)
    elif case == "other batch":
        payload = encode_frame(Activations(0, STEP, x[2:], coeffs), fmt)
    elif case == "wrong shape":
        other = FrameFormat.for_run(RUN, micro_batch=1, k=member.k)
        payload = encode_frame(Activations(0, STEP, x[:1], coeffs[:1]), other)
    else:
        payload = encode_frame(Activations(0, STEP, x[:2], coeffs), fmt)[:-10]
    neighbour.sock.sendall(payload)
    if case == "truncated then closed":
        neighbour.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ChainBroken, match=WHY[case]):
        member.inner_step(stage, trainer, T, (x, y))
    assert member.upstream is None and member.state == "waiting"
    assert neighbour.closed_by_peer()
    assert_untouched(stage, trainer, before)
    assert "closing link" in caplog.text  # the reason is logged
    neighbour.sock.close()


def test_chain_member_stalled_neighbour_breaks_the_chain(member):
    member.spec = RUN.replace(chain=dict(micro_batches=2, rank=8, link_timeout=0.3))
    stage, trainer = trained_stage((2, 4))
    before = snapshot(stage, trainer)
    T = build_model(RUN.model, RUN.seed, blocks=(0, 1)).embed.weight.detach().clone()
    neighbour = RawNeighbour(member.listener.port)
    member.upstream = member._call(member.listener.accept(5), timeout=10)
    t0 = time.monotonic()
    with pytest.raises(ChainBroken):
        member.inner_step(stage, trainer, T, batch())
    assert time.monotonic() - t0 < 5.0
    assert_untouched(stage, trainer, before)
    neighbour.sock.close()


def test_chain_member_bad_arguments_are_not_a_broken_chain(member):
    stage, trainer = trained_stage((2, 4))
    neighbour = RawNeighbour(member.listener.port)
    member.upstream = member._call(member.listener.accept(5), timeout=10)
    with pytest.raises(ValueError, match="T must be"):
        member.inner_step(stage, trainer, torch.zeros(2, D), batch())
    neighbour.sock.close()


def test_a_chain_that_ends_as_its_peer_stops_is_no_warning(member, caplog, monkeypatch):
    """A neighbour that stopped first ends the step of a stage that is stopping too (the demo's end):
    said at INFO, not as a broken chain to wait out."""
    from types import SimpleNamespace

    monkeypatch.setattr(member, "publish", lambda: None)
    for stopping, level in ((False, logging.WARNING), (True, logging.INFO)):
        member.assignment = SimpleNamespace(epoch=3, chain=SimpleNamespace(chain_id="ch-stop"))
        if stopping:
            member.stop.set()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="voloco.chain"):
            member.broken("inner step failed: neighbour said bye")
        said = [r for r in caplog.records if "ch-stop" in r.getMessage()]
        assert [r.levelno for r in said] == [level], [(r.levelno, r.getMessage()) for r in said]
        assert member.assignment is None and member.failed_epoch == 3
        # a stopping stage says it is leaving: the coordinator ends its chain without a warning
        assert member.state == ("leaving" if stopping else "waiting")


def test_a_stage_that_shuts_down_says_it_is_leaving_before_its_links_close(member, monkeypatch):
    said = []
    monkeypatch.setattr(member, "publish", lambda: said.append(("publish", member.state)))
    monkeypatch.setattr(member, "close_links", lambda: said.append(("close", member.state)))
    member.shutdown()
    assert said[:2] == [("publish", "leaving"), ("close", "leaving")]


def test_a_neighbour_linked_before_that_waits_for_a_chain_again_has_left_it(member, monkeypatch):
    """A stage waiting for a neighbour (its hello, or its listener) stops once that neighbour, linked
    with it before in this assignment, publishes "waiting": its chain broke on its side, and the wait
    would last ``round_wait`` for nothing (CI, 2026-12-02: both stages of a chain waited 60 s for each
    other). A neighbour never linked may not have read the assignment yet; a record that cannot be
    read says nothing."""
    from peer.chain import stage as stage_mod
    from protocol.chain.records import CandidateRecord

    records = {"peer-up": CandidateRecord("spec", 1 << 30, 100.0, "waiting", "127.0.0.1:1")}
    monkeypatch.setattr(stage_mod, "read_candidates", lambda dht, spec: records)
    assert not member._left_chain("peer-up")  # never linked in this assignment
    member._linked.add("peer-up")
    assert member._left_chain("peer-up")
    records["peer-up"] = CandidateRecord("spec", 1 << 30, 100.0, "leaving", "127.0.0.1:1")
    assert member._left_chain("peer-up")  # it stops
    records["peer-up"] = CandidateRecord("spec", 1 << 30, 100.0, "assigned", "127.0.0.1:1")
    assert not member._left_chain("peer-up")

    def unreadable(dht, spec):
        raise TimeoutError("no DHT")

    monkeypatch.setattr(stage_mod, "read_candidates", unreadable)
    assert not member._left_chain("peer-up")


def test_a_close_from_the_first_stage_ends_the_round_and_one_under_the_floor_breaks_the_chain(member, monkeypatch):
    """Early close of a chain (peer/chain/gpipe.py ``close_round``): a ``close`` where a step's first
    activations would come ends the member's step with RoundClosed, the link kept and nothing trained;
    the role then ends its round (RoundClosedEarly) and draws the unused batch again. A close before
    ``outer.min_inner_fraction`` of H steps, which no honest first stage sends, breaks the chain."""
    from types import SimpleNamespace

    from peer.chain.errors import RoundClosed
    from peer.training.roles import ChainStage, RoundAbandoned, RoundClosedEarly
    from protocol.chain.frames import Close

    monkeypatch.setattr(member, "publish", lambda: None)
    member.assignment, member.state = SimpleNamespace(epoch=1, chain=SimpleNamespace(chain_id="ch-close")), "training"
    stage, trainer = trained_stage((2, 4))
    T = build_model(RUN.model, RUN.seed, blocks=(0, 1)).embed.weight.detach().clone()
    neighbour = RawNeighbour(member.listener.port)
    member.upstream = member._call(member.listener.accept(5), timeout=10)
    before = snapshot(stage, trainer)
    neighbour.sock.sendall(encode_frame(Close(trainer.step_count)))
    with pytest.raises(RoundClosed):
        member.inner_step(stage, trainer, T, batch(), close_from=trainer.step_count)
    assert member.upstream is not None and member.state == "training"
    assert_untouched(stage, trainer, before)

    role = ChainStage.__new__(ChainStage)  # the role around the member, without a corpus or a DHT
    role.spec, role.chain, role.model, role.trainer, role._T = RUN, member, stage, trainer, T
    role.stream, role._close_from = SimpleNamespace(batches=5), trainer.step_count  # the floor: this step
    neighbour.sock.sendall(encode_frame(Close(trainer.step_count)))
    with pytest.raises(RoundClosedEarly):
        role.inner_step(*batch())
    assert role.stream.batches == 4 and member.upstream is not None
    role._close_from = trainer.step_count + 1  # a round whose floor is a step further
    neighbour.sock.sendall(encode_frame(Close(trainer.step_count)))
    with pytest.raises(RoundAbandoned, match="under the round's floor"):
        role.inner_step(*batch())
    assert member.upstream is None and member.state == "waiting"
    assert_untouched(stage, trainer, before)
    neighbour.sock.close()
