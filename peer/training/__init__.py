"""Training: what a peer computes between exchanges.

The model (``model``: a readable GPT), the corpus and its batches (``data``, ``data_formats``,
``tokenizer``), the inner optimizer's steps (``inner``, with a terminal ``progress_bar``), the held-out evaluation (``evaluator``), and
the roles a peer can play behind one interface (``roles``: a full replica, a slice owner, a chain
stage), and what the machine can give to them (``resources``: memory, link bandwidth). Nothing here touches the network: a role trains, and hands its parameters to the round.
"""
