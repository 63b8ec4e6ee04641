"""What two voloco processes must agree on. Pure: data in, data or bytes out, no I/O.

Nothing in this package opens a socket, a file or a process, so every part of it can be
unit-tested and fuzzed on its own.

The run's contract: ``spec`` (the run spec, its sections and presets), ``layout`` (the model's
tensors), ``partial`` (parameter slices), ``capacity`` (memory estimates). A round: ``payload`` and
``codecs`` (what a peer sends), ``signed`` and ``reconcile`` (a group's signed all-gather and
agreement), ``group_sets`` (several groups, one θ), ``round_policy``, ``peer_states`` and ``timing``
(a round's decisions, states and waits). ``dht`` (the records) and ``chain`` (pipeline chains) are
sub-packages; ``errors`` and ``bounded_unpack`` serve all of them.
"""

PROTOCOL_VERSION = 1
