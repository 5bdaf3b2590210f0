"""The measured fetch rate: folded from finished pulls, advertised in capabilities, read
back from peers' with hostile values refused (pure logic)."""

from __future__ import annotations

import math

import pytest

from meshnode.mesh.share import RATE_MIN_BYTES, ShareService
from meshnode.net.caps import MAX_RATE, from_dict, to_dict
from meshnode.state import Capabilities


def test_capabilities_carry_the_rate():
    caps = Capabilities(1 << 30, fetch_bytes_per_s=123e6)
    assert from_dict(to_dict(caps)).fetch_bytes_per_s == 123e6
    assert from_dict({"free_ram": 1}).fetch_bytes_per_s == 0.0     # an older peer: not measured


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, MAX_RATE * 2, "1e400"])
def test_a_peer_claiming_an_impossible_rate_counts_as_unmeasured(bad):
    assert from_dict({"free_ram": 1, "fetch": bad}).fetch_bytes_per_s == 0.0


def test_a_rate_that_is_not_a_number_refuses_the_record():
    assert from_dict({"free_ram": 1, "fetch": "fast"}) is None


def test_finished_pulls_fold_into_the_advertised_rate():
    svc = ShareService(fabric=None, paths=None)
    told = []
    svc.on_rate = lambda: told.append(svc.fetch_bytes_per_s)
    svc._measured(RATE_MIN_BYTES - 1, 0.001)      # too small to say anything about the link
    assert svc.fetch_bytes_per_s == 0.0 and told == []
    svc._measured(200_000_000, 2.0)
    assert svc.fetch_bytes_per_s == 100e6 and told == [100e6]
    svc._measured(100_000_000, 0.5)               # 200 MB/s, averaged in
    assert 100e6 < svc.fetch_bytes_per_s < 200e6 and len(told) == 2


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, 2e12, True, "1", None])
def test_a_profile_with_a_bad_rate_is_refused_before_authentication(bad):
    from meshnode.net.auth import check_capabilities

    assert check_capabilities({"free_ram": 1, "fetch": 100e6}) is None
    assert "bad fetch" in check_capabilities({"free_ram": 1, "fetch": bad})
