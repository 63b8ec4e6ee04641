"""What peers and the coordinator share beyond the pure protocol: the DHT node, the DHT records, the console.

- ``swarm.console``: ``UsageError`` (bad input: one line, exit code 2), logging set-up, the
  ``--log-level`` flag, a command's error handling, ``human_bytes``;
- ``swarm.dht``: address parsing and the hivemind DHT node's start-up;
- ``swarm.records``: reading and writing the run's DHT records (run spec, progress, chain
  candidates, chain assignments) whose layout and schemas ``protocol/`` defines.

It imports neither ``peer`` nor ``coordinator``: both build on it.
"""
