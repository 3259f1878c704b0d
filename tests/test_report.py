"""``octlm report``: every figure from the records, "not measured" where they are silent."""

from __future__ import annotations

import json
from pathlib import Path

from octlm.bench.suites import key_of
from octlm.cli import main
from octlm.report import NOT_MEASURED, claims, load, write_report

# Synthetic records of the seed, train and structure suites (tests/fixtures/make_bench_records.py)
FIXTURE = Path(__file__).parent / "fixtures" / "bench-records.jsonl"
PNG = b"\x89PNG\r\n\x1a\n"


def test_report_from_fixture_has_claims_structure_and_plots(tmp_path):
    output = tmp_path / "out" / "report.md"
    assert main(["report", str(FIXTURE), "--output", str(output)]) == 0
    text = output.read_text()
    assert "host CPU Fixture CPU, 2 threads, torch 2.13.0+cpu" in text
    assert "| Claim | Seed (laptop CPU, Day 2) | Here |" in text
    # The fixture's MATH takes 8e-8 s per score and FLASH 7.5e-9 s: a 10.7x speed-up.
    assert "| FLASH speed-up over MATH, float32 | 10.5× at 8,192 | 10.7× at 8,192 |" in text
    assert "unsupported in all 8 measurements" in text
    assert "| window, forward | cpu float32 forward, 8,192 queries × 8,192 keys, window 512" in text
    assert "| decode | cpu float32 forward, 1 query × 8,192 keys" in text
    pictures = sorted(p.name for p in output.parent.glob("*.png"))
    assert pictures == sorted(
        f"bench-cpu-{mode}-{metric}.png"
        for mode in ("forward", "train")
        for metric in ("time", "memory")
    )
    for name in pictures:
        assert f"![{name}]({name})" in text
        assert (output.parent / name).read_bytes().startswith(PNG)


def test_load_ignores_other_records_and_keeps_ok_over_a_failed_rerun(tmp_path):
    ring = tmp_path / "bench-ring-cpu.jsonl"
    first = json.loads(FIXTURE.read_text().splitlines()[0])
    ring.write_text(json.dumps({**first, "world_size": 1, "seconds_median": 1e9}) + "\n")
    rows = load([ring, FIXTURE])
    lines = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert len(rows) == len(lines) - 2  # the verification record and the failed rerun
    same = [r for r in rows if key_of(r) == key_of(first)]
    assert [(r["status"], r["pid"]) for r in same] == [("ok", first["pid"])]


def test_missing_data_reads_not_measured(tmp_path):
    only_flash = tmp_path / "flash.jsonl"
    lines = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    only_flash.write_text(
        "".join(json.dumps(r) + "\n" for r in lines if r.get("backend") == "flash")
    )
    rows = load([only_flash])
    table = {claim: here for claim, _seed, here in claims(rows)}
    assert table["MATH memory per doubling of length"] == NOT_MEASURED
    assert table["FLASH memory stays flat"].endswith("at 8,192 (1.59× per doubling)")
    assert table["memory-efficient backend on CPU"] == NOT_MEASURED
    text = write_report([only_flash], tmp_path / "report.md").read_text()
    assert NOT_MEASURED in text


def test_report_without_any_records(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    text = write_report([empty], tmp_path / "report.md").read_text()
    assert "no benchmark records" in text
    assert all(here == NOT_MEASURED or NOT_MEASURED in here for _c, _s, here in claims([]))


def test_equivalence_and_ring_sections_come_from_their_records(tmp_path):
    """The seed's 4.8e-7 and 1.1e-6 sit beside verify's worst figures; ring rows beside W=1."""
    verify = tmp_path / "verify.jsonl"
    common = {"experiment": "tiled-sdpa", "dtype": "float32", "passed": True, "base_error": 0.0}
    checks = [
        {**common, "check": "tiled vs sdpa output", "left": "tiled", "error": 3e-7,
         "max_abs_diff": 6e-7},
        {**common, "check": "tiled vs sdpa output", "left": "tiled", "error": 2e-7,
         "max_abs_diff": 9e-7},
        {**common, "experiment": "model-equivalence", "check": "model logits", "left": "sdpa",
         "error": 1e-6, "max_abs_diff": 1.2e-6, "passed": False},
    ]  # fmt: skip
    verify.write_text("".join(json.dumps(r) + "\n" for r in checks))
    first = json.loads(FIXTURE.read_text().splitlines()[0])
    ring = tmp_path / "bench-ring-cpu.jsonl"
    ring.write_text(
        json.dumps({**first, "backend": "ring", "world_size": 4, "extra_bytes": 2**20,
                    "peak_bytes": 300 * 2**20, "seconds_median": 0.5}) + "\n"
    )  # fmt: skip
    output = tmp_path / "report.md"
    write_report([FIXTURE, verify, ring], output)
    text = output.read_text()
    assert "3 verification records, 1 failed" in text
    assert "| 4.8e-7 | 9e-07 (2/2 pass) |" in text
    assert "| 1.1e-6 | 1.2e-06 (0/1 pass) |" in text
    assert "| 1 MiB | 300 MiB |" in text and "| 4 | 500.0 ms |" in text
