"""Who is on the other end of a stage link: challenge–response over libp2p identity keys.

The fields of a ``hello`` (run digest, chain id, stage, round) are public: anyone who reads the
DHT can send them. What a stranger cannot do is sign with the key behind the peer id that the
chain assignment names for the neighbouring stage. So, on top of the hello (protocol/chain/frames.py):

1. the dialer's hello carries a fresh nonce;
2. the listener answers ``challenge``: its own fresh nonce, its public key and its signature over
   the transcript with side "listener";
3. the dialer checks that the key hashes to the peer id it expects at that stage and that the
   signature verifies, then answers ``auth``: its key and signature over the transcript with side
   "dialer"; the listener checks them the same way and answers ``hello_ok``.

The transcript binds the hello's fields and nonce, both peer ids and the listener's nonce, and
the side that signs: each signature is fresh (the other side's nonce), good for this link only,
and cannot be reflected to the other side or replayed on another connection. Pure.
"""

from __future__ import annotations

from typing import Tuple

import msgpack

from protocol.errors import FrameError
from protocol.chain.frames import Hello
from protocol.wire.signed import PublicKey, SignatureError, Signer

__all__ = ["LinkAuthError", "transcript", "prove", "check"]

SIDES = ("dialer", "listener")


class LinkAuthError(FrameError):
    """The other end of a stage link did not prove it is the peer the chain assignment names."""


def transcript(side: str, hello: Hello, dialer: bytes, listener: bytes, listener_nonce: bytes) -> bytes:
    """What ``side`` of a stage link signs."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    fields = [hello.version, hello.run, hello.chain, hello.stage, hello.round, hello.role, hello.nonce]
    return msgpack.packb(["voloco/stage-link/1", side, fields, dialer, listener, listener_nonce], use_bin_type=True)


def prove(signer: Signer, side: str, hello: Hello, dialer: bytes, listener: bytes, listener_nonce: bytes) -> Tuple[bytes, bytes]:
    """(public key, signature) of ``signer`` as ``side`` of this link."""
    return signer.public_key, signer.sign(transcript(side, hello, dialer, listener, listener_nonce))


def check(expected: bytes, key: bytes, sig: bytes, side: str, hello: Hello, dialer: bytes, listener: bytes,
          listener_nonce: bytes) -> None:
    """LinkAuthError unless ``key`` is the key of peer id ``expected`` and ``sig`` its signature as ``side``."""
    try:
        public = PublicKey(expected, key)
    except SignatureError as e:
        raise LinkAuthError(f"the {side} is not the peer the chain names: {e}") from None
    if not public.verify(transcript(side, hello, dialer, listener, listener_nonce), sig):
        raise LinkAuthError(f"the {side}'s signature does not verify")
