"""A BPE run's tokenizer.json, served and fetched over hivemind's P2P streams.

A tokenizer (up to 8 MiB) does not fit the DHT's records (64 KiB bodies, protocol/dht/records.py), so
it travels over a libp2p stream instead, and the DHT only carries what binds it: the sha256 in the
run spec that the run key signed. The coordinator serves the file; so does every peer once it
holds a verified copy, so a newcomer gets it while the coordinator is down.

The wire: the asker opens the stream ``voloco.<run_id>.tokenizer`` and writes the 64 hex digits of
the sha256 it wants; the server answers an 8-byte big-endian length (0: it does not hold that
file) and the bytes. The asker trusts nothing of it: the length is capped (``MAX_TOKENIZER_BYTES``),
every read has a deadline, and the bytes count only if they hash to the spec's sha256.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from contextlib import closing
from functools import partial
from typing import Dict, List, Optional, Sequence, Set

from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID

from protocol.spec import RunSpec
from protocol.spec.sections import MAX_TOKENIZER_BYTES
from swarm.call_limits import CallLimiter
from swarm.loop_thread import run_in_fresh_loop

logger = logging.getLogger("voloco.swarm")

PART = 1 << 16  # bytes per write or read
ASK_BYTES = 64  # a sha256 in hex
MIN_RATE = 256 << 10  # bytes/s: the slowest transfer allowed, on top of the per-read timeout
MAX_SOURCES = 8  # peers asked, at most, before giving up
PASSES = 3  # a source whose stream failed is asked again, at most this many times in all
RETRY_PAUSE_S = 0.5


class TokenizerFetchError(Exception):
    """No peer served bytes that hash to the spec's tokenizer sha256."""


def handle_name(run_id: str) -> str:
    return f"voloco.{run_id}.tokenizer"


# ---- the serving side (in the DHT's process) ---------------------------------------------------------
SERVING_PER_PEER = 2  # answers one asker may have running at once ...
SERVING_AT_ONCE = 32  # ... and all askers together: an asker refused asks another peer
_serving = CallLimiter(SERVING_PER_PEER, total=SERVING_AT_ONCE)


async def _answer(raw: bytes, digest: str, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send ``raw`` to an asker that names its sha256: within a deadline for the whole answer (the
    slowest rate a download may take), to a few askers at once (tests/swarm/test_tokenizer_share.py)."""
    with _serving.admit(info.peer_id) as admitted:
        try:
            if admitted:
                await asyncio.wait_for(_send(raw, digest, reader, writer), 10.0 + 30.0 + len(raw) / MIN_RATE)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the asker went away or stalled: its loss
        finally:
            writer.close()


async def _send(raw: bytes, digest: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    ask = await asyncio.wait_for(reader.readexactly(ASK_BYTES), 10.0)
    body = raw if ask == digest.encode("ascii") else b""
    writer.write(len(body).to_bytes(8, "big"))
    for i in range(0, len(body), PART):
        writer.write(body[i:i + PART])
        await asyncio.wait_for(writer.drain(), 30.0)
    await writer.drain()


async def _register(handle: str, raw: bytes, digest: str, _dht, node) -> None:
    await node.p2p.add_binary_stream_handler(handle, partial(_answer, raw, digest))


_served: set = set()


def serve_tokenizer(dht: DHT, run_id: str, raw: bytes) -> None:
    """Answer tokenizer requests of ``run_id`` with ``raw`` from now on (once per DHT node and run)."""
    if len(raw) > MAX_TOKENIZER_BYTES:
        raise ValueError(f"a tokenizer of {len(raw)} bytes is over the limit of {MAX_TOKENIZER_BYTES}")
    key = (id(dht), run_id)
    if key in _served:
        return
    dht.run_coroutine(partial(_register, handle_name(run_id), bytes(raw), hashlib.sha256(raw).hexdigest()))
    _served.add(key)


# ---- the asking side ---------------------------------------------------------------------------------
async def _ask(maddr, peer: str, handle: str, digest: str, timeout: float) -> bytes:
    p2p = await P2P.replicate(maddr)
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(PeerID.from_base58(peer), handle), timeout)
        with closing(writer):
            writer.write(digest.encode("ascii"))
            await asyncio.wait_for(writer.drain(), timeout)
            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout), "big")
            if size == 0:
                raise TokenizerFetchError("it does not hold this tokenizer")
            if size > MAX_TOKENIZER_BYTES:
                raise TokenizerFetchError(f"it announced {size} bytes, more than the limit of {MAX_TOKENIZER_BYTES}")
            data = bytearray()
            while len(data) < size:
                chunk = await asyncio.wait_for(reader.read(min(PART, size - len(data))), timeout)
                if not chunk:
                    raise TokenizerFetchError(f"it closed the stream after {len(data)} of {size} bytes")
                data += chunk
            return bytes(data)
    finally:
        await p2p.shutdown()


def tokenizer_sources(dht: DHT, spec: RunSpec) -> List[str]:
    """Whom to ask: the run key's node (the coordinator) first, then live peers of the run."""
    from swarm.access.identity import peer_id_of, trust_of
    from swarm.records import read_progress

    trust = trust_of(dht)
    me = trust.identity.peer_id
    out: List[str] = []
    owner = trust.owners.get(spec.run_id)
    if owner is not None:
        out.append(peer_id_of(owner))
    try:
        digest = spec.digest()  # once, not per record
        out += sorted(v.peer_id for v in read_progress(dht, spec.run_id) if v.progress.spec == digest)
    except Exception as e:  # a DHT hiccup: the coordinator alone may still answer
        logger.debug(f"could not list peers to fetch the tokenizer from: {e!r}")
    seen, unique = {me}, []
    for p in out:
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return unique[:MAX_SOURCES]


def fetch_tokenizer(dht: DHT, spec: RunSpec, sources: Optional[Sequence[str]] = None, timeout: float = 20.0) -> bytes:
    """The tokenizer.json bytes whose sha256 the spec names, from the first source that serves them.
    A source that refuses (not holding it, over the limit, the wrong bytes) is not asked again; one
    whose stream failed (a fresh connection reset, a timeout) is asked again in a later pass, up to
    ``PASSES`` passes while ``timeout`` lasts (tests/training/test_tokenizers.py)."""
    digest = spec.data.tokenizer_sha256
    sources = list(sources) if sources is not None else tokenizer_sources(dht, spec)
    maddr = dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)
    failures: Dict[str, str] = {}  # source -> why it did not serve, the latest try's
    refused: Set[str] = set()
    end = time.monotonic() + timeout
    for attempt in range(PASSES):
        if attempt and (time.monotonic() >= end or len(refused) == len(sources)):
            break
        if attempt:
            time.sleep(RETRY_PAUSE_S)
        for peer in sources:
            if peer in refused:
                continue
            try:
                deadline = timeout + MAX_TOKENIZER_BYTES / MIN_RATE
                raw = run_in_fresh_loop(
                    asyncio.wait_for(_ask(maddr, peer, handle_name(spec.run_id), digest, timeout), deadline), "tokenizer-fetch")
            except TokenizerFetchError as e:  # its answer: it will not serve this file
                refused.add(peer)
                failures[peer] = f"{peer[-8:]}: {e}"[:160]
                continue
            except Exception as e:  # the stream failed: asked again in the next pass
                failures[peer] = f"{peer[-8:]}: {str(e) or type(e).__name__}"[:160]
                continue
            got = hashlib.sha256(raw).hexdigest()
            if got != digest:
                refused.add(peer)
                failures[peer] = f"{peer[-8:]}: sent a file with sha256 {got[:16]}, not the spec's {digest[:16]}: refused"
                logger.warning(f"refusing the tokenizer {peer} sent: its sha256 {got} is not the run spec's {digest}")
                continue
            return raw
    raise TokenizerFetchError(
        f"no peer served the run's tokenizer (sha256 {digest[:16]}) ({'; '.join(failures.values()) or 'nobody to ask'}): is the "
        f"coordinator up? Or copy its tokenizer.json into the checkpoint directory"
    )
