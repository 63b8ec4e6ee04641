"""Pipeline chains, pure: what a chain is and how peers form one, and what crosses a stage link.

``stages`` defines candidates, stages and chains (which blocks each stage owns), ``formation`` how
candidates are grouped into chains, ``records`` what peers and the coordinator publish about them;
``frames`` is the wire format of a stage link, ``endpoints`` where a neighbour can be dialled,
``link_auth`` who is on the other end; ``subspace``, ``activations`` and ``subspace_constraint`` are
the subspace codec that compresses what crosses a stage boundary.
"""
