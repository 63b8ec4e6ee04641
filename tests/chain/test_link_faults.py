"""Hostile and failing neighbours of a pipeline stage (peer/chain/links.py): bad hellos, bad frames
and stalled links are dropped with a clear error while the listener keeps accepting. Stages,
codecs and the run are tests/chain/test_pipeline.py's.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

import pytest
import torch

from peer.chain.errors import BatchMismatch, HandshakeRejected, LinkClosed, LinkProtocolError, LinkTimeout
from peer.chain.gpipe import run_inner_step
from peer.chain.links import connect_link, run
from peer.chain.listener import StageListener
from protocol.errors import FrameError
from protocol.chain.frames import (LINK_VERSION, Activations, FrameDecoder, FrameFormat, Grads, Hello, HelloOk, Reject,
                                   encode_frame)
from tests.chain.test_pipeline import B, CHAIN, D, HOST, LOG, M, RUN, batches, fmt_codec, ident, make_stages
from tests.chain.test_pipeline import one_thread  # noqa: F401  (autouse: one torch thread, as there)


async def raw_hello(port, hello, read_answer=True):
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(encode_frame(hello))
    await writer.drain()
    answer = None
    if read_answer:
        fmt, _ = fmt_codec()
        dec = FrameDecoder(fmt)
        frames = []
        while not frames:
            data = await asyncio.wait_for(reader.read(1 << 16), 5)
            if not data:
                break
            frames = dec.feed(data)
        answer = frames[0] if frames else None
    return reader, writer, answer


async def eof(reader, within=5.0):
    """True when the other side closed the connection (whatever it sent before)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            data = await asyncio.wait_for(reader.read(1 << 16), deadline - time.monotonic())
        except (ConnectionError, OSError):
            return True
        if not data:
            return True
    return False


def good_hello(stage=0, run=RUN, chain=CHAIN, round=0, role="upstream", version=LINK_VERSION):
    return Hello(run=run.digest(), chain=chain, stage=stage, round=round, role=role, version=version)


def test_bad_neighbours_are_dropped_and_the_listener_keeps_accepting(caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    other_run = RUN.replace(seed=99)
    fmt, codec = fmt_codec()
    frame_len = struct.Struct(">I")

    async def main():
        stages, trainers = make_stages([0, 2, 4])
        T = stages[0].embed.weight.detach().clone()
        before = {n: p.detach().clone() for n, p in stages[1].named_parameters()}
        listener = await StageListener.start(HOST, 0, local=ident(1), role="downstream", fmt=fmt, codec=codec, timeout=5, handshake_timeout=1)
        port = listener.port

        # 1. wrong handshakes: answered with a reject and the reason, then closed
        bad_hellos = {
            "run spec": good_hello(run=other_run),
            "chain": good_hello(chain="ch-another"),
            "expected stage 0": good_hello(stage=2),
            "expected stage 0 (upstream)": good_hello(role="downstream"),
            "round": good_hello(round=1),
            "protocol version": good_hello(version=LINK_VERSION + 1),
        }
        for why, hello in bad_hellos.items():
            reader, writer, answer = await raw_hello(port, hello)
            assert isinstance(answer, Reject) and why in answer.reason, (why, answer)
            assert await eof(reader)
            writer.close()
        # garbage instead of a hello, and silence: closed without an answer
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")
        assert await eof(reader)
        writer.close()
        reader, writer = await asyncio.open_connection(HOST, port)
        assert await eof(reader, within=3)  # handshake_timeout = 1 s
        writer.close()
        assert len(listener.rejected) == len(bad_hellos) + 2

        # 2. a good handshake, then bad frames: the step fails with a typed error, the link closes
        x, y = batches(1)[0]
        good = Activations(0, 0, x[:2], torch.zeros(2, 16, D, dtype=torch.float16))
        nan = torch.zeros(2, 16, D, dtype=torch.float16)
        nan[1, 3, 5] = float("nan")
        other_fmt = FrameFormat.for_run(RUN, micro_batch=B // M, k=D // 2)
        cases = {
            "truncated frame": (encode_frame(good, fmt)[:100], True),
            "exceeds the limit": (frame_len.pack(fmt.max_frame_bytes + 1) + b"\x80" * 64, False),
            "does not match": (encode_frame(Activations(0, 0, x[:2], torch.zeros(2, 16, D // 2, dtype=torch.float16)), other_fmt), False),
            "expected (2, 16, 32)": (encode_frame(Activations(0, 0, x[:1], torch.zeros(1, 16, D, dtype=torch.float16)), fmt), False),
            "non-finite": (encode_frame(Activations(0, 0, x[:2], nan), fmt), False),
            "this link uses torch.float16": (encode_frame(Activations(0, 0, x[:2], torch.zeros(2, 16, D)), fmt), False),
            "expected activations of step 0 micro-batch 0": (encode_frame(Activations(0, 7, x[:2], nan.nan_to_num()), fmt), False),
            "expected activations, got Grads": (encode_frame(Grads(0, 0, nan.nan_to_num()), fmt), False),
            "unexpected Hello": (encode_frame(good_hello()), False),
        }
        for why, (payload, close_after) in cases.items():
            reader, writer, answer = await raw_hello(port, good_hello())
            assert isinstance(answer, HelloOk)
            link = await listener.accept(5)
            writer.write(payload)
            await writer.drain()
            if close_after:
                writer.close()
            with pytest.raises(LinkProtocolError, match=why.replace("(", r"\(").replace(")", r"\)")):
                await run_inner_step(stages[1], trainers[1], T=T, micro_batches=M, batch=(x, y), upstream=link)
            assert link.closed
            assert await eof(reader)
            writer.close()
            with pytest.raises(LinkProtocolError) as failed:  # the failure sticks to the link
                await link.recv()
            assert isinstance(failed.value, FrameError)  # callers may catch ProtocolError
        # the ids of another batch: the step stops and the link closes, like any input this stage cannot use
        reader, writer, answer = await raw_hello(port, good_hello())
        link = await listener.accept(5)
        writer.write(encode_frame(Activations(0, 0, x[2:], torch.zeros(2, 16, D, dtype=torch.float16)), fmt))
        with pytest.raises(BatchMismatch, match="not this stage's batch"):
            await run_inner_step(stages[1], trainers[1], T=T, micro_batches=M, batch=(x, y), upstream=link)
        assert link.closed and isinstance(BatchMismatch("x"), LinkProtocolError)
        assert await eof(reader)
        writer.close()
        # nothing was updated by the failed steps
        assert trainers[1].step_count == 0
        for n, p in stages[1].named_parameters():
            assert torch.equal(p, before[n]) and p.grad is None, n

        # 3. the right neighbour still gets in and the chain trains
        down = await connect_link(HOST, port, local=ident(0), role="upstream", fmt=fmt, codec=codec, timeout=5)
        up = await listener.accept(5)
        _, loss = await asyncio.gather(
            run_inner_step(stages[0], trainers[0], T=T, micro_batches=M, batch=(x, y), downstream=down),
            run_inner_step(stages[1], trainers[1], T=T, micro_batches=M, batch=(x, y), upstream=up),
        )
        assert loss is not None and loss > 0 and trainers[1].step_count == 1
        # a dialler that is refused gets the listener's reason as a typed error
        with pytest.raises(HandshakeRejected, match="chain"):
            await connect_link(HOST, port, local=ident(0, chain="ch-x"), role="upstream", fmt=fmt, codec=codec)
        await down.close()
        with pytest.raises(LinkClosed, match="bye"):
            await up.recv()
        await listener.close()

    run(main())
    logged = caplog.text
    for why in ("run spec", "chain", "expected stage 0", "round", "truncated frame", "exceeds the limit", "non-finite"):
        assert why in logged, why


def test_stalled_neighbours_are_detected_within_the_timeout(caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    fmt, codec = fmt_codec()
    timeout = 0.4

    async def main():
        stages, trainers = make_stages([0, 2, 4])
        T = stages[0].embed.weight.detach().clone()
        x, y = batches(1)[0]
        listener = await StageListener.start(HOST, 0, local=ident(1), role="downstream", fmt=fmt, codec=codec, timeout=timeout)
        # upstream neighbour that says hello, then nothing / half a frame
        for payload in (b"", encode_frame(Activations(0, 0, x[:2], torch.zeros(2, 16, D, dtype=torch.float16)), fmt)[:200]):
            reader, writer, _ = await raw_hello(listener.port, good_hello())
            link = await listener.accept(5)
            writer.write(payload)
            t0 = time.monotonic()
            with pytest.raises(LinkTimeout):
                await run_inner_step(stages[1], trainers[1], T=T, micro_batches=M, batch=(x, y), upstream=link)
            assert timeout * 0.9 <= time.monotonic() - t0 < timeout + 1.0
            assert await eof(reader)
            writer.close()
        await listener.close()

        # downstream neighbour that accepts the handshake, reads our activations, never answers
        async def silent(reader, writer):
            await reader.read(1 << 16)
            writer.write(encode_frame(HelloOk()))
            while await reader.read(1 << 16):
                pass

        server = await asyncio.start_server(silent, HOST, 0)
        down = await connect_link(HOST, server.sockets[0].getsockname()[1], local=ident(0), role="upstream", fmt=fmt, codec=codec, timeout=timeout)
        t0 = time.monotonic()
        with pytest.raises(LinkTimeout):
            await run_inner_step(stages[0], trainers[0], T=T, micro_batches=M, batch=(x, y), downstream=down)
        assert time.monotonic() - t0 < timeout + 1.0
        server.close()
        await server.wait_closed()

    run(main())
    assert "no complete frame within 0.4 s" in caplog.text
    assert "bytes of a frame received" in caplog.text
