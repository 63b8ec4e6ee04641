"""The host: a peer process from its command line to its clean stop.

``cli`` parses ``python -m peer`` / ``voloco peer``, ``runtime`` builds the peer and passes its
collaborators to the round, ``lifecycle`` reports the start-up phases and stops cleanly, and
``metrics`` and ``utilization`` tell people what the peer is doing (Prometheus, how busy its compute
is).
"""
