"""meshnode: pool the computers on a LAN into one LLM server.

The node package never imports Textual or anything under ``ui/``; the TUI sees the
node only through :mod:`meshnode.state` (snapshots, events) and :class:`meshnode.state.NodeAPI`.
"""

import os as _os

__version__ = "0.1.0"
# The wire protocol's version (Hello.protocol, mDNS): what each version added is listed
# in meshnode/wire/messages.py, which uses this number.
PROTOCOL_VERSION = 7

# llama.cpp's CPU threads meet at a barrier after every operation, and libgomp (its OpenMP
# runtime on Linux) spins 300,000 times there before a thread sleeps: when another program
# takes one of the cores, the other threads spin through their time slices waiting for the
# one that lost its core. Beside 4 busy processes a 16-thread decode ran over 15 times
# slower; with 3000 spins 2.5 times, and alone as fast as before (docs/engine.md, "Threads
# and a busy machine"). Set here, before anything loads llama.cpp; the user's own setting wins.
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "3000"
