"""meshnode: pool the computers on a LAN into one LLM server.

The node package never imports Textual or anything under ``ui/``; the TUI sees the
node only through :mod:`meshnode.state` (snapshots, events) and :class:`meshnode.state.NodeAPI`.
"""

__version__ = "0.1.0"
# The wire protocol's version (Hello.protocol, mDNS): what each version added is listed
# in meshnode/wire/messages.py, which uses this number.
PROTOCOL_VERSION = 7
