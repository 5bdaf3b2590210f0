"""meshnode: pool the computers on a LAN into one LLM server.

The node package never imports Textual or anything under ``ui/``; the TUI sees the
node only through :mod:`meshnode.state` (snapshots, events) and :class:`meshnode.state.NodeAPI`.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 5   # = meshnode.wire.messages.PROTOCOL_VERSION (prompt scoring)
