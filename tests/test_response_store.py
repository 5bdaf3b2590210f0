"""The Responses API's kept answers (pure logic): bounded by count and by bytes, least
recently used out; a lookup refreshes; an answer larger than the store is not kept."""

from __future__ import annotations

import json

from meshnode.serve.response_store import ResponseStore


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_oldest_unused_answer_goes_first_when_the_count_is_reached():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    assert store.put("a", _msgs("1"), {"id": "a"}) and store.put("b", _msgs("2"), {"id": "b"})
    assert store.get("a") is not None          # a is now the most recently used
    store.put("c", _msgs("3"), {"id": "c"})
    assert store.get("b") is None and store.get("a").messages == tuple(_msgs("1")) and len(store) == 2


def test_bytes_are_bounded_and_counted_back_on_delete():
    big = "x" * 400
    size = len(json.dumps(_msgs(big))) + len(json.dumps({"id": "a"}))
    store = ResponseStore(max_entries=100, max_bytes=2 * size + 10)
    for rid in "abc":
        assert store.put(rid, _msgs(big), {"id": "a"})
    assert len(store) == 2 and store.bytes == 2 * size and store.get("a") is None
    assert store.delete("b") and not store.delete("b") and store.bytes == size
    # one answer larger than the whole store is not kept, and evicts nothing
    assert not store.put("huge", _msgs("y" * (3 * size)), {}) and len(store) == 1
    # the same id again replaces its entry
    assert store.put("c", _msgs("short"), {"id": "c"}) and len(store) == 1 and store.bytes < size
