"""The DHT's decoder refuses bytes nested past ``MAX_DEPTH`` before it decodes them.

hivemind's ``DHTProtocol`` decodes a whole dictionary value a peer stores (``rpc_store``) or a find
returns (``call_find``) before any record validator sees it, with a decoder that recurses through C
for each tuple: about 200 tuples nested in 2 KB overflow the stack, and the process (the DHT node of
a peer or of the coordinator) dies of a segmentation fault. Our validators measure nesting
(swarm/dht/validators.py) only after that decode. ``DepthCheckedSerializer`` measures it first,
level by level and without recursion (protocol/wire/bounded_unpack.py ``packed_nesting``), and
raises ``ValueError``, which hivemind answers as a failed store or an empty find. Nothing honest
nests past ``MAX_DEPTH``. Guarded by tests/swarm/test_dht_depth_guard.py.
"""

from __future__ import annotations

from hivemind.dht.protocol import DHTProtocol
from hivemind.utils import MSGPackSerializer

from protocol.wire.bounded_unpack import MAX_DEPTH, packed_nesting

__all__ = ["DepthCheckedSerializer", "guard_decoder", "install_guard"]


class DepthCheckedSerializer(MSGPackSerializer):
    """hivemind's msgpack serializer, refusing what nests past ``MAX_DEPTH`` before decoding it."""

    @classmethod
    def loads(cls, buf: bytes) -> object:
        if packed_nesting(buf) > MAX_DEPTH:
            raise ValueError(f"a DHT value nests more than {MAX_DEPTH} levels deep")
        return super().loads(buf)


def guard_decoder() -> None:
    """Every DHTProtocol made in this process from now on (and a DHT process forked from it) decodes
    through ``DepthCheckedSerializer``."""
    DHTProtocol.serializer = DepthCheckedSerializer


async def install_guard(_dht, node) -> None:
    """``dht.run_coroutine(install_guard)``: the same in the DHT's own process, whatever started it."""
    guard_decoder()
    node.protocol.serializer = DepthCheckedSerializer
