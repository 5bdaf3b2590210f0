"""The kept Responses' journal (serve/response_disk.py): a real SQLite file, bounded and
hostile-proof reading back, owner-only, and the store telling it every change.
End to end across a node restart: tests/test_responses_api.py."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat

from meshnode.serve.response_disk import FILE_NAME, ResponseDisk
from meshnode.serve.response_store import ResponseStore


def _msgs(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]


def _resp(i: int) -> dict:
    return {"id": f"resp_{i}", "object": "response", "output_text": f"answer {i}"}


def _reopen(folder, max_entries: int = 100, max_bytes: int = 1 << 20):
    disk = ResponseDisk.open(folder)
    try:
        return disk.load(max_entries, max_bytes)
    finally:
        disk.close()


def test_kept_responses_come_back_in_the_order_they_were_used(tmp_path):
    store = ResponseStore(journal=ResponseDisk.open(tmp_path))
    for i in range(4):
        assert store.put(f"resp_{i}", _msgs(i), _resp(i))
    store.delete("resp_1")
    assert store.get("resp_0") is not None           # used last now
    store.journal.close()
    back = _reopen(tmp_path)
    assert [rid for rid, _, _ in back] == ["resp_2", "resp_3", "resp_0"]
    assert back[-1][1] == _msgs(0) and back[-1][2] == _resp(0)
    # owner-only: conversations are user data
    assert stat.S_IMODE(os.stat(tmp_path / FILE_NAME).st_mode) == 0o600
    # a restarted store takes them back, bounded as always, and does not write them again
    again = ResponseStore(max_entries=2, journal=ResponseDisk.open(tmp_path))
    assert again.restore(again.journal.load(again.max_entries, again.max_bytes)) == 2
    assert again.get("resp_0").response == _resp(0) and again.get("resp_2") is None
    again.journal.close()
    assert [rid for rid, _, _ in _reopen(tmp_path)] == ["resp_3", "resp_0"]   # the rest deleted


def test_what_the_store_evicts_leaves_the_file(tmp_path):
    store = ResponseStore(max_entries=3, journal=ResponseDisk.open(tmp_path))
    for i in range(10):
        store.put(f"resp_{i}", _msgs(i), _resp(i))
    store.put("resp_9", _msgs(99), _resp(99))        # kept again: replaced, not doubled
    store.journal.close()
    back = _reopen(tmp_path)
    assert [rid for rid, _, _ in back] == ["resp_7", "resp_8", "resp_9"]
    assert back[-1][1] == _msgs(99)


def test_reading_back_is_bounded_by_bytes(tmp_path):
    disk = ResponseDisk.open(tmp_path)
    big = [{"role": "user", "content": "x" * 5000}]
    for i in range(5):
        disk.put(f"resp_{i}", json.dumps(big), json.dumps(_resp(i)))
    disk.close()
    back = _reopen(tmp_path, max_bytes=12_000)     # two of ~5 KB fit
    assert [rid for rid, _, _ in back] == ["resp_3", "resp_4"]


def test_rows_that_are_not_what_the_node_writes_are_skipped(tmp_path):
    disk = ResponseDisk.open(tmp_path)
    disk.put("resp_ok", json.dumps(_msgs(1)), json.dumps(_resp(1)))
    disk.close()
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        rows = [("bad_json", 5, 0, "{not json", "{}"), ("not_a_list", 6, 0, '{"a": 1}', "{}"),
                ("not_dicts", 7, 0, "[1, 2]", "{}"), ("resp_not_dict", 8, 0, "[]", "[1]"),
                ("deep", 9, 0, "[" * 100_000 + "]" * 100_000, "{}"), ("blob", 10, 0, b"\x00\x01", "{}"),
                ("huge", 11, 0, json.dumps([{"c": "y" * 3_000_000}]), "{}")]
        db.executemany("INSERT INTO responses VALUES (?, ?, ?, ?, ?)", rows)
    back = _reopen(tmp_path, max_bytes=1 << 20)
    assert [rid for rid, _, _ in back] == ["resp_ok"]


def test_a_file_that_is_not_a_journal_is_moved_aside(tmp_path, caplog):
    (tmp_path / FILE_NAME).write_bytes(os.urandom(4096))
    with caplog.at_level(logging.WARNING, logger="meshnode.serve.response_disk"):
        store = ResponseStore(journal=ResponseDisk.open(tmp_path))
        assert store.restore(store.journal.load(10, 1 << 20)) == 0
    assert "moved to responses.sqlite3.bad" in caplog.text
    assert (tmp_path / (FILE_NAME + ".bad")).exists()
    store.put("resp_1", _msgs(1), _resp(1))          # and a new journal works
    store.journal.close()
    assert [rid for rid, _, _ in _reopen(tmp_path)] == ["resp_1"]


def test_a_journal_that_cannot_be_written_leaves_the_store_in_memory(tmp_path, caplog):
    (tmp_path / "file").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="meshnode.serve.response_disk"):
        store = ResponseStore(journal=ResponseDisk.open(tmp_path / "file"))
        assert store.restore(store.journal.load(10, 1 << 20)) == 0
        for i in range(3):
            assert store.put(f"resp_{i}", _msgs(i), _resp(i))
        store.journal.flush()
    assert store.get("resp_2").response == _resp(2)   # memory still keeps them
    assert caplog.text.count("stay in memory only") == 1
    store.journal.close()
