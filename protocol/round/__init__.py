"""A round's rules, pure: who is waited for, what a group agrees on, what enters θ.

``timing`` holds every wait; ``peer_states`` the states a progress record publishes;
``round_policy`` what a peer does next from what it knows; ``no_shows`` who was waited for in
vain and for how long it is not waited for again; ``reconcile`` which signed payloads one group
agrees on when any member may lie; ``fetch_clock`` when its first round stops waiting for a sender
that sent nothing; ``group_sets`` how several groups' sets become one θ;
``choice`` which contributions enter θ when a round takes at most K of a part; ``standing`` how
many rounds a sender has counted in this θ lineage.
"""
