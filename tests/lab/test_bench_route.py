"""``octlm bench route``: attention="auto" beside SDPA's FLASH kernel and tiled on every
case of its rule, and an auto record that says which path it took."""

from __future__ import annotations

from dataclasses import replace

import pytest

from octlm.lab.bench.suites import Grid, suite
from octlm.lab.bench.worker import measure

TINY = Grid(backends=("auto",), lengths=(32,), heads=2, head_sizes=(16,), repeats=1)


def test_the_route_suite_measures_the_issue_cases_with_auto_flash_and_tiled():
    found = suite("route")
    assert {m.backend for m in found} == {"auto", "flash", "tiled"}
    assert {(m.length, m.dtype, m.heads, m.head_size) for m in found} == {(8192, "float32", 8, 32)}
    cases = {(m.q_len, m.window, m.padding, m.feature, m.mode) for m in found}
    assert cases == {
        (8192, 0, 0.0, None, "forward"), (8192, 0, 0.0, None, "train"),
        (8192, 512, 0.0, None, "forward"),
        (8192, 0, 0.0, "documents", "forward"), (8192, 0, 0.0, "documents", "train"),
        (8192, 0, 0.5, None, "forward"),
        (8192, 0, 0.0, "softcap", "forward"), (8192, 0, 0.0, "alibi", "forward"),
        (8192, 0, 0.0, "sinks", "forward"),
        (1, 0, 0.0, None, "forward"), (1024, 0, 0.0, None, "forward"),
    }  # fmt: skip
    for case in cases:  # every case measures all three, side by side
        same = [m for m in found if (m.q_len, m.window, m.padding, m.feature, m.mode) == case]
        assert sorted(m.backend for m in same) == ["auto", "flash", "tiled"], case


@pytest.mark.parametrize(
    "changes, route",
    [
        ({}, "sdpa: plain causal"),
        ({"windows": (8,)}, "tiled: window=8"),
        ({"features": ("documents",), "modes": ("train",)}, "tiled: document_ids"),
    ],
)
def test_an_auto_record_says_which_path_it_took(changes, route):
    [measurement] = replace(TINY, **changes).measurements()
    record = measure(measurement)
    assert record["status"] == "ok" and record["block"] is None
    assert record["route"].startswith(route)
    [tiled] = replace(TINY, backends=("tiled",), **changes).measurements()
    assert "route" not in measure(tiled)
