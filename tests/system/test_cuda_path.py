"""The CUDA path: inner steps on a GPU, the round logic unchanged.

The inner steps, evaluation and the encoder (pseudo-gradient, error feedback, top-k, quantization,
DCT) run on the device; θ, decoding, aggregation and the outer step stay on the CPU in float32
(``RoundEngine``, peer/outer/strategies.py). So a member that trains on CUDA and one that trains on the
CPU must decode and aggregate the same agreed payloads into bit-identical θ.

Skipped where ``torch.cuda.is_available()`` is False (CI, laptops).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine"
)

from peer.training.data import load_corpus  # noqa: E402
from peer.training.model import build_model  # noqa: E402
from peer.training.roles import FullReplica  # noqa: E402
from peer.outer.engine import RoundEngine  # noqa: E402
from peer.round.simulate import simulate  # noqa: E402
from peer.outer.strategies import make_strategy  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402

SPEC = RunSpec().replace(
    model={"d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 176, "seq_len": 64},
    outer={"inner_steps": 5},
    data={"batch_size": 8, "val_batches": 2},
    inner={"warmup_steps": 2, "total_steps": 100},  # a short warm-up, so that 10 steps visibly lower the loss
)
STRATEGIES = ["sparseloco", "diloco", "dct"]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(SPEC.data.corpus, SPEC.data.val_fraction)


def _cpu_theta(spec: RunSpec):
    model = build_model(spec.model, spec.seed)
    return {n: p.detach().to("cpu", torch.float32).clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_simulate_on_cuda_keeps_replicas_identical_and_learns(strategy, corpus):
    spec = SPEC.replace(outer={"strategy": strategy})
    result = simulate(spec, replicas=2, rounds=2, corpus=corpus, device="cuda", verify_rounds=2)
    # simulate itself raises if the replicas' θ differ after a round or a replica decodes differently
    assert result.verified_rounds == 2 and len(result.history) == 2
    assert all(r.params_hash for r in result.history)
    assert result.history[-1].tokens == 2 * 2 * 5 * 8 * 64
    assert all(torch.isfinite(torch.tensor(r.train_loss)) for r in result.history)
    assert result.final_val_loss < result.initial_val_loss, (result.initial_val_loss, result.final_val_loss)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_cuda_member_and_a_cpu_member_settle_to_identical_theta(strategy, corpus):
    spec = SPEC.replace(outer={"strategy": strategy})
    theta0 = _cpu_theta(spec)
    members = {}
    for name, device in (("gpu-member", torch.device("cuda")), ("cpu-member", torch.device("cpu"))):
        role = FullReplica(spec, build_model(spec.model, spec.seed), device, corpus, name)
        engine = RoundEngine(role.strategy, {n: t.clone() for n, t in theta0.items()})
        members[name] = (role, engine)
    gpu_role, _ = members["gpu-member"]
    assert all(p.device.type == "cuda" for p in gpu_role.params.values())

    for round_no in range(2):
        payloads, pendings = {}, {}
        for name, (role, engine) in members.items():
            role.load_theta(engine.theta)
            # θ -> model -> CPU is exact on either device (fp32 copies)
            assert all(torch.equal(p.detach().cpu(), engine.theta[n]) for n, p in role.params.items())
            for _ in range(spec.outer.inner_steps):
                loss = role.inner_step(*role.stream.next_batch())
                assert loss == loss and loss < 100  # finite
            payloads[name], pendings[name] = engine.encode(engine.theta, role.params)
            if round_no == 0:
                # a CUDA member encodes on its GPU (peer/outer/strategies.py): its bytes are those its
                # parameters, copied to the CPU, encode to up to device rounding (top-k ties, bin
                # means); dense fp32 has no arithmetic, a CPU member none of that difference
                twin = RoundEngine(make_strategy(spec), {n: t.clone() for n, t in theta0.items()})
                cpu_copy = {n: p.detach().cpu() for n, p in role.params.items()}
                twin_bytes = twin.encode(twin.theta, cpu_copy)[0]
                assert len(twin_bytes) == len(payloads[name])
                if name == "cpu-member" or strategy == "diloco":
                    assert twin_bytes == payloads[name]
        assert payloads["gpu-member"] != payloads["cpu-member"]  # they trained on different shards
        before = {name: engine.params_hash() for name, (_, engine) in members.items()}
        assert len(set(before.values())) == 1
        for name, (role, engine) in members.items():
            settled = engine.settle_round(payloads, pendings[name], me=name)
            assert settled.round == round_no and settled.contributors == 2 and settled.delivered and not settled.excluded
        (_, a), (_, b) = members.values()
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in a.theta.values())
        assert all(torch.equal(a.theta[n], b.theta[n]) for n in a.theta), f"round {round_no}: θ differs"
        assert a.params_hash() == b.params_hash() != before["gpu-member"]
        assert a.round == b.round == round_no + 1
        # the members' local buffers (error feedback, DCT momentum) are their own; the shared state is not
        sa, sb = a.strategy.shared_state(), b.strategy.shared_state()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- chain stages on CUDA (issue: chain stages crashed at their first step on a GPU box) ----------


def test_a_chain_with_a_cuda_stage_and_a_cpu_stage_trains_like_one_process():
    """Stage 0 on the GPU (bf16 autocast), stage 1 on the CPU, fp32 links: the batch, T and the
    frames cross devices and the chain trains as the model does in one process, within bf16's
    rounding."""
    from peer.chain.links import link_codec, run
    from tests.chain.test_pipeline import D, RUN as CHAIN_RUN, batches, train_chain, train_reference

    assert CHAIN_RUN.inner.precision == "auto"
    data = batches(3)
    stages, trainers, losses = run(train_chain([0, 2, 4], [D], torch.float32, data, devices=["cuda", "cpu"]))
    assert [next(s.parameters()).device.type for s in stages] == ["cuda", "cpu"]
    assert trainers[0].precision == "bf16" and trainers[1].precision == "fp32"  # "auto": bf16 autocast on CUDA
    assert all(torch.isfinite(torch.tensor(losses)))
    model, ref_losses = train_reference([0, 2, 4], data, codecs=[link_codec(D, D, CHAIN_RUN.seed, torch.float32)])
    assert losses == pytest.approx(ref_losses, rel=5e-2)  # bf16 forward on stage 0
    for stage in stages:
        for name, p in stage.named_parameters():
            assert bool(torch.isfinite(p).all()), name


def test_a_compressed_cuda_chain_with_the_subspace_constraint_learns():
    """Both stages on the GPU, a rank-8 link, the lossless constraint's U on the device: a
    repeated batch's loss falls."""
    from peer.chain.links import run
    from protocol.chain.subspace import subspace_basis
    from tests.chain.test_pipeline import D, RUN as CHAIN_RUN, batches, train_chain

    U = subspace_basis(D, 8, CHAIN_RUN.seed)
    data = batches(12, repeat=True)
    stages, trainers, losses = run(train_chain([0, 2, 4], [8], torch.bfloat16, data, constraint=U, devices=["cuda", "cuda"]))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] * 0.8, losses
