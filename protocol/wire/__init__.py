"""What one peer sends another in a round, pure: the payload map (``payload``), its signature and
what it is bound to (``signed``), and the bounded msgpack decoding every peer's bytes go through
(``bounded_unpack``); and what an exchange costs in bytes by formula (``exchange_bytes``).
"""
