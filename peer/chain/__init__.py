"""Chain stages: peers too small for the model train it together as one pipelined replica.

``stage`` is a low-resource peer's life as a chain candidate and stage, ``gpipe`` the pipelined inner
step over the stage links, ``links`` the TCP links that carry subspace-projected activations between
neighbouring stages, ``listener`` how a stage accepts its upstream neighbour's link, ``handshake``
how a link is authenticated, ``errors`` how a broken link ends a round for the whole chain.
"""
