"""The benchmarks' user-facing error.

A benchmark run fails for reasons that are the user's or the machine's (a node that does
not start, a model the nodes refuse, a prompt longer than the model's context, no root for
namespaces): :class:`BenchError` carries the reason, and the CLI prints it as one line.
"""

from meshnode.errors import MeshnodeError

__all__ = ["BenchError"]


class BenchError(MeshnodeError):
    """A benchmark run could not go on; the message says why (and holds the node's log
    tail where a node is at fault)."""
