"""Checkpoints: what a peer writes so that it can stop at any instant and resume.

``files`` writes and checks the safetensors files (atomically, checksummed, the previous one kept),
``contents`` says what a checkpoint holds and how a restarted peer resumes from it, ``schedule``
says when one is written (after which rounds, and on stop), and ``writer`` writes the end-of-round
checkpoint in the background at a bounded cost.
"""
