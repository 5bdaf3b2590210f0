"""llama.cpp's CPU threads on a machine that does other work: the spin-wait meshnode
sets for libgomp before llama.cpp loads, and bench engine's busy processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from meshnode.bench.engine_bench import busy_processes, end_processes


def _spin_after_import(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", "import os, meshnode; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env={**clean, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.slow
def test_meshnode_shortens_libgomp_s_spin_unless_the_user_set_it():
    assert _spin_after_import() == "3000"
    assert _spin_after_import(GOMP_SPINCOUNT="20000") == "20000"
    assert _spin_after_import(OMP_WAIT_POLICY="active") == "None"   # the user's wait policy decides


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # (a zombie is gone too)
        return f.read().split(") ")[1][0] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_busy_processes_end_with_the_benchmark_even_when_it_is_killed():
    procs = busy_processes(2)
    assert all(_alive(p.pid) for p in procs)
    end_processes(procs)
    assert not any(_alive(p.pid) for p in procs)
    # a benchmark killed by a timeout: its busy processes notice and stop by themselves
    code = ("import os, sys; from meshnode.bench.engine_bench import busy_processes\n"
            "p = busy_processes(1)\nprint(p[0].pid, flush=True)\nos._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, check=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
