"""The layer that knows both the peer and the coordinator: the ``voloco`` command and its demo.

- ``voloco.cli``: the ``voloco`` console entry (``voloco coordinator|peer|demo``), composed of
  ``coordinator.cli`` and ``peer.host.cli`` (each also runs alone: ``python -m coordinator``,
  ``python -m peer``) and ``voloco.demo``;
- ``voloco.demo``: ``voloco demo``, a coordinator and peers as processes on this machine.
"""
