"""The round: when a peer trains, meets its round's peers, and ends the round on the swarm's θ.

``loop`` runs H inner steps and the round's exchange (overlapped with the next round's steps),
``membership`` reads the run's progress records (who is in which round, who is ready) and waits
at the round barrier, whose finding is ``barrier``'s, ``early_close``
closes a slow peer's round once most of its peers are ready, ``merge`` joins the sets that several
groups of one round agreed into one θ, ``adopt`` takes a set of the round for a peer that missed its
gather, and ``state_sync`` brings a peer that fell behind onto the swarm's state (downloaded by
peer/exchange/state_download.py). ``report`` is what a round leaves: its record, its log line, the
status file. ``simulate`` runs many replicas of the round in one process, for
benchmarks and tests.
"""
