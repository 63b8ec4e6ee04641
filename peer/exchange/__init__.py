"""The exchange: a round's signed payloads moved between the members of a group.

``gatherer`` keeps hivemind's matchmaking and replaces its all-reduce with a signed, agreed
all-gather, handing back ``results``; ``matchmaking`` reads its data and cancels a step without a
race, ``late_join`` lets a follower that missed its group's message take part anyway, ``set_server``
serves agreed sets to other groups of the round, ``state_serving`` serves a peer's state and
``state_download`` fetches one, ``bounds``
limits what another peer can make us read or wait for, and ``identity`` is the key payloads are
signed with. Decisions are protocol/'s; this package moves bytes.
"""
