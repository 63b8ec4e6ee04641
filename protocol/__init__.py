"""What two voloco processes must agree on. Pure: data in, data or bytes out, no I/O.

Nothing in this package opens a socket, a file or a process, so every part of it can be
unit-tested and fuzzed on its own.

The run's contract: ``spec`` (the run spec, its sections and presets) and ``model`` (the model's
tensors, parameter slices, memory estimates). What a peer sends: ``wire`` (the payload, its
signature, bounded decoding) and ``codecs`` (how a pseudo-gradient is compressed). ``round`` (a
round's waits, states, decisions and agreement), ``dht`` (the records) and ``chain`` (pipeline
chains); ``errors`` serves all of them.
"""

# 2: a payload's header says how many inner steps its update covers; 3: a set that holds no payload has
# one name a round (protocol/round/group_sets.py ``empty_set_name``); 4: a round's eligibility table counts
# the standing the round gave its candidates (protocol/round/eligibility.py ``update``: with
# outer.max_contributions, two builds would hold two tables, and so two state digests, from one round)
PROTOCOL_VERSION = 4
