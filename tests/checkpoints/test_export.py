"""``voloco export``: a peer's checkpoint as a Hugging Face transformers Llama model whose logits
are voloco's, with a tokenizer that gives peer/training/data.py's ids."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peer.checkpoints import contents as checkpoints
from peer.training.data import encode
from peer.training.inner import InnerTrainer
from peer.training.model import build_model
from peer.checkpoints.files import CHECKPOINT_NAME, PREVIOUS_NAME
from protocol.spec import RunSpec
from voloco.cli import main
from voloco.export import byte_tokenizer, hf_weights, load_run

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SMALL = {"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 96, "seq_len": 32}}
TEXTS = ["hello, world", "héllo wörld 🙂\n\ttabs  and  spaces", "def f(x):\n    return x ** 2\n", "\x00\x01\x7f\u00ff"]


def write_checkpoint(directory: Path, spec: RunSpec, seed: int = 0, round_no: int = 3):
    """A checkpoint as a peer writes it (peer/checkpoints/contents.py ``save``), of a model built from ``seed``:
    the engine and role carry exactly what ``save`` reads."""
    model = build_model(spec.model, seed, spec.partial.slices, spec.partial.attn_slices)
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    strategy = SimpleNamespace(shared_state=dict, local_state=dict)
    engine = SimpleNamespace(lock=threading.Lock(), theta=theta, strategy=strategy, round=round_no, standing={}, eligibility={},
                             evidence={})
    role = SimpleNamespace(trainer=InnerTrainer(model, spec.inner), part=-1, stream=SimpleNamespace(state_dict=dict))
    checkpoints.save(Path(directory), spec, engine, role, tokens=1234)
    return model.eval()


def _hf(out: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


@pytest.mark.parametrize("changes", [
    {},
    {"partial": {"slices": 2, "attention": True}},  # sliced projections are put back together
    {"model": {"rope_theta": 500000.0, "norm_eps": 1e-6}},
], ids=["plain", "sliced", "rope-eps"])
def test_exported_model_gives_voloco_logits(tmp_path, changes):
    spec = RunSpec.from_dict({**SMALL, **changes, "model": {**SMALL["model"], **changes.get("model", {})}})
    model = write_checkpoint(tmp_path / "ckpt", spec, seed=7)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf = _hf(tmp_path / "hf")
    x = torch.randint(0, 256, (3, spec.model.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(x)
        theirs = hf(x).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{changes}: max abs logit difference {diff:.3g}")
    assert diff < 1e-4
    # a shorter sequence too: RoPE positions start at 0 in both
    with torch.no_grad():
        assert (model(x[:, :5])[0] - hf(x[:, :5]).logits).abs().max().item() < 1e-4


def test_config_matches_the_shapes(tmp_path):
    spec = RunSpec.from_dict(SMALL)
    write_checkpoint(tmp_path / "ckpt", spec)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "hf"))
    m = spec.model
    assert config.model_type == "llama"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (m.d_model, m.ffn_hidden, m.n_layers)
    assert (config.num_attention_heads, config.num_key_value_heads) == (m.n_heads, m.n_heads)
    assert (config.vocab_size, config.max_position_embeddings, config.rms_norm_eps) == (m.vocab_size, m.seq_len, m.norm_eps)
    assert config.tie_word_embeddings is False
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert raw["rope_theta"] == m.rope_theta and raw["voloco_spec_digest"] == spec.digest()
    names = set(hf_weights(spec, load_run(tmp_path / "ckpt").theta))
    assert names == set(_hf(tmp_path / "hf").state_dict())


def test_tokenizer_round_trips_peer_data_ids(tmp_path):
    write_checkpoint(tmp_path / "ckpt", RunSpec.from_dict(SMALL))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in TEXTS:
        ids = encode(text).tolist()
        assert tok(text)["input_ids"] == ids
        assert tok.decode(ids) == text
    every_byte = bytes(range(256)).decode("latin-1")
    assert tok(every_byte)["input_ids"] == list(every_byte.encode("utf-8"))
    assert sorted(byte_tokenizer().get_vocab().values()) == list(range(256))


def test_bpe_runs_tokenizer_is_copied(tmp_path):
    """A BPE run keeps its tokenizer.json beside the checkpoint: it is copied, checked against the spec."""
    import hashlib

    source = tmp_path / "bpe.json"
    byte_tokenizer().save(str(source))  # any valid tokenizer.json stands in for a trained one
    sha = hashlib.sha256(source.read_bytes()).hexdigest()
    spec = RunSpec.from_dict({**SMALL, "model": {**SMALL["model"], "vocab_size": 300},
                              "data": {"tokenizer": "bpe", "tokenizer_sha256": sha}})
    write_checkpoint(tmp_path / "ckpt", spec)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2  # the file is missing
    (tmp_path / "ckpt" / "tokenizer.json").write_bytes(source.read_bytes())
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == source.read_bytes()
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).vocab_size == 300
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")  # not the run's tokenizer
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf2")]) == 2


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("voloco export: error: ")
    return err[0]


def test_not_a_checkpoint_directory_is_one_error(tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "hf")]) == 2
    assert "is not a directory" in _error(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "hf")]) == 2
    assert "is not a voloco checkpoint directory" in _error(capsys)
    assert not (tmp_path / "hf").exists()


def test_corrupt_checkpoint_is_one_error(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt", RunSpec.from_dict(SMALL))
    path = tmp_path / "ckpt" / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert "checksum does not match" in _error(capsys)
    path.write_bytes(b"not safetensors")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert "no usable voloco checkpoint" in _error(capsys)


def test_damaged_newest_falls_back_to_the_previous(tmp_path):
    spec = RunSpec.from_dict(SMALL)
    write_checkpoint(tmp_path / "ckpt", spec, seed=1, round_no=1)
    write_checkpoint(tmp_path / "ckpt", spec, seed=2, round_no=2)
    assert (tmp_path / "ckpt" / PREVIOUS_NAME).is_file()
    (tmp_path / "ckpt" / CHECKPOINT_NAME).write_bytes(b"\x00" * 100)
    run = load_run(tmp_path / "ckpt")
    assert run.meta["round"] == 1 and run.path.name == PREVIOUS_NAME


def test_spec_comes_from_the_flag_when_not_recorded(tmp_path, capsys):
    """A checkpoint of an older voloco names its spec's digest only: --spec supplies the spec."""
    from peer.checkpoints.files import read_checkpoint, save_checkpoint

    spec = RunSpec.from_dict(SMALL)
    write_checkpoint(tmp_path / "ckpt", spec)
    tensors, meta = read_checkpoint(tmp_path / "ckpt" / CHECKPOINT_NAME)
    del meta["run_spec"]
    save_checkpoint(tmp_path / "old", tensors, meta)
    assert main(["export", str(tmp_path / "old"), str(tmp_path / "hf")]) == 2
    assert "--spec" in _error(capsys)
    (tmp_path / "run.toml").write_text(spec.to_toml())
    assert main(["export", str(tmp_path / "old"), str(tmp_path / "hf"), "--spec", str(tmp_path / "run.toml")]) == 0
    (tmp_path / "other.toml").write_text(spec.replace(seed=5).to_toml())
    assert main(["export", str(tmp_path / "old"), str(tmp_path / "hf"), "--spec", str(tmp_path / "other.toml")]) == 2
    assert "has digest" in _error(capsys)
