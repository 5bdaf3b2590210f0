"""A node's timeline of the token path: debug telemetry that ``meshnode bench serve`` turns on.

Off unless ``$MESHNODE_TIMELINE`` names a folder when the process starts. Then every
lane packet sent and received and every llama.cpp decode call is marked with the
monotonic clock (``time.perf_counter_ns``, one clock for every process of the machine),
and the marks are written to ``<folder>/<pid>.json`` when the process exits. The bench
lines up the marks of a split's nodes step by step (:mod:`meshnode.bench.timeline`) and
shows where a decode token's time goes: each stage's compute, its Python before and after,
the sockets, and the wait between one node's send and the next node's receive.

Costless when off: :data:`RECORDER` is None and each call site is one test of it. When
on, a mark costs ~0.2 us and 9 bytes (a clock reading and a tag code appended to two
arrays); at most :data:`MAX_MARKS` are kept, so a long run cannot grow without bound.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from array import array
from pathlib import Path

__all__ = ["ENV", "MAX_MARKS", "RECORDER", "Recorder", "TAGS"]

ENV = "MESHNODE_TIMELINE"
MAX_MARKS = 2_000_000   # 18 MB at most; `bench serve` makes a few thousand per node
TAGS = ("send<", "send>", "recv<", "recv>", "dec<", "dec>")
_CODE = {tag: i for i, tag in enumerate(TAGS)}


class Recorder:
    """Marks ``(ns, tag)`` of one process. Tags used by the node: ``send<``/``send>``
    around a lane packet's ``sendto``, ``recv<``/``recv>`` around a lane packet's
    decryption and decoding (up to the hand-off, inside which a stage may compute),
    ``dec<``/``dec>`` around one ``llama_decode``."""

    __slots__ = ("times", "codes", "dropped")

    def __init__(self) -> None:
        self.times = array("q")
        self.codes = array("B")
        self.dropped = 0

    def mark(self, tag: str) -> None:
        if len(self.times) < MAX_MARKS:
            self.times.append(time.perf_counter_ns())
            self.codes.append(_CODE[tag])
        else:
            self.dropped += 1

    @property
    def marks(self) -> list[tuple[int, str]]:
        return [(t, TAGS[c]) for t, c in zip(self.times, self.codes)]

    def dump(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "dropped": self.dropped, "marks": self.marks}))
        tmp.replace(path)
        return path


def _from_env() -> Recorder | None:
    folder = os.environ.get(ENV)
    if not folder:
        return None
    rec = Recorder()
    atexit.register(rec.dump, Path(folder))
    return rec


RECORDER: Recorder | None = _from_env()
