"""Who this node is, and getting into a run: ``identity`` (the key that is both the libp2p identity and
the signer, and what this node trusts), ``join_flags`` (the flags that name the run and its trust),
``admission`` (a private run's join token, proven without being sent), ``join_probe`` (busy or
refusing? what a joining node asks when the DHT behind ``--join`` does not answer), and
``reachability`` (can other nodes dial this one back?).
"""
