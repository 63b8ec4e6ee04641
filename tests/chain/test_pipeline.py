"""Pipeline stages of a chain (peer/training/model.py's block ranges, peer/chain/links.py, peer/chain/gpipe.py):
stage models, links over loopback TCP, steps.

Every chain here runs its stages as asyncio tasks of this process, linked by real TCP sockets on
127.0.0.1; the references train the full model in one process on the same micro-batches.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from peer.training.inner import InnerTrainer
from peer.chain.errors import LinkProtocolError, RoundClosed
from peer.chain.gpipe import close_round, run_inner_step
from peer.training.model import build_model
from peer.chain.links import StageIdentity, connect_link, link_codec, run
from peer.chain.listener import StageListener
from protocol.chain.activations import compressed_boundary
from protocol.chain.stages import stage_shapes
from protocol.chain.frames import FrameFormat
from protocol.spec import ModelSpec, RunSpec
from protocol.chain.subspace import subspace_basis
from protocol.chain.subspace_constraint import constrain_to_subspace_, project_gradients_

RUN = RunSpec(run_id="pipeline-test", seed=3).replace(
    model=dict(d_model=32, n_layers=4, n_heads=4, ffn_hidden=64, seq_len=16),
    data=dict(batch_size=4),
    inner=dict(lr=1e-2, warmup_steps=1, total_steps=100, grad_clip=1.0),
)
D = RUN.model.d_model
B = RUN.data.batch_size
M = 2
CHAIN = "ch-pipeline-test"
HOST = "127.0.0.1"
TEXT = torch.tensor(list(("def pipeline(stage, link):\n    return stage.forward(link.recv())\n" * 8).encode()), dtype=torch.int64)
LOG = "voloco.pipeline"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batches(n, seed=0, repeat=False):
    g = torch.Generator().manual_seed(seed)
    S = RUN.model.seq_len
    out = []
    for _ in range(n):
        if repeat and out:
            out.append(out[0])
            continue
        offsets = torch.randint(0, len(TEXT) - S - 1, (B,), generator=g)
        idx = offsets[:, None] + torch.arange(S + 1)
        chunk = TEXT[idx]
        out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
    return out


def ident(i, run=RUN, chain=CHAIN, round=0):
    return StageIdentity(run.digest(), chain, i, round)


def fmt_codec(k=D, dtype=torch.float16, run=RUN):
    return FrameFormat.for_run(run, micro_batch=B // M, k=k), link_codec(run.model.d_model, k, run.seed, dtype)


async def connect_chain(stages, ks, dtype, timeout=10.0):
    """Links between consecutive stages: stage i+1 listens, stage i dials."""
    S = len(stages)
    up, down, listeners = [None] * S, [None] * S, []
    for i in range(S - 1):
        fmt, codec = fmt_codec(ks[i], dtype)
        listener = await StageListener.start(HOST, 0, local=ident(i + 1), role="downstream", fmt=fmt, codec=codec, timeout=timeout)
        listeners.append(listener)
        down[i] = await connect_link(HOST, listener.port, local=ident(i), role="upstream", fmt=fmt, codec=codec, timeout=timeout)
        up[i + 1] = await listener.accept(5)
    return up, down, listeners


def stage_of(run, start, end):
    return build_model(run.model, run.seed, run.partial.slices, run.partial.attn_slices, blocks=(start, end))


def make_stages(cuts, devices=None):
    """The stages of ``cuts``, stage i on ``devices[i]`` (default: all on the CPU)."""
    stages = [stage_of(RUN, cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]
    devices = devices or ["cpu"] * len(stages)
    return stages, [InnerTrainer(s, RUN.inner, device) for s, device in zip(stages, devices)]


async def train_chain(cuts, ks, dtype, data, constraint=None, devices=None):
    """Train a chain over loopback links; ``T`` and ``constraint`` are given on the CPU and each
    stage moves what it needs to its own device (``devices``)."""
    stages, trainers = make_stages(cuts, devices)
    T = stages[0].embed.weight.detach().to("cpu").clone()
    if constraint is not None:
        for s in stages:
            device = next(s.parameters()).device
            constrain_to_subspace_(list(s.named_parameters()), constraint.to(device), T.to(device))
    up, down, listeners = await connect_chain(stages, ks, dtype)
    S = len(stages)
    losses = []
    try:
        for x, y in data:
            results = await asyncio.gather(
                *(
                    run_inner_step(
                        stages[i], trainers[i], T=T, micro_batches=M, batch=(x, y) if i in (0, S - 1) else None,
                        upstream=up[i], downstream=down[i], constraint=constraint,
                    )
                    for i in range(S)
                )
            )
            assert all(r is None for r in results[:-1])
            losses.append(results[-1])
    finally:
        await close_chain(up, down, listeners)
    return stages, trainers, losses


async def close_chain(up, down, listeners):
    for link in up + down:
        if link is not None:
            await link.close()
    for listener in listeners:
        await listener.close()


def train_reference(cuts, data, codecs=None, constraint=None):
    """The full model in one process, the same micro-batches, gradients accumulated in the same
    order, clipped per stage; ``codecs[i]`` emulates link i in-process (compressed_boundary)."""
    model = build_model(RUN.model, RUN.seed)
    trainer = InnerTrainer(model, RUN.inner)
    T = model.embed.weight.detach().clone()
    named = list(model.named_parameters())
    if constraint is not None:
        constrain_to_subspace_(named, constraint, T)
    params = dict(named)
    groups = [[params[n] for n in stage_shapes(RUN, cuts[i], cuts[i + 1])] for i in range(len(cuts) - 1)]
    losses = []
    for x, y in data:
        trainer.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            h = model.embed_tokens(xm)
            for i in range(len(cuts) - 1):
                h = model.forward_blocks(h, cuts[i], cuts[i + 1])
                if codecs is not None and i < len(cuts) - 2:
                    h = compressed_boundary(h, xm, T, codecs[i])
            _, loss = model.forward_head(h, ym)
            (loss / M).backward()
            total += loss.item()
        if constraint is not None:
            project_gradients_(named, constraint)
        for group in trainer.optimizer.param_groups:
            group["lr"] = trainer.lr
        for g in groups:
            torch.nn.utils.clip_grad_norm_(g, RUN.inner.grad_clip)
        trainer.optimizer.step()
        trainer.step_count += 1
        if constraint is not None:
            constrain_to_subspace_(named, constraint, T)
        losses.append(total / M)
    return model, losses


def assert_close(stages, model, rtol=1e-3):
    ref = dict(model.named_parameters())
    init = dict(build_model(RUN.model, RUN.seed).named_parameters())
    seen = set()
    for s in stages:
        for name, p in s.named_parameters():
            seen.add(name)
            err = float((p.detach() - ref[name].detach()).norm() / ref[name].detach().norm())
            assert err <= rtol, f"{name}: relative difference {err:.2e}"
            assert not torch.equal(ref[name], init[name]) or p.ndim == 1, f"{name} did not train"
    assert seen == set(ref)


# --- stage models --------------------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [(0, 1), (1, 3), (3, 4), (0, 4), (2, 4)])
def test_stage_model_is_the_full_models_share(cuts):
    full = dict(build_model(RUN.model, RUN.seed).named_parameters())
    stage = stage_of(RUN, *cuts)
    shapes = {name: tuple(p.shape) for name, p in stage.named_parameters()}
    assert list(shapes.items()) == list(stage_shapes(RUN, *cuts).items())  # the same names, shapes, order
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name
    assert list(stage.state_dict()) == list(stage_shapes(RUN, *cuts))


def test_stage_init_replays_draws_across_chunks():
    """The skipped embedding spans two draw chunks (> 2^20 values)."""
    spec = ModelSpec(vocab_size=4100, d_model=256, n_layers=2, n_heads=4, ffn_hidden=64, seq_len=8)
    full = dict(build_model(spec, 11).named_parameters())
    stage = build_model(spec, 11, blocks=(1, 2))
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name


def test_stage_model_forward_matches_the_model():
    model = build_model(RUN.model, RUN.seed)
    x, y = batches(1)[0]
    _, want = model(x, y)
    a = stage_of(RUN, 0, 2)
    b = build_model(RUN.model, seed=0, blocks=(2, 4))  # other bits, then the model's tensors loaded
    b.load_state_dict({n: p for n, p in model.state_dict().items() if n in b.state_dict()})
    _, got = b.forward_head(b.forward_blocks(a.forward_blocks(a.embed_tokens(x))), y)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError):
        b.embed_tokens(x)
    with pytest.raises(RuntimeError):
        a.forward_head(x)
    with pytest.raises(ValueError, match="not within"):
        a.forward_blocks(a.embed_tokens(x), 1, 3)


# --- chains over loopback TCP --------------------------------------------------------------------


def test_two_stages_uncompressed_match_one_process():
    data = batches(3)
    codec = link_codec(D, D, RUN.seed, torch.float32)
    stages, trainers, losses = run(train_chain([0, 2, 4], [D], torch.float32, data))
    model, ref_losses = train_reference([0, 2, 4], data, codecs=[codec])
    assert_close(stages, model, rtol=0)  # the same arithmetic in the same order: the same bits
    assert losses == ref_losses
    assert [t.step_count for t in trainers] == [3, 3]
    # and the same as the plain model (no boundary at all): fp32 h - T + T only rounds
    plain, plain_losses = train_reference([0, 2, 4], data)
    assert_close(stages, plain, rtol=1e-3)


def test_two_stages_with_recomputed_blocks_train_the_same_bits(monkeypatch):
    """inner.checkpoint_activations on chain stages: each stage recomputes its blocks in the
    backward of every micro-batch, and the stages end on the same bits and losses as without."""
    data = batches(3)
    plain, _, losses = run(train_chain([0, 2, 4], [D], torch.float32, data))
    monkeypatch.setattr(sys.modules[__name__], "RUN", RUN.replace(inner={"checkpoint_activations": True}))
    stages, trainers, rc_losses = run(train_chain([0, 2, 4], [D], torch.float32, data))
    assert all(s.recompute_blocks for s in stages) and not any(s.recompute_blocks for s in plain)
    assert rc_losses == losses
    for a, b in zip(plain, stages):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_three_stages_fp16_boundaries():
    data = batches(3, seed=1)
    stages, trainers, losses = run(train_chain([0, 1, 3, 4], [D, D], torch.float16, data))
    codec = link_codec(D, D, RUN.seed, torch.float16)
    model, ref_losses = train_reference([0, 1, 3, 4], data, codecs=[codec, codec])
    assert_close(stages, model, rtol=0)
    assert losses == ref_losses
    plain, plain_losses = train_reference([0, 1, 3, 4], data)
    assert losses == pytest.approx(plain_losses, rel=1e-4)
    # fp16 rounding of the boundary only; AdamW turns a tiny gradient difference into an update
    # difference of up to lr where a gradient entry is near zero, hence the loose bound
    assert_close(stages, plain, rtol=5e-2)


def test_compressed_link_learns_a_repeated_batch():
    data = batches(25, seed=2, repeat=True)
    _, _, losses = run(train_chain([0, 2, 4], [8], torch.float16, data))
    assert losses[-1] < 0.6 * losses[0], losses


def test_constrained_compressed_chain_is_lossless():
    """k = d/4 with the output projections and the embedding drift in span(U): the chain trains
    what one process trains with the same constraint and no boundary, up to fp16 rounding."""
    U = subspace_basis(D, 8, RUN.seed)
    data = batches(3, seed=3)
    stages, _, losses = run(train_chain([0, 2, 4], [8], torch.float16, data, constraint=U))
    codec = link_codec(D, 8, RUN.seed, torch.float16)
    emulated, _ = train_reference([0, 2, 4], data, codecs=[codec], constraint=U)
    assert_close(stages, emulated, rtol=0)
    one_box, ref_losses = train_reference([0, 2, 4], data, constraint=U)
    assert_close(stages, one_box, rtol=5e-2)  # fp16 rounding, amplified by AdamW as above
    assert losses == pytest.approx(ref_losses, rel=1e-3)


def test_single_stage_chain_needs_no_links():
    data = batches(2, seed=4)
    (stage,), (trainer,) = make_stages([0, 4])
    T = stage.embed.weight.detach().clone()
    losses = [run(run_inner_step(stage, trainer, T=T, micro_batches=M, batch=b)) for b in data]
    model, ref = train_reference([0, 4], data)
    assert losses == pytest.approx(ref, rel=1e-6)
    assert_close([stage], model, rtol=1e-6)


def test_a_round_closed_by_the_first_stage_ends_at_the_same_step_on_every_stage():
    """Early close of a chain (peer/round/loop.py, peer/round/early_close.py): after two steps the first
    stage sends ``close`` instead of step 2's activations. The middle stage's step raises RoundClosed
    and passes it on, the last stage's too; neither touches its parameters, the links stay up, and
    the chain's next round goes on from the same step ids. A close of another step breaks the link, and
    so does one under the round's floor (``close_from``), which the middle stage then passes on to no one."""

    async def go():
        stages, trainers = make_stages([0, 1, 3, 4])
        T = stages[0].embed.weight.detach().clone()
        up, down, listeners = await connect_chain(stages, [D, D], torch.float16)
        data = batches(3, seed=5)

        def step(i, b):
            return run_inner_step(stages[i], trainers[i], T=T, micro_batches=M, batch=b if i in (0, 2) else None,
                                  upstream=up[i], downstream=down[i])

        try:
            for b in data[:2]:
                await asyncio.gather(*(step(i, b) for i in range(3)))
            before = [{n: p.detach().clone() for n, p in s.named_parameters()} for s in stages]
            assert [t.step_count for t in trainers] == [2, 2, 2]
            await close_round(down[0], trainers[0].step_count)
            for i in (1, 2):
                with pytest.raises(RoundClosed) as closed:
                    await step(i, data[2])
                assert closed.value.step == 2
            for s, params in zip(stages, before):
                assert all(torch.equal(p, params[n]) for n, p in s.named_parameters())
            assert [t.step_count for t in trainers] == [2, 2, 2]
            loss = (await asyncio.gather(*(step(i, data[2]) for i in range(3))))[-1]  # the next round, same links
            assert loss is not None and [t.step_count for t in trainers] == [3, 3, 3]
            await close_round(down[0], 7)  # not the step the next stage waits for
            with pytest.raises(LinkProtocolError, match="close before step 7"):
                await step(1, data[2])
        finally:
            await close_chain(up, down, listeners)

    async def under_the_floor():  # a close before the round's floor: the link breaks, nothing passed on
        stages, trainers = make_stages([0, 1, 3, 4])
        T = stages[0].embed.weight.detach().clone()
        up, down, listeners = await connect_chain(stages, [D, D], torch.float16)
        try:
            await close_round(down[0], 0)
            with pytest.raises(LinkProtocolError, match="under the round's floor"):
                await run_inner_step(stages[1], trainers[1], T=T, micro_batches=M, upstream=up[1], downstream=down[1],
                                     close_from=1)
            assert up[1].closed and not down[1].closed  # the middle stage passed no close on
        finally:
            await close_chain(up, down, listeners)

    run(go())
    run(under_the_floor())
