"""The payload's encode while the next round's inner steps run beside it, as an overlapped peer does.

    python bench/encode_overlap.py --device cuda --shape 125m        # on a GPU box, about a minute
    python bench/encode_overlap.py --device cpu --shape tiny --repeats 1 --steps 2 --threads 1   # a smoke test

With overlap (peer/round/loop.py) a GPU peer encodes its payload in the exchange's thread while the
inner loop's thread trains the next round on the same GPU. Both use PyTorch's default stream, so
each host copy of the encode (its range check, the quantizer's scale, the packed indices and codes:
several a tensor) waits for the training kernels queued before it. This bench measures what that
costs, to decide whether the exchange's device work belongs on a CUDA stream of its own:

- **alone**: ``pseudo_gradient`` and ``strategy.encode`` of one round's Δ, nothing else running;
- **beside training**: the same while another thread takes inner steps without pause (default stream);
- **beside training, own stream** (CUDA only): the encode under ``torch.cuda.stream`` of a stream of
  its own, which waits for the snapshot first and is synchronized at its end.

Each mode's encode is the median of ``--repeats``; the inner step's median is timed in the training
thread over the same windows (``alone``: before any encode). The payloads of the three modes are
compared byte for byte from the same buffers (a stream changes when, not what).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import table  # noqa: E402
from peer.outer.strategies import make_strategy, pseudo_gradient  # noqa: E402
from peer.training.data import TrainStream, load_corpus  # noqa: E402
from peer.training.inner import InnerTrainer  # noqa: E402
from peer.training.model import build_model  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from protocol.spec.presets import PRESETS  # noqa: E402

SHAPES = {**{name: (fields, 8) for name, fields in PRESETS.items()},
          "tiny": ({"d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 176, "seq_len": 64}, 4)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer(threading.Thread):
    """Inner steps without pause until stopped, each step's seconds recorded."""

    def __init__(self, trainer: InnerTrainer, batches, device: torch.device):
        super().__init__(daemon=True, name="inner-steps")
        self.trainer, self.batches, self.device = trainer, batches, device
        self.steps, self.stop = [], threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            t = time.perf_counter()
            self.trainer.step(*self.batches[i % len(self.batches)])  # loss.item() syncs, as a peer's step does
            self.steps.append(time.perf_counter() - t)
            i += 1


def encode_once(strategy, theta_start, sent, device: torch.device, own_stream: bool):
    """(seconds, payload bytes) of one round's encode from ``sent``, as the exchange thread does it."""
    stream = torch.cuda.Stream(device) if own_stream else None
    t = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
            stack.enter_context(torch.cuda.stream(stream))
        delta = pseudo_gradient(theta_start, sent, strategy.layout)
        payload, _ = strategy.encode(delta, 1)
    if stream is not None:
        stream.synchronize()
    return time.perf_counter() - t, payload


def run(args) -> list:
    device = torch.device(args.device)
    fields, batch = SHAPES[args.shape]
    spec = RunSpec().replace(model=fields, data={"batch_size": batch}, outer={"strategy": args.strategy},
                             inner={"precision": args.precision})
    corpus = load_corpus("stdlib")
    stream = TrainStream(corpus, spec.model.seq_len, batch, seed=0, shard="bench")
    batches = [next(stream) for _ in range(8)]
    model = build_model(spec.model, spec.seed)
    theta_start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = InnerTrainer(model, spec.inner, device)
    for x, y in batches[:3]:  # warm: the allocator, the kernels, AdamW's state
        trainer.step(x, y)
    sent = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    _sync(device)
    state = make_strategy(spec).local_state()  # the same buffers for every mode: the payloads compare

    def strategy():
        s = make_strategy(spec)
        s.load_local_state(state)
        return s

    alone_steps = []
    for i in range(args.steps):  # the inner step alone, before any encode
        t = time.perf_counter()
        trainer.step(*batches[i % len(batches)])
        alone_steps.append(time.perf_counter() - t)
    alone_step = statistics.median(alone_steps)
    modes = [("alone", False, False), ("beside training", True, False)]
    if device.type == "cuda":
        modes.append(("beside training, own stream", True, True))
    rows, payloads, alone = [], {}, None
    for name, train, own in modes:
        worker = Trainer(trainer, batches, device) if train else None
        if worker is not None:
            worker.start()
            while len(worker.steps) < 2:  # its kernels queue before the first encode
                time.sleep(0.01)
        times = []
        for _ in range(args.repeats):
            seconds, payloads[name] = encode_once(strategy(), theta_start, sent, device, own)
            times.append(seconds)
        if worker is not None:
            worker.stop.set()
            worker.join()
            step = statistics.median(worker.steps[2:] or worker.steps)
        else:
            step = alone_step
        encode = statistics.median(times)
        if alone is None:
            alone = (encode, step)
        rows.append({"mode": name, "encode_s": encode, "encode_vs_alone": encode / alone[0], "step_ms": step * 1e3,
                     "step_vs_alone": step / alone[1], "same_payload": payloads[name] == payloads["alone"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device (default: cuda where present)")
    ap.add_argument("--shape", default="125m", choices=sorted(SHAPES), help="model shape: a preset, or tiny for a smoke test")
    ap.add_argument("--strategy", default="sparseloco", choices=["sparseloco", "dct", "diloco"], help="the outer strategy whose payload is encoded")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help="the inner steps' precision (inner.precision)")
    ap.add_argument("--repeats", type=int, default=5, help="encodes timed in each mode (their median is shown)")
    ap.add_argument("--steps", type=int, default=5, help="inner steps timed alone, for the step column's baseline")
    ap.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    print(f"{args.shape} {args.strategy} on {args.device} ({torch.cuda.get_device_name(0) if args.device.startswith('cuda') else 'CPU'}), "
          f"torch {torch.__version__}")
    print(table(["mode", "encode s", "vs alone", "inner step ms", "vs alone", "same payload"],
                [[r["mode"], f"{r['encode_s']:.3f}", f"{r['encode_vs_alone']:.2f}x", f"{r['step_ms']:.1f}",
                  f"{r['step_vs_alone']:.2f}x", "yes" if r["same_payload"] else "NO"] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
