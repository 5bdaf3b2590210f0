"""`meshnode serve`: a malformed option is refused by the parser, named, with no traceback.

The checks run :func:`meshnode.cli.main` in this process; the ``slow`` test runs the real
``meshnode`` command.
"""

from __future__ import annotations

import pytest

from nodeproc import meshnode_cmd


@pytest.mark.parametrize("option, value", [
    ("--max-memory", "lots"),
    ("--max-memory", "-3GB"),
    ("--split", "x"),
    ("--ctx", "0"),
    ("--wire-dtype", "f8"),
])
def test_malformed_serve_options_are_refused_up_front(tmp_path, option, value, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", option, value)
    assert r.returncode == 2
    assert f"argument {option}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_the_meshnode_command_refuses_a_malformed_serve_option(tmp_path):
    r = meshnode_cmd("--home", str(tmp_path), "serve", "--headless", "--split", "x")
    assert r.returncode == 2
    assert "argument --split" in r.stderr and "Traceback" not in r.stderr
