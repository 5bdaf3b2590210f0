"""Which member coordinates which model: the directory behind the mesh-wide endpoint.

Pure bookkeeping, fed by the fabric's messages and peer changes. Each coordinator sends
its whole list (``ModelsServed``, at most ``MAX_SERVED_MODELS`` entries, checked by the
wire); a new list replaces the last one, and a peer's entries go when its link goes. So a
member can make this node hold at most ``MAX_SERVED_MODELS`` entries, however often it
speaks.

When several members serve one model id, requests go to the one with the lowest node id:
a rule every node applies the same way, so one model's requests from the whole mesh meet
on one coordinator (its batches stay dense) instead of depending on where they came from.
"""

from __future__ import annotations

from meshnode.wire import ServedModel
from meshnode.wire.messages import MAX_SERVED_MODELS


class ServedModels:
    """Member node id -> the models it serves now."""

    def __init__(self) -> None:
        self._by_peer: dict[str, tuple[ServedModel, ...]] = {}

    def update(self, node_id: str, models: tuple[ServedModel, ...]) -> bool:
        """Replace ``node_id``'s list; True when it changed."""
        models = tuple(models[:MAX_SERVED_MODELS])
        if self._by_peer.get(node_id, ()) == models:
            return False
        if models:
            self._by_peer[node_id] = models
        else:
            self._by_peer.pop(node_id, None)
        return True

    def drop(self, node_id: str) -> bool:
        """Forget ``node_id`` (its link went); True when it served anything."""
        return self._by_peer.pop(node_id, None) is not None

    def route(self, model: str) -> tuple[str, ServedModel] | None:
        """The member to send a request for ``model`` to (ids compare case-insensitively,
        as the model server's own do), with its entry; None when no member serves it."""
        want = model.lower()
        for node_id in sorted(self._by_peer):
            for m in self._by_peer[node_id]:
                if m.name.lower() == want:
                    return node_id, m
        return None

    def entries(self) -> list[tuple[str, ServedModel]]:
        """Every (member, model), members in node id order."""
        return [(node_id, m) for node_id in sorted(self._by_peer) for m in self._by_peer[node_id]]

    def __bool__(self) -> bool:
        return bool(self._by_peer)
