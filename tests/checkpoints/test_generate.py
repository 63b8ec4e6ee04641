"""``voloco generate``: text sampled from a peer's checkpoint."""

from __future__ import annotations

import pytest
import torch

from protocol.spec import RunSpec
from tests.checkpoints.test_export import SMALL, write_checkpoint
from voloco.cli import main
from voloco.export import load_run
from voloco.generate import sample


def _generate(capsys, argv):
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_from_a_checkpoint(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt", RunSpec.from_dict(SMALL), seed=3)
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "def ", "--max-new-tokens", "40", "--seed", "1"]
    code, out, err = _generate(capsys, argv)
    assert code == 0, err
    assert out.startswith("def ")
    assert "round 3" in err and "40 new tokens" in err
    again = _generate(capsys, argv)
    assert again[1] == out  # the same seed, the same text
    other = _generate(capsys, argv[:-1] + ["2"])
    assert other[1] != out


def test_sample_follows_the_model(tmp_path):
    """Greedy sampling is the argmax of voloco's own forward, step by step, past seq_len."""
    spec = RunSpec.from_dict(SMALL)
    write_checkpoint(tmp_path / "ckpt", spec, seed=4)
    model = load_run(tmp_path / "ckpt").model()
    prompt = list(b"hello")
    n = spec.model.seq_len + 8  # the context is cut to the last seq_len tokens
    got = sample(model, prompt, n, temperature=0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids[-spec.model.seq_len:]]))
            ids.append(int(logits[0, -1].argmax()))
    assert got == ids[len(prompt):]
    assert all(0 <= t < 256 for t in sample(model, prompt, 20, temperature=1.0, top_k=1, seed=5))
    assert sample(model, prompt, 20, temperature=1.0, top_k=1, seed=5) == got[:20]  # top-1 is greedy


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "0"], "--top-k"),
])
def test_bad_flags_exit_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--checkpoint", str(tmp_path), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_not_a_checkpoint_is_one_error(tmp_path, capsys):
    code, out, err = _generate(capsys, ["--checkpoint", str(tmp_path)])
    assert code == 2 and out == ""
    assert err.strip().startswith("voloco generate: error: ") and "not a voloco checkpoint directory" in err


@pytest.mark.parametrize("command", ["export", "generate"])
def test_help_explains_every_flag(command, capsys):
    import argparse

    from voloco.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for action in sub._actions:
        assert action.help and len(action.help) > 15, action.dest
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    assert "flags > environment > settings file > defaults" in " ".join(capsys.readouterr().out.split())


def test_flags_come_from_the_environment_too(tmp_path, capsys, monkeypatch):
    write_checkpoint(tmp_path / "ckpt", RunSpec.from_dict(SMALL), seed=3)
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--max-new-tokens", "30", "--temperature", "0"]
    greedy = _generate(capsys, argv)[1]
    monkeypatch.setenv("VOLOCO_TEMPERATURE", "0")
    assert _generate(capsys, argv[:4])[1] == greedy
