"""The outer step: from a round's payloads to the next θ, the same bits on every member.

``engine`` turns the model's drift into a payload and a set of payloads into θ of the next round;
``strategies`` are SparseLoCo, DCT momentum and DiLoCo with their buffers; ``robust`` bounds what one
payload can do (norm clipping, the chosen average).
"""
