"""θ does not depend on torch's thread count: members with 1 and with 2 CPU threads (a peer takes its
share of its host's cores: peer/host/cpu_share.py) conclude a round to the same bits. torch's sums and
dot products split by thread count (their float32 results differ between 1 and 2 threads on tensors
this size); the outer step's arithmetic avoids them (peer/outer/robust.py)."""

import pytest
import torch

from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from protocol.spec import RunSpec

# tensors large enough for torch to split their work across threads
SPEC = RunSpec().replace(model={"d_model": 256, "n_layers": 2, "n_heads": 4, "ffn_hidden": 512, "seq_len": 16})


def _with_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_torch_s_own_sum_would_differ():
    """The hazard the outer step avoids, shown on this machine: a float32 sum at 1 and 2 threads."""
    x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))
    one, two = _with_threads(1, lambda: x.sum().item()), _with_threads(2, lambda: x.sum().item())
    if one == two:
        pytest.skip("this torch build sums alike at 1 and 2 threads")
    assert one != two


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco", "dct"])
def test_a_round_concluded_at_1_and_at_2_threads_ends_on_the_same_bits(strategy):
    spec = SPEC.replace(outer={"strategy": strategy})
    gen = torch.Generator().manual_seed(0)
    theta = {name: torch.randn(shape, generator=gen) for name, shape in spec.param_shapes().items()}
    common = {k: torch.randn(v.shape, generator=gen) for k, v in theta.items()}
    payloads, pendings = {}, {}
    for i in range(4):
        own = torch.Generator().manual_seed(100 + i)
        trained = {k: v - 0.01 * (common[k] + 0.5 * torch.randn(v.shape, generator=own)) for k, v in theta.items()}
        sender = RoundEngine(make_strategy(spec), {k: v.clone() for k, v in theta.items()})
        payloads[f"peer{i}"], pendings[f"peer{i}"] = sender.encode(sender.theta, trained)

    def conclude():
        member = RoundEngine(make_strategy(spec), {k: v.clone() for k, v in theta.items()})
        settled = member.settle_round(payloads, None, me="observer")
        return member.params_hash(), member.state_digest(), settled.contributors

    one, two = _with_threads(1, conclude), _with_threads(2, conclude)
    assert one[2] == 4, one  # every contribution counted: the arithmetic ran on all of them
    assert one == two
