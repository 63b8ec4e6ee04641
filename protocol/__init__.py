"""What two voloco processes must agree on. Pure: data in, data or bytes out, no I/O.

Nothing in this package opens a socket, a file or a process, so every part of it can be
unit-tested and fuzzed on its own.
"""

PROTOCOL_VERSION = 1
