"""hivemind's own collaborative optimizer on voloco's model and data: the baseline of bench/wan.py.

    python -m bench.wan_hivemind bootstrap --host IP --address-file FILE
    python -m bench.wan_hivemind worker --join MADDR --host IP --spec run.toml --status-file S --busy-file B
        --go-file G --target-batch-size T --lr LR --epochs E --matchmaking-time S --averaging-timeout S
        [--slowdown X]

``bootstrap``: a plain hivemind DHT node, the first one, on the coordinator's host; it writes its
addresses to FILE and waits for SIGINT/SIGTERM. ``worker``: joins it and trains the run spec's
model (peer/training/model.py, the same initialization from ``spec.seed``) on the same data stream as a
voloco peer (peer/training/data.py's ``TrainStream``, sharded by its peer id), with ``hivemind.Optimizer``
configured as hivemind's documentation recommends (the docstring's "Configuration guide"; the
values are chosen in bench/wan.py, ``hivemind_settings``):

- synchronous data-parallel training to ``target_batch_size`` samples per global step: hivemind's
  default ("exactly equivalent to synchronous training with target_batch_size"). The guide's
  optional delayed parameter updates (``delay_optimizer_step``, ``delay_grad_averaging``: "train
  faster, but with 1 round of staleness") diverged here at the learning rate tuned for the batch
  (validation loss 3.4 to 30 within 15 global steps at 10 Mbit/s, bench/RESULTS.md), so they stay off;
  the parameters' state averaging runs in the background (``delay_state_averaging``, the default);
- ``offload_optimizer=True`` ("generally a good practice");
- fp16 on the wire for the gradients' all-reduce and the parameters' state averaging
  (``Float16Compression``, the guide's two settings). A state download (a peer that fell behind
  loads parameters and AdamW statistics from another) stays uncompressed, hivemind's default: in fp16
  most of AdamW's ``exp_avg_sq`` underflows to 0 and the next step divides by ``eps`` alone. In one
  process (the full run's model, 576 samples a step, lr 0.012), an fp16 round trip of the AdamW
  state after 4 global steps zeroed 78.5 % of ``exp_avg_sq`` and the next step took the validation
  loss from about 3.5 to 85.5. On the hosts with fp16 there, a peer that had fallen behind and
  downloaded state blew up first and state averaging spread it (final validation loss 607);
- ``matchmaking_time`` and ``averaging_timeout`` as given.

The inner optimizer is the voloco peer's: AdamW with the spec's betas, weight decay (matrices only)
and gradient clipping (applied to the averaged gradient), its learning rate and schedule (warm-up,
cosine to ``min_lr_ratio``) counted in global steps, as hivemind's scheduler requires.

It starts on the bench's signal (``--go-file`` appears: every worker is ready, like voloco's
``--wait-peers``), evaluates the validation loss exactly as a voloco peer does (peer/training/inner.py's
``evaluate`` on ``val_batches``, in nats per byte) after every global step, and writes its status
(tokens, history of (time, epoch, val loss)) as strict JSON; compute time goes to ``--busy-file``
(bench/wan_host.py's ``BusyLog``: forward and backward of every local batch, ``--slowdown`` times
slower as bench/wan_host.py makes a voloco peer).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from swarm.jsonout import write_atomic


def _stopper() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def bootstrap(args) -> int:
    import hivemind

    stop = _stopper()
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    addrs = [str(a) for a in dht.get_visible_maddrs() if f"/ip4/{args.host}/" in str(a)]
    write_atomic(Path(args.address_file), addrs)
    while not stop.wait(0.5):
        pass
    dht.shutdown()
    return 0


class ClippedAdamW(torch.optim.AdamW):
    """AdamW whose step first clips the gradient norm (hivemind hands it the averaged gradient)."""

    def __init__(self, params, clip: float, **kw):
        super().__init__(params, **kw)
        self.clip = clip

    @torch.no_grad()
    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], self.clip)
        return super().step(closure)


def lr_factor(epoch: int, epochs: int, warmup: int, floor: float) -> float:
    """The voloco inner schedule's shape over global steps: linear warm-up, cosine to ``floor``."""
    if epoch < warmup:
        return (epoch + 1) / warmup
    progress = min(1.0, (epoch - warmup) / max(1, epochs - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def worker(args) -> int:
    import hivemind
    from hivemind.compression import Float16Compression

    from bench.wan_host import BusyLog
    from peer.training.data import TrainStream, load_corpus, val_batches
    from peer.training.inner import evaluate
    from peer.training.model import build_model
    from protocol.spec import RunSpec

    stop = _stopper()
    torch.set_num_threads(args.threads)
    spec = RunSpec.from_toml(Path(args.spec).read_text())
    inner, B, seq = spec.inner, spec.data.batch_size, spec.model.seq_len
    dht = hivemind.DHT(initial_peers=[args.join], host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    me = dht.peer_id.to_base58()
    corpus = load_corpus(spec.data.corpus, spec.data.val_fraction)
    model = build_model(spec.model, spec.seed)
    stream = TrainStream(corpus, seq, B, spec.seed, shard=me)
    val = val_batches(corpus, seq, B, spec.data.val_batches)
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": inner.weight_decay},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    warmup = max(1, round(args.epochs * args.warmup_fraction))
    fp16 = Float16Compression()
    opt = hivemind.Optimizer(
        dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size, batch_size_per_step=B,
        params=groups,
        optimizer=lambda params: ClippedAdamW(params, clip=inner.grad_clip, lr=args.lr, betas=(inner.beta1, inner.beta2), eps=1e-8),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda e: lr_factor(e, args.epochs, warmup, inner.min_lr_ratio)),
        matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        offload_optimizer=True, delay_optimizer_step=False, delay_grad_averaging=False,
        grad_compression=fp16, state_averaging_compression=fp16,  # the guide's; a state download: uncompressed
        verbose=True,
    )  # fmt: skip
    status = {"peer_id": me, "state": "ready", "tokens": 0, "epoch": 0, "bytes_sent": None,
              "target_batch_size": args.target_batch_size, "lr": args.lr, "history": []}
    status_file = Path(args.status_file)
    write_atomic(status_file, status)
    while not Path(args.go_file).exists() and not stop.wait(0.05):
        pass
    status["initial_val_loss"] = status["val_loss"] = corpus.per_byte(evaluate(model, val))
    status["state"] = "training"
    write_atomic(status_file, status)
    busy, epoch = BusyLog(Path(args.busy_file)), opt.local_epoch
    while not stop.is_set() and opt.local_epoch < args.epochs:
        x, y = stream.next_batch()
        t = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        if args.slowdown > 1:
            time.sleep((args.slowdown - 1) * (time.perf_counter() - t))
        busy.add(time.perf_counter() - t)
        opt.step()
        opt.zero_grad()
        status["tokens"] += x.numel()
        if opt.local_epoch != epoch:  # a global step: evaluate as a voloco peer does after its round
            epoch = opt.local_epoch
            status["val_loss"] = corpus.per_byte(evaluate(model, val))
            status["epoch"] = epoch
            status["history"].append({"epoch": epoch, "time": time.time(), "val_loss": status["val_loss"],
                                      "tokens": status["tokens"]})
            write_atomic(status_file, status)
    status["state"] = "stopped"
    write_atomic(status_file, status)
    opt.shutdown()
    dht.shutdown()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("bootstrap", help="the first DHT node")
    b.add_argument("--host", required=True, help="this host's IPv4 address")
    b.add_argument("--address-file", required=True, help="write the node's multiaddrs here (JSON list)")
    w = sub.add_parser("worker", help="a hivemind.Optimizer training worker")
    w.add_argument("--join", required=True, help="the bootstrap node's multiaddr")
    w.add_argument("--host", required=True, help="this host's IPv4 address")
    w.add_argument("--spec", required=True, help="the run spec (TOML): model, data, seed, inner optimizer")
    w.add_argument("--run-id", default="wan-hivemind", help="hivemind's run_id, the prefix of its DHT keys (default wan-hivemind)")
    w.add_argument("--status-file", required=True, help="rewrite this JSON status (tokens, val-loss history) after every global step")
    w.add_argument("--busy-file", required=True, help="the compute log (bench/wan_host.py's BusyLog)")
    w.add_argument("--go-file", required=True, help="start training once this file exists")
    w.add_argument("--target-batch-size", type=int, required=True, help="samples per global step")
    w.add_argument("--lr", type=float, required=True, help="peak learning rate of AdamW")
    w.add_argument("--epochs", type=int, required=True, help="stop after this many global steps")
    w.add_argument("--warmup-fraction", type=float, default=0.1, help="of the epochs, linear warm-up (default 0.1)")
    w.add_argument("--matchmaking-time", type=float, required=True, help="hivemind.Optimizer's matchmaking_time (s)")
    w.add_argument("--averaging-timeout", type=float, required=True, help="hivemind.Optimizer's averaging_timeout (s)")
    w.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a voloco peer here)")
    w.add_argument("--slowdown", type=float, default=1.0, help="this many times slower forward and backward (default 1)")
    args = ap.parse_args(argv)
    return bootstrap(args) if args.mode == "bootstrap" else worker(args)


if __name__ == "__main__":
    sys.exit(main())
