"""``voloco export CHECKPOINT_DIR OUT_DIR``: a peer's checkpoint as a Hugging Face Llama model.

OUT_DIR gets what ``transformers.AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` read: ``config.json`` (a LlamaConfig with this run's shapes),
``model.safetensors`` (float32, Hugging Face names) and the tokenizer (``tokenizer.json`` and
``tokenizer_config.json``). transformers itself is not needed to export.

The mapping is exact, no permutation: peer/training/model.py already rotates the pairs (i, i + head_dim/2)
("rotate half"), as transformers' Llama does; its fused ``qkv`` rows are q, k, v one after the
other, each head after head, so they split into ``q_proj``, ``k_proj``, ``v_proj`` as they are.
Under partial updates (``[partial] slices > 1``) a projection is stored as slices, which are put
back together here (qkv slice by slice into q, k and v; the output and down projections by
columns). The head is untied (``tie_word_embeddings = false``) as in voloco.

Tokenizer: a BPE run's (``data.tokenizer = "bpe"``) ``tokenizer.json``, which its peers keep
beside their checkpoint, is copied after checking it against ``data.tokenizer_sha256``; a
byte-level run (peer/training/data.py: token id = utf-8 byte value) gets a ``tokenizers`` byte-level
tokenizer with exactly that mapping.

The checkpoint's run spec comes from its metadata (peers record it there), or from ``--spec``
for a checkpoint written before they did; either must have the digest the checkpoint names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from peer.checkpoints.contents import check_meta
from peer.checkpoints.files import CheckpointError, Tensors, checkpoint_paths, read_checkpoint
from protocol.errors import SpecError
from protocol.model.layout import tensor_name
from protocol.spec import RunSpec
from swarm.console import UsageError

logger = logging.getLogger("voloco.export")

HELP = "write a peer's checkpoint as a Hugging Face transformers Llama model (config, weights, tokenizer)"
TOKENIZER_NAME = "tokenizer.json"
BYTE_VOCAB = 256

__all__ = ["HELP", "add_arguments", "run_export", "load_run", "export", "hf_weights", "byte_tokenizer", "LoadedRun"]


# --- reading a checkpoint ------------------------------------------------------------------------
class LoadedRun:
    """A checkpoint's run spec, its θ (this run's tensor names, maybe sliced) and where it came from."""

    def __init__(self, spec: RunSpec, theta: Tensors, meta: Dict[str, Any], path: Path):
        self.spec, self.theta, self.meta, self.path = spec, theta, meta, path

    @property
    def tokenizer_file(self) -> Optional[Path]:
        """The run's tokenizer.json beside the checkpoint; None for a byte-level run. UsageError if
        a BPE run's file is missing or is not the one its spec names (``data.tokenizer_sha256``)."""
        data = self.spec.data
        if getattr(data, "tokenizer", "bytes") == "bytes":
            return None
        p = self.path.parent / TOKENIZER_NAME
        if not p.is_file():
            raise UsageError(f"the run uses a BPE tokenizer and {p.parent} has no {TOKENIZER_NAME}: copy the run's file there")
        want = getattr(data, "tokenizer_sha256", "")
        if want and hashlib.sha256(p.read_bytes()).hexdigest() != want:
            raise UsageError(f"{p} is not the run's tokenizer: its sha256 differs from data.tokenizer_sha256 ({want[:16]}...)")
        return p

    def model(self):
        """peer/training/model.py's Model with this checkpoint's weights, in eval mode, on the CPU."""
        from peer.training.model import Model

        spec = self.spec
        with torch.random.fork_rng(devices=[]):
            model = Model(spec.model, spec.partial.slices, spec.partial.attn_slices)
        model.load_state_dict(self.theta, strict=True)
        return model.eval()


def _spec_of(meta: Dict[str, Any], spec_file: Optional[Path]) -> RunSpec:
    if spec_file is not None:
        try:
            spec = RunSpec.from_toml(Path(spec_file).read_text())
        except OSError as e:
            raise UsageError(f"cannot read the run spec {spec_file}: {e.strerror or e}") from None
        except SpecError as e:
            raise UsageError(f"the run spec {spec_file} is not valid: {e}") from None
        where = str(spec_file)
    else:
        recorded = meta.get("run_spec")
        if not isinstance(recorded, dict):
            raise CheckpointError(
                "it does not record its run spec (written by an older voloco): pass --spec RUN.toml, the run's spec"
            )
        try:
            spec = RunSpec.from_dict(recorded)
        except SpecError as e:
            raise CheckpointError(f"its recorded run spec is not valid: {e}") from None
        where = "its recorded run spec"
    if spec.digest() != meta["spec"]:
        raise CheckpointError(f"it is from run spec {meta['spec']}, and {where} has digest {spec.digest()}")
    return spec


def _load_one(path: Path, spec_file: Optional[Path]) -> LoadedRun:
    tensors, meta = read_checkpoint(path)
    check_meta(meta)
    spec = _spec_of(meta, spec_file)
    theta: Tensors = {}
    for name, shape in spec.param_shapes().items():
        t = tensors.get(f"theta.{name}")
        if t is None or t.dtype != torch.float32 or tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"it has no float32 tensor theta.{name} of shape {tuple(shape)} (a chain stage's checkpoint holds only part of the model)"
            )
        theta[name] = t
    return LoadedRun(spec, theta, meta, path)


def load_run(directory: Path, spec_file: Optional[Path] = None) -> LoadedRun:
    """The newest usable checkpoint in ``directory`` (the previous one if the newest is refused,
    with a warning); UsageError naming every reason when none is usable."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory: pass the --checkpoint-dir of a voloco peer")
    paths = [p for p in checkpoint_paths(directory) if p.is_file()]
    if not paths:
        newest = checkpoint_paths(directory)[0].name
        raise UsageError(f"{directory} is not a voloco checkpoint directory: it has no {newest} (pass a peer's --checkpoint-dir)")
    reasons: List[str] = []
    for path in paths:
        try:
            run = _load_one(path, spec_file)
        except (CheckpointError, ValueError) as e:
            reasons.append(f"{path.name}: {e}")
            continue
        if reasons:
            logger.warning(f"using {path.name}: refused {reasons[-1]}")
        return run
    raise UsageError(f"no usable voloco checkpoint in {directory}: " + "; ".join(reasons))


# --- the Hugging Face form -----------------------------------------------------------------------
def _fused(theta: Tensors, kind: str, block: int, slices: int, axis: int) -> torch.Tensor:
    if slices == 1:
        return theta[tensor_name(kind, block)]
    return torch.cat([theta[tensor_name(kind, block, s)] for s in range(slices)], dim=axis)


def hf_weights(spec: RunSpec, theta: Tensors) -> Dict[str, torch.Tensor]:
    """θ under transformers' LlamaForCausalLM names, float32, contiguous."""
    m, mlp_s, attn_s = spec.model, spec.partial.slices, spec.partial.attn_slices
    d = m.d_model
    out = {"model.embed_tokens.weight": theta[tensor_name("embed")]}
    for i in range(m.n_layers):
        pre = f"model.layers.{i}."
        # each qkv slice holds its own heads' q, k and v rows in that order
        parts = [theta[tensor_name("qkv", i, None if attn_s == 1 else s)] for s in range(attn_s)]
        q, k, v = (torch.cat([p.view(3, d // attn_s, d)[j] for p in parts], dim=0) for j in range(3))
        out[pre + "self_attn.q_proj.weight"] = q
        out[pre + "self_attn.k_proj.weight"] = k
        out[pre + "self_attn.v_proj.weight"] = v
        out[pre + "self_attn.o_proj.weight"] = _fused(theta, "attn_out", i, attn_s, 1)
        out[pre + "mlp.gate_proj.weight"] = _fused(theta, "gate", i, mlp_s, 0)
        out[pre + "mlp.up_proj.weight"] = _fused(theta, "up", i, mlp_s, 0)
        out[pre + "mlp.down_proj.weight"] = _fused(theta, "down", i, mlp_s, 1)
        out[pre + "input_layernorm.weight"] = theta[tensor_name("attn_norm", i)]
        out[pre + "post_attention_layernorm.weight"] = theta[tensor_name("mlp_norm", i)]
    out["model.norm.weight"] = theta[tensor_name("norm")]
    out["lm_head.weight"] = theta[tensor_name("head")]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def hf_config(spec: RunSpec) -> Dict[str, Any]:
    """config.json of a LlamaConfig with this run's shapes. RoPE is given both as ``rope_theta``
    (transformers 4) and ``rope_parameters`` (transformers 5)."""
    m = spec.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "head_dim": m.d_model // m.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": m.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "initializer_range": m.init_std,
        "use_cache": True,
        "bos_token_id": None,  # a byte-level model has no special tokens
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "voloco_run_id": spec.run_id,
        "voloco_spec_digest": spec.digest(),
    }


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's printable stand-in of each byte, the alphabet of ``tokenizers``' ByteLevel pre-tokenizer."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids are the utf-8 bytes of the text, as peer/training/data.py's
    ``encode``: a byte-level BPE with the 256 byte symbols (id = byte value) and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _tokenizer_config(spec: RunSpec) -> Dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": spec.model.seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def export(run: LoadedRun, out_dir: Path) -> List[Path]:
    """Write the Hugging Face files of ``run`` into ``out_dir``; the paths written."""
    from safetensors.torch import save_file

    spec = run.spec
    source = run.tokenizer_file
    if source is None and spec.model.vocab_size < BYTE_VOCAB:
        raise UsageError(f"model.vocab_size is {spec.model.vocab_size}: a byte-level model needs {BYTE_VOCAB} tokens")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir} exists and is not a directory")
    if out_dir.resolve() == run.path.parent.resolve():
        raise UsageError("OUT_DIR must not be the checkpoint directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    config = out_dir / "config.json"
    config.write_text(json.dumps(hf_config(spec), indent=2) + "\n")
    written.append(config)
    weights = out_dir / "model.safetensors"
    save_file(hf_weights(spec, run.theta), str(weights), metadata={"format": "pt"})
    written.append(weights)
    tokenizer = out_dir / TOKENIZER_NAME
    if source is not None:
        shutil.copyfile(source, tokenizer)
    else:
        byte_tokenizer().save(str(tokenizer))
    written.append(tokenizer)
    tok_config = out_dir / "tokenizer_config.json"
    tok_config.write_text(json.dumps(_tokenizer_config(spec), indent=2) + "\n")
    written.append(tok_config)
    return written


# --- the command ---------------------------------------------------------------------------------
def add_spec_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", type=Path, metavar="RUN.toml", default=None,
        help="the run spec (TOML) of a checkpoint that does not record it (written by an older voloco);"
        " it must have the digest the checkpoint names (default: the spec recorded in the checkpoint)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint_dir", type=Path, metavar="CHECKPOINT_DIR",
        help="a peer's --checkpoint-dir (holds checkpoint.safetensors; the previous checkpoint is used if the newest is damaged)",
    )
    parser.add_argument(
        "out_dir", type=Path, metavar="OUT_DIR",
        help="where to write config.json, model.safetensors, tokenizer.json and tokenizer_config.json"
        " (created if missing; files of those names are overwritten)",
    )
    add_spec_argument(parser)


def run_export(args: argparse.Namespace) -> int:
    run = load_run(args.checkpoint_dir, args.spec)
    files = export(run, args.out_dir)
    m = run.spec.model
    print(
        f"exported round {run.meta['round']} of run {run.spec.run_id!r} ({m.num_params():,} parameters,"
        f" {m.n_layers} layers, d_model {m.d_model}) to {args.out_dir}: {', '.join(p.name for p in files)}"
    )
    print(f"load it with: AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r}), AutoTokenizer.from_pretrained(...)")
    return 0
