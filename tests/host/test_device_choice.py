"""What a peer trains on: peer/host/device_choice.py's table, and the flags that feed it."""

from __future__ import annotations

import pytest

from peer.host.device_choice import Machine, choose
from tests.host.test_cli import UNREACHABLE, assert_usage_error
from tests.support.swarm_harness import run_cli

GPU = Machine(cuda=True, cuda_names=("NVIDIA H200",), cpu_threads=16)
TWO_GPUS = Machine(cuda=True, cuda_names=("NVIDIA H100 80GB HBM3", "NVIDIA RTX 4090"), cpu_threads=32)
CPU = Machine(cuda=False, cpu_threads=2)


@pytest.mark.parametrize(
    "device, compile, threads, machine, want_device, want_compile",
    [
        ("auto", None, None, GPU, "cuda", True),  # a GPU box: the GPU, compiled
        ("auto", None, None, CPU, "cpu", False),  # no GPU: the CPU, eager
        ("auto", False, None, GPU, "cuda", False),  # --no-compile
        ("auto", True, None, CPU, "cpu", True),  # --compile on the CPU, as asked
        ("cpu", None, None, GPU, "cpu", False),  # --device cpu on a GPU box: eager CPU
        ("cuda:1", None, 4, GPU, "cuda:1", True),
        ("cuda", True, None, GPU, "cuda", True),
    ],
)
def test_the_choice_table(device, compile, threads, machine, want_device, want_compile):
    choice = choose(device, compile, threads, machine)
    assert (choice.device, choice.compile, choice.threads) == (want_device, want_compile, threads)
    line = choice.describe(machine)
    assert want_device in line and ("torch.compile on" if want_compile else "torch.compile off") in line
    assert f"{threads or machine.cpu_threads} CPU threads" in line


def test_the_log_line_says_why():
    assert "found a CUDA device" in choose("auto", None, None, GPU).describe(GPU)
    assert "NVIDIA H200" in choose("auto", None, None, GPU).describe(GPU)
    assert "found no CUDA device" in choose("auto", None, None, CPU).describe(CPU)
    assert "--no-compile turns it off" in choose("auto", None, None, GPU).why
    assert "--device cpu" in choose("cpu", None, None, GPU).why


def test_the_line_names_the_gpu_chosen_and_tells_a_multi_gpu_box_to_run_a_peer_per_gpu():
    """``--device cuda:1`` names GPU 1, not GPU 0; ``--device auto`` takes the first GPU of several and
    says how to use the others (each peer sizes itself to its GPU's memory: two on one GPU would not fit)."""
    line = choose("cuda:1", None, None, TWO_GPUS).describe(TWO_GPUS)
    assert "cuda:1 (NVIDIA RTX 4090)" in line and "H100" not in line
    auto = choose("auto", None, None, TWO_GPUS)
    assert auto.device == "cuda" and "cuda (NVIDIA H100 80GB HBM3)" in auto.describe(TWO_GPUS)
    assert "the first of 2 GPUs: start one peer per GPU with --device cuda:0 ... cuda:1" in auto.why
    assert "GPUs" not in choose("auto", None, None, GPU).why
    assert choose("cuda:3", None, None, TWO_GPUS).describe(TWO_GPUS).startswith("training on cuda:3,")  # unknown: no name


def test_a_device_that_is_not_one_is_a_usage_error():
    assert_usage_error(run_cli("peer", "--join", UNREACHABLE, "--device", "tpu:banana"), "--device", "auto")


def test_help_explains_the_device_and_compile_flags():
    out = run_cli("peer", "--help").stdout
    assert "--device" in out and "auto" in out and "--no-compile" in out


def test_a_gpu_index_the_machine_lacks_is_a_usage_error_at_start(monkeypatch):
    """``--device cuda:3`` on a one-GPU box is refused with the devices there are, not with torch's
    "invalid device ordinal" at the first step."""
    import torch

    from peer.host.cli import _check_device
    from swarm.console import UsageError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _check_device("cuda:0")
    _check_device("cuda")
    with pytest.raises(UsageError, match="1 CUDA device.*cuda:0 to cuda:0"):
        _check_device("cuda:3")
