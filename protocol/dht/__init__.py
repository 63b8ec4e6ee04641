"""What voloco keeps in the DHT, pure: the key layout and who owns each record (``keys``), the
records' schemas and envelopes (``records``), the coordinator's loss history (``history``), and the
frames of a DHT channel, one long-lived stream per peer (``channel_frames``).
"""
