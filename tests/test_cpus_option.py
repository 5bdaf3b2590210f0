"""`--cpus`: a node keeps itself (every thread) on the CPUs it is given.

The option checks run :func:`meshnode.cli.main` in this process (they fail before a node
starts); the pinned node, and one bad value given to the real command, are ``slow``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from meshnode.bench.cluster import cpu_flags
from nodeproc import meshnode_cmd, start_node

linux_only = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")


@pytest.mark.parametrize("value", ["x", "3-1", "-2", "0,,1", "0-4000000000"])
def test_malformed_cpu_lists_are_refused_up_front(tmp_path, value, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", "--no-model", "--cpus", value)
    assert r.returncode == 2
    assert "argument --cpus" in r.stderr and "Traceback" not in r.stderr


@linux_only
def test_a_cpu_this_process_cannot_use_is_named(tmp_path, meshnode_main):
    missing = max(os.sched_getaffinity(0)) + 1
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", "--no-model", "--cpus", str(missing))
    assert r.returncode != 0
    assert f"CPU {missing} not available here" in r.stderr and "Traceback" not in r.stderr


@linux_only
def test_cpus_not_available_are_named_as_ranges(tmp_path, meshnode_main):
    top = max(os.sched_getaffinity(0))
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", "--no-model", "--cpus", f"0-{top + 900}")
    assert r.returncode != 0
    assert f"CPU {top + 1}-{top + 900} not available here" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@linux_only
def test_the_meshnode_command_names_a_cpu_it_cannot_use(tmp_path):
    missing = max(os.sched_getaffinity(0)) + 1
    r = meshnode_cmd("--home", str(tmp_path), "serve", "--headless", "--no-model", "--cpus", str(missing))
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshnode: error:"), r.stderr   # one line, no traceback
    assert f"CPU {missing} not available here" in err[0]


@pytest.mark.slow
@linux_only
def test_every_thread_of_a_pinned_node_stays_on_its_cpus(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    node = start_node(tmp_path / "a", "pinned", "--no-model", "--no-discovery", "--cpus", str(cpu))
    try:
        node.wait_up()
        tasks = list(Path(f"/proc/{node.proc.pid}/task").iterdir())
        assert len(tasks) > 1   # the event loop and its helper threads
        for task in tasks:
            status = (task / "status").read_text()
            allowed = next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
            assert allowed.split(":")[1].strip() == str(cpu), (task, allowed)
    finally:
        node.stop(signal.SIGTERM)


@linux_only
def test_benchmark_nodes_get_cpus_of_their_own_only_when_there_are_enough():
    n = len(os.sched_getaffinity(0))
    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_flags(0, 1, 1, pin=False) == ()
    assert cpu_flags(0, 1, 1, pin=True) == ("--cpus", str(cpus[0]))
    assert cpu_flags(n - 1, n, 1, pin=True) == ("--cpus", str(cpus[-1]))
    assert cpu_flags(0, n + 1, 1, pin=True) == ()   # more nodes than CPUs: the OS decides
