"""`meshnode serve`: a malformed option is refused by the parser, named, with no traceback."""

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
def test_malformed_serve_options_are_refused_up_front(tmp_path, option, value):
    r = meshnode_cmd("--home", str(tmp_path), "serve", "--headless", option, value)
    assert r.returncode == 2
    assert f"argument {option}" in r.stderr and "Traceback" not in r.stderr
