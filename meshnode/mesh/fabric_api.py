"""The fabric as the rest of the mesh sees it: a :class:`typing.Protocol`.

The coordinator, the stage server, the runtimes' senders, stage 0's pipeline and the stage
host need only this much of :class:`meshnode.mesh.fabric.MeshFabric`: who we are, who the
peers are, and three ways to send a message (control, an ordered data stream, the fast
lane). Typing them against this seam instead of the concrete class keeps them testable
with an in-memory fabric and says exactly what they rely on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Protocol

from meshnode.state import PeerInfo
from meshnode.wire import Message

MessageCallback = Callable[[str, Message], Awaitable[None] | None]
PeerChangeCallback = Callable[[str, PeerInfo | None, str], Awaitable[None] | None]


class Fabric(Protocol):
    """Peers and messages of one node (implemented by :class:`~meshnode.mesh.fabric.MeshFabric`)."""

    node_id: str
    name: str

    def peers(self) -> list[PeerInfo]:
        """The authenticated peers now."""
        ...

    def on_peer_change(self, callback: PeerChangeCallback) -> None:
        """Call ``callback(node_id, info or None, reason)`` when a peer comes or goes."""
        ...

    async def send(self, node_id: str, msg: Message) -> None:
        """A control message; raises ``PeerUnavailableError`` without a link to the peer."""
        ...

    async def send_data(self, node_id: str, msg: Message, stream_key: Hashable) -> None:
        """An ordered data message: one QUIC stream per ``stream_key``."""
        ...

    def send_data_now(self, node_id: str, msg: Message, stream_key: Hashable) -> None:
        """:meth:`send_data` without awaiting (the hot path of a decode step)."""
        ...

    def send_lane(self, node_id: str, msg: Message) -> bool:
        """A per-token frame on the fast lane; False: no ready lane, use a stream."""
        ...

    def lane_ready(self, node_id: str) -> bool:
        """Whether per-token frames to ``node_id`` may take the fast lane now."""
        ...

    def lane_missed(self, node_id: str) -> None:
        """A lane frame to ``node_id`` got no answer in time (counts towards switch-off)."""
        ...
