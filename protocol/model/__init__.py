"""The model as the run's contract sees it, pure (no torch): its tensors in one table
(``layout``), the parameter slices partial peers own (``partial``), and what training a replica or
a stage of it costs in memory (``capacity``).
"""
