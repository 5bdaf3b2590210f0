"""The model service's start-up progress: every transfer goes to the UI; the log gets a
line per 10 % only once a phase has run for PROGRESS_LOG_AFTER_S (quick work logs nothing)."""

from __future__ import annotations

import asyncio
import logging
import math

from meshnode.serve import service
from meshnode.serve.service import PROGRESS_LOG_AFTER_S, ModelService


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "meshnode.serve.service"]


async def test_a_quick_phase_logs_nothing_and_a_long_one_every_tenth(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(service.time, "monotonic", lambda: now[0])
    svc = ModelService(node=None, options=None)
    caplog.set_level(logging.INFO, logger="meshnode.serve.service")
    hook = svc._progress("m")
    for done in range(0, 101, 5):             # hashing 100 MB in no time
        hook("hash", done * 10**6, 100 * 10**6)
    await asyncio.sleep(0)
    assert _lines(caplog) == []
    assert svc._transfers["m"].done_bytes == 100 * 10**6    # the UI saw it all the same

    for done in range(0, 101, 5):             # fetching, 0.25 s per 5 %
        hook("fetch", done * 10**6, 100 * 10**6)
        now[0] += 0.25
    lines = _lines(caplog)
    first = 5 * math.ceil(PROGRESS_LOG_AFTER_S / 0.25)   # the first 5 % step at or past the threshold
    assert lines[0] == f"m: fetch {first // 10 * 10}% ({first:.1f} of 100.0 MB)"
    assert lines[-1] == "m: fetch 100% (100.0 of 100.0 MB)"
    assert len(lines) == 10 - first // 10 + 1
