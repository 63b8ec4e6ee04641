"""Pseudo-gradient codecs: dense, SparseLoCo (chunked top-k, 2-bit), DCT."""
