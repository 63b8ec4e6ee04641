"""This process's hivemind DHT node and what voloco adds to it.

``node`` starts the node (addresses, identity, the join), ``validators`` are the record validators
every node runs, ``channels`` carry a node's DHT calls to a peer over one stream kept open,
``lean_store`` and ``replica_reads`` store and read a key at a fraction of the bytes,
``group_keys`` declares and polls hivemind's matchmaking keys that way, and ``rejoin`` finds the
swarm again when the DHT has lost it.
"""
