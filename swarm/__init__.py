"""What peers and the coordinator share beyond the pure protocol: the DHT node, the DHT records, the console.

- ``swarm.console``: ``UsageError`` (bad input: one line, exit code 2), logging set-up, the
  ``--log-level`` flag, a command's error handling, ``human_bytes``;
- ``swarm.dht``: the hivemind DHT node (``swarm.dht.node``: address parsing and start-up) and what
  voloco adds to it (validators, channels, lean stores, replica reads, rejoin);
- ``swarm.records``: reading and writing the run's DHT records (run spec, progress, chain
  candidates, chain assignments) whose layout and schemas ``protocol/`` defines;
- ``swarm.access``: this node's identity and getting into a run (join flags, admission, the join
  probe, reachability);
- ``swarm.wire``: the kernel's byte counters of a process tree's TCP sockets;
- ``swarm.settings`` (flags from a settings file and the environment), ``swarm.jsonout`` (strict
  JSON), ``swarm.loop_thread``, ``swarm.tokenizer_share`` (a BPE run's tokenizer over P2P).

It imports neither ``peer`` nor ``coordinator``: both build on it.
"""
