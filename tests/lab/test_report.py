"""``octlm report``: every figure from the records; where they are silent, the command that
would fill them in."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch

from octlm import records
from octlm.cli import main
from octlm.lab import verify
from octlm.lab.bench.suites import Grid, key_of
from octlm.lab.bench.worker import make_record
from octlm.lab.report import DEFAULT_OUTPUT, NOT_MEASURED, collect, comparison, load, write_report
from octlm.lab.report.baseline import HEADER as CLAIMS_HEADER
from octlm.lab.report.collect import busy as busy_reason
from octlm.lab.report.collect import latest_runs
from octlm.lab.report.format import BUSY_MARK

# Synthetic records of the baseline, train and structure suites
# (tests/fixtures/make_bench_records.py).
FIXTURE = Path(__file__).parents[1] / "fixtures" / "bench-records.jsonl"
RUNS = Path(__file__).parents[2] / "runs"
PNG = b"\x89PNG\r\n\x1a\n"
MACHINE = {"torch": "2.13.0+cpu", "device": "cpu", "threads": 2, "host_cpu": "Test CPU", "cpus": 2}


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table of ``text``: its rows, each ``{heading: cell}``."""
    found, lines = [], text.splitlines()
    for index, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[index + 1].startswith("|---"):
            headings, rows = cells(line), []
            for body in lines[index + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(headings, cells(body), strict=True)))
            found.append(rows)
    return found


def row(text: str, **match: str) -> dict[str, str]:
    """The one row of the report's tables whose cells hold ``match`` (a heading's spaces and
    other characters as underscores)."""

    def key(heading: str) -> str:
        return re.sub(r"\W", "_", heading)

    hits = [
        r
        for found in tables(text)
        for r in found
        if all(any(key(h) == name and r[h] == v for h in r) for name, v in match.items())
    ]
    assert len(hits) == 1, (match, hits)
    return hits[0]


def shown(text: str) -> float:
    """The first number written in ``text`` (thousands separators allowed)."""
    return float(re.search(r"-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?", text).group().replace(",", ""))


def shows(text: str, value: float) -> bool:
    """Whether the three significant digits written in ``text`` are ``value`` rounded."""
    unit = 10 ** (math.floor(math.log10(abs(value))) - 2) if value else 0.0
    return abs(shown(text) - value) <= unit / 2 + 1e-12


def duration(text: str) -> float:
    """Seconds of a cell that starts ``500.0 ms`` (or ``s``, ``µs``)."""
    number, unit = re.match(r"([\d,.]+) (s|ms|µs)\b", text).groups()
    return float(number.replace(",", "")) * {"s": 1.0, "ms": 1e-3, "µs": 1e-6}[unit]


def time_and_memory(text: str, seconds: float, bytes_: int, busy: bool = False) -> bool:
    """Whether a ``time, memory`` cell shows ``seconds`` (to its written digits), ``bytes_``
    in MiB, and the busy mark exactly when ``busy``."""
    digits = len(text.split(" ")[0].partition(".")[2])
    unit = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}[text.split(" ")[1].rstrip(",")]
    close = abs(duration(text) - seconds) <= 0.5 * 10**-digits * unit + 1e-12
    memory = shown(text.split(", ")[1]) == round(bytes_ / 2**20)
    return close and memory and (BUSY_MARK in text) == busy


def over_rounds(text: str, ratios: list[float]) -> bool:
    """Whether a ``median× (min–max, n rounds)`` cell is these per-round ratios."""
    median, rest = text.split("× ", 1)
    if len(ratios) == 1:
        return shows(median, ratios[0]) and rest == "(1 round)"
    low, high, count = re.match(r"\((\S+)–(\S+), (\d+) rounds\)", rest).groups()
    return (
        shows(median, statistics.median(ratios)) and shows(low, min(ratios))
        and shows(high, max(ratios)) and int(count) == len(ratios)
    )  # fmt: skip


def fixture_seconds(**want) -> float:
    """The fixture's ok forward float32 record at 8,192 keys that matches ``want``: its time."""
    want = {"length": 8192, "dtype": "float32", "mode": "forward", "q_len": 8192, **want}
    want = {"window": 0, "padding": 0.0, "status": "ok", **want}
    [found] = [
        r for r in map(json.loads, FIXTURE.read_text().splitlines())
        if r.get("kind") == "bench" and all(r.get(k) == v for k, v in want.items())
    ]  # fmt: skip
    return found["seconds_median"]


def write(path: Path, found: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in found))
    return path


def timed(backend: str, seconds: float, round: int = 1, busy: bool = False, **results) -> dict:
    """An ok benchmark record at 8,192 tokens (float32, 8 heads of 32) of run ``r``."""
    [m] = replace(Grid(backends=(backend,), lengths=(8192,)), busy=(busy,)).measurements()
    figures = dict(seconds_median=seconds, seconds=[seconds], extra_bytes=2**20, peak_bytes=2**30)
    return make_record(m, "test", MACHINE, run="r", round=round, status="ok", **figures, **results)


def test_report_from_fixture_has_claims_structure_and_plots(tmp_path):
    output = tmp_path / "out" / "report.md"
    assert main(["report", str(FIXTURE), "--output", str(output)]) == 0
    text = output.read_text()
    assert "- Machine: Fixture CPU, CPU count not recorded" in text and "torch 2.13.0+cpu" in text
    assert "`cpu ×2` in the tables: cpu, 2 threads" in text
    assert any(list(found[0]) == CLAIMS_HEADER for found in tables(text))
    notes = {claim: note for claim, note, _here in comparison(load([FIXTURE]))}
    speed_up = row(text, What="FLASH speed-up over MATH, float32")
    assert speed_up["Baseline (laptop CPU)"] == notes["FLASH speed-up over MATH, float32"]
    assert shows(
        speed_up["This machine"], fixture_seconds(backend="math") / fixture_seconds(backend="flash")
    )
    assert speed_up["This machine"].endswith("at 8,192")
    lines = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    efficient = [r for r in lines if r.get("backend") == "efficient"]
    assert {r["status"] for r in efficient} == {"unsupported"}
    refused = row(text, What="memory-efficient backend on CPU")["This machine"]
    assert "No viable backend" in efficient[0]["reason"]  # torch's words, translated:
    assert (
        refused == f"no CPU kernel: torch has this backend for CUDA only ({len(efficient)} refused)"
    )
    for case, want in (("window, forward", dict(window=512)), ("decode", dict(q_len=1))):
        want = {"backend": "flash", "status": "ok", "mode": "forward", **want}
        [flash] = [r for r in lines if all(r.get(k) == v for k, v in want.items())]
        found = row(text, Case=case)
        queries = "1 query" if flash["q_len"] == 1 else f"{flash['q_len']:,} queries"
        assert f"float32 forward, {queries} × {flash['length']:,} keys" in found["Shape"]
        assert ("window" in found["Shape"]) == bool(flash["window"])
        assert time_and_memory(
            found["FLASH (dense mask)"], flash["seconds_median"], flash["extra_bytes"]
        )
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
    legacy = {k: v for k, v in first.items() if k not in ("kind", "run", "round", "busy")}
    ring.write_text(json.dumps({**legacy, "world_size": 1, "seconds_median": 1e9}) + "\n")
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
    table = {claim: here for claim, _note, here in comparison(rows)}
    assert table["MATH memory per doubling of length"] == NOT_MEASURED
    assert table["FLASH memory stays flat"].endswith("at 8,192 (1.59× per doubling)")
    assert table["memory-efficient backend on CPU"] == NOT_MEASURED
    text = write_report([only_flash], tmp_path / "report.md").read_text()
    assert NOT_MEASURED not in text  # a figure without records is named with its command:
    lacking = "No records of: MATH memory per doubling of length; FLASH speed-up over MATH"
    assert f"{lacking}" in text and "(`octlm bench baseline`)" in text
    for command in ("octlm verify", "octlm bench ring"):
        assert f"No records yet (`{command}`)" in text  # one line for a whole section


def test_records_of_two_machines_are_reported_apart_and_never_paired(tmp_path):
    """FLASH measured on one machine and tiled on another: no ratio of the two anywhere."""
    other = {**MACHINE, "host_cpu": "Other CPU", "cpus": 64}
    found = [timed("flash", 0.5), timed("math", 5.0), {**timed("tiled", 0.6), **other}]
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    assert "These records describe 2 machines differently" in text
    assert "## Machine 1: Test CPU, 2 CPUs" in text and "## Machine 2: Other CPU, 64 CPUs" in text
    assert "tiled ÷ FLASH" not in text and "math ÷ FLASH" in text
    compared = [r["What"] for found in tables(text) for r in found if "What" in r]
    assert "tiled against FLASH, forward float32" not in compared  # it needs both machines
    assert sorted(p.name for p in tmp_path.glob("*.png"))[0].startswith("machine-1-")


def test_records_carry_the_machine_they_were_made_on():
    made = records.make("peak", "x", "cpu", gflops=1.0)
    assert made["cpus"] == os.cpu_count() and made["torch"] == torch.__version__
    assert records.identity(made) == records.identity(records.machine("cpu"))
    if Path("/proc/cpuinfo").exists():
        flags = set(made["cpu_flags"].split())
        assert flags <= set(records.SIMD) and made["memory_bytes"] > 0


def test_the_committed_report_is_what_octlm_report_makes_of_the_committed_records(
    tmp_path, monkeypatch
):
    """runs/report.md is `octlm report --output runs/report.md` over runs/*.jsonl, exactly;
    the command's default output is runs/local/, never the tracked file."""
    monkeypatch.chdir(RUNS.parent)
    output = tmp_path / "report.md"
    committed = sorted(str(path.relative_to(RUNS.parent)) for path in RUNS.glob("*.jsonl"))
    assert main(["report", "--output", str(output), *committed]) == 0
    assert output.read_text() == (RUNS / "report.md").read_text()
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(FIXTURE)]) == 0
    assert DEFAULT_OUTPUT.is_file() and Path("runs/local/report.md") == DEFAULT_OUTPUT
    # without files it reads this machine's own records, runs/local/*.jsonl
    mine = Path("runs/local/bench-baseline-cpu.jsonl")
    mine.write_bytes(FIXTURE.read_bytes())
    assert main(["report"]) == 0
    assert str(mine) in DEFAULT_OUTPUT.read_text()


def test_report_without_any_records_says_so_plainly(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    text = write_report([empty], tmp_path / "report.md").read_text()
    assert f"No records in `{empty}`: nothing was measured, so this report has no figures." in text
    assert "## " not in text  # no section of empty tables
    figures = [here for _c, _note, here in comparison([])]
    assert all(here == NOT_MEASURED or here.endswith("no records") for here in figures)


def test_equivalence_and_ring_sections_come_from_their_records(tmp_path):
    """The baseline's 4.8e-7 and 1.1e-6 sit beside verify's worst figures; ring rows beside
    W=1."""
    verify = tmp_path / "verify.jsonl"
    first = json.loads(FIXTURE.read_text().splitlines()[0])
    machine = {name: first.get(name) for name in records.MACHINE}  # the fixture's machine
    common = {"experiment": "tiled-sdpa", "dtype": "float32", "passed": True, "base_error": 0.0}
    common.update(machine)
    checks = [
        {**common, "check": "tiled vs sdpa output", "left": "tiled", "error": 3e-7,
         "max_abs_diff": 6e-7},
        {**common, "check": "tiled vs sdpa output", "left": "tiled", "error": 2e-7,
         "max_abs_diff": 9e-7},
        {**common, "experiment": "model-equivalence", "check": "model logits", "left": "sdpa",
         "error": 1e-6, "max_abs_diff": 1.2e-6, "passed": False},
    ]  # fmt: skip
    verify.write_text("".join(json.dumps(r) + "\n" for r in checks))
    ring = tmp_path / "bench-ring-cpu.jsonl"
    ring.write_text(
        json.dumps({**first, "kind": "ring", "backend": "ring", "world_size": 4,
                    "extra_bytes": 2**20, "peak_bytes": 300 * 2**20, "seconds_median": 0.5}) + "\n"
    )  # fmt: skip
    output = tmp_path / "report.md"
    write_report([FIXTURE, verify, ring], output)
    text = output.read_text()
    assert "4 verification records from the latest run of each of 3 experiments, 1 failed" in text
    for check, left, experiment in (
        ("tiled vs SDPA, float32", "tiled", "tiled-sdpa"),
        ("whole model, SDPA vs naive logits", "sdpa", "model-equivalence"),
    ):
        mine = [c for c in checks if c["left"] == left and c["experiment"] == experiment]
        found = [r for t in tables(text) for r in t if r.get("Check", "").startswith(check)]
        [here] = [r["This machine"] for r in found]
        worst = max(c["max_abs_diff"] for c in mine)
        passed = sum(c["passed"] for c in mine)
        assert shown(here) == worst and here.endswith(f"({passed}/{len(mine)} pass)")
    ring_row = row(text, Processes="4")
    assert (
        ring_row["Extra memory"] == "1 MiB" and shown(ring_row["Peak (its shard included)"]) == 300
    )
    assert duration(ring_row["Time"]) == 0.5 and ring_row["Length"] == f"{first['length']:,}"


def test_committed_records_without_a_kind_are_read_with_the_kind_they_imply(tmp_path):
    """Records written before kinds existed are still read: the committed benchmark, ring and
    verify records with their ``kind`` taken out come back with the kind they had, and every
    committed line is read."""
    paths = sorted([*RUNS.glob("*.jsonl"), *RUNS.glob("checks/*.jsonl")])
    skipped = []
    committed = [record for path in paths for record in records.read(path, skipped)]
    assert skipped == []
    for kind in ("bench", "ring", "verify"):
        found = [record for record in committed if record["kind"] == kind]
        assert found, kind
        legacy = tmp_path / f"{kind}.jsonl"
        without = [{name: v for name, v in r.items() if name != "kind"} for r in found]
        legacy.write_text("".join(json.dumps(r) + "\n" for r in without))
        assert '"kind"' not in legacy.read_text()
        assert {record["kind"] for record in records.read(legacy, skipped)} == {kind}
    assert skipped == []


def test_lines_that_are_not_records_are_skipped_and_listed(tmp_path, capsys):
    good = timed("flash", 0.5)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b"\xff\xfe\n[1, 2]\n"
        + json.dumps({**good, "extra_bytes": None}).encode() + b"\n"
        + json.dumps({**good, "length": "8192"}).encode() + b"\n"
        + json.dumps(good).encode() + b"\n"
    )  # fmt: skip
    output = tmp_path / "report.md"
    assert main(["report", str(path), "--output", str(output)]) == 0
    text = output.read_text()
    assert f"skipped: {path}: skipped 4 line(s): line 1: not UTF-8; line 2: a JSON list" in text
    assert "'extra_bytes' must be int, got None" in text and "1 benchmark measurements" in text
    assert "skipped 4 line(s)" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["missing.jsonl", "folder"])
def test_a_missing_records_file_is_a_clear_error(where, tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    assert main(["report", str(tmp_path / where), "--output", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "octlm report: no records file" in err and where in err and "Traceback" not in err
    if where == "folder":
        assert "metrics.jsonl" in err  # a folder is read as a training run's


def test_structure_targets_judge_only_the_length_they_are_set_for(tmp_path):
    """The targets are stated for 8,192 keys: a 256-key window run shows its ratio, unjudged."""
    found = []
    for backend, seconds in (("tiled", 0.5), ("flash", 1.0)):
        [m] = Grid(backends=(backend,), lengths=(256,), windows=(64,)).measurements()
        figures = dict(seconds_median=seconds, seconds=[seconds], extra_bytes=1, peak_bytes=2)
        found.append(make_record(m, "test", MACHINE, run="r", round=1, status="ok", **figures))
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    window = row(text, Case="window, forward")
    assert window["Ratio"].startswith("speed-up") and shows(window["Ratio"].split()[1], 1.0 / 0.5)
    assert window["Target"].endswith("at 8,192 keys") and window["Met"] == ""


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    import octlm.lab.report

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(octlm.lab.report, "write_report", interrupted)
    assert main(["report", str(FIXTURE), "--output", str(tmp_path / "r.md")]) == 130
    assert capsys.readouterr().err == "octlm report: interrupted\n"


def test_an_output_that_cannot_be_written_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["report", str(FIXTURE), "--output", str(tmp_path / "file" / "r.md")]) == 2
    assert "--output" in capsys.readouterr().err


def test_ratios_come_per_round_with_their_spread_and_fraction_of_peak(tmp_path):
    """Three rounds of tiled and FLASH: the ratio of each round, their median and range; the
    fraction of the run's matmul peak by FlashAttention's count (tflops)."""
    found = []
    for round, (tiled, flash) in enumerate([(0.6, 0.5), (0.9, 0.6), (0.65, 0.5)], 1):
        found.append(timed("tiled", tiled, round, tflops=0.03))
        found.append(timed("flash", flash, round, tflops=0.06))
    found.append(records.make("peak", "test", MACHINE, run="r", busy=False, gflops=120.0, size=64))
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    pairs = [(0.6, 0.5), (0.9, 0.6), (0.65, 0.5)]
    ratio = row(text, Ratio="tiled ÷ FLASH")
    assert ratio["Shape"] == "cpu ×2 forward float32 8,192"
    assert over_rounds(ratio["Median (min–max, rounds)"], [t / f for t, f in pairs])
    # TFLOP/s of the record over the run's GFLOP/s
    assert shown(ratio["% of peak"]) == 0.03e3 / 120 * 100 and ratio["% of peak"].endswith("%")
    assert shown(ratio["FLASH % of peak"]) == 0.06e3 / 120 * 100
    assert "120 GFLOP/s over 1 run(s)" in text
    # the "every measurement" table shows the median of the rounds
    every = row(text, length="8,192")
    assert time_and_memory(every["flash"], statistics.median(f for _, f in pairs), 2**20)
    assert time_and_memory(every["tiled"], statistics.median(t for t, _ in pairs), 2**20)


def test_records_of_two_thread_counts_are_two_measurements_never_a_pair(tmp_path):
    """The same measurement on 1 and on 2 threads: neither replaces the other, each has its own
    table, and the claims set FLASH's time against tiled's of its own thread count."""
    found = [timed("flash", 0.5), timed("tiled", 0.6)]
    one = {**timed("tiled", 2.0), "threads": 1, "run": "r1"}
    text = write_report(
        [write(tmp_path / "b.jsonl", [*found, one])], tmp_path / "report.md"
    ).read_text()
    assert ": 3 benchmark measurements" in text
    assert "**cpu ×2, forward, float32**" in text and "**cpu ×1, forward, float32**" in text
    against = row(text, What="tiled against FLASH, forward float32")["This machine"]
    assert against.startswith("time ") and shows(against.split()[1], 0.6 / 0.5)  # 2 threads


@pytest.mark.parametrize(
    "edit",
    [
        {"q_len": None}, {"block": 128}, {"cpu_seconds": "1"}, {"round": [1]}, {"run": 5},
        {"padding": "0.5"}, {"window": None}, {"seconds_median": 0}, {"causal": 1},
        {"status": "weird"},
    ],
    ids=str,
)  # fmt: skip
def test_a_hand_edited_record_of_the_wrong_type_is_skipped_and_named(tmp_path, edit):
    found = [timed("flash", 0.5), {**timed("tiled", 0.6), **edit}]
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    assert ": 1 benchmark measurements" in text
    assert f"line 2: bench record field {next(iter(edit))!r} must be" in text


def test_measurements_on_a_busy_machine_are_flagged(tmp_path):
    found = [
        timed("flash", 0.5, load_before=4.0, cpus=2, tflops=0.06),
        timed("tiled", 0.6, cpu_seconds=0.5, wall_seconds=1.0),  # 2 threads: a quarter
        timed("math", 5.0, load_before=1.9, cpus=2, cpu_seconds=1.9, wall_seconds=1.0),
        records.make("peak", "test", MACHINE, run="r", gflops=40.0, load_before=3.0, cpus=2),
    ]
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    assert "2 of 3 measurements (rounds counted one by one) ran while other processes" in text
    every = row(text, length="8,192")
    for record in found[:3]:
        flagged = busy_reason(record) is not None
        cell = every[record["backend"]]
        assert time_and_memory(cell, record["seconds_median"], record["extra_bytes"], flagged)
    ratio = row(text, Ratio="tiled ÷ FLASH")
    assert over_rounds(ratio["Median (min–max, rounds)"], [0.6 / 0.5])
    assert ratio["% of peak"] == "—"  # the tiled record has no FLOP rate
    assert (
        shown(ratio["FLASH % of peak"]) == 0.06e3 / 40 * 100
        and BUSY_MARK in ratio["FLASH % of peak"]
    )
    assert ratio["Rounds on a busy machine"] == "1 of 1"
    assert "1 of 1 probe(s) ran busy (load 3.00 on 2 CPUs)" in text


def test_a_process_that_got_its_cpu_time_is_not_busy_whatever_the_load_average():
    """The one-minute load average still counts a competing process for a while after it
    stopped; a measurement whose process got all its threads' CPU time was not slowed."""
    after_a_busy_one = timed("tiled", 0.6, load_before=3.1, cpus=2, cpu_seconds=1.9)
    after_a_busy_one["wall_seconds"] = 1.0
    assert busy_reason(after_a_busy_one) is None
    starved = {**after_a_busy_one, "cpu_seconds": 1.0}
    assert busy_reason(starved) == "got 50% of its 2 threads' CPU time"
    assert busy_reason({"load_before": 3.1, "cpus": 2}) == "load 3.10 on 2 CPUs"


def test_busy_means_other_processes_took_cpu_time_not_that_the_call_used_one_thread():
    """A kernel that keeps one thread of two busy gets half its threads' time on an idle
    machine; what marks a figure is the CPU time other processes used while it was timed."""
    one_thread = timed("flash", 0.5, cpu_seconds=1.0, wall_seconds=1.0, load_before=3.5, cpus=2)
    assert busy_reason({**one_thread, "others_seconds": 0.05}) is None
    crowded = {**one_thread, "others_seconds": 0.9}
    assert busy_reason(crowded) == "other processes used 0.90 CPUs meanwhile"


def test_timing_counts_the_cpu_time_of_a_competing_process():
    from octlm.lab.bench.timing import machine_cpu_seconds, time_calls

    if machine_cpu_seconds() is None:
        pytest.skip("no /proc/stat")

    def spent(pid: int) -> float:  # utime + stime of ``pid``, in seconds
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        before = spent(competitor.pid)
        crowded = time_calls(lambda: time.sleep(0.25), 2)
        used = spent(competitor.pid) - before
    finally:
        competitor.kill()
        competitor.wait()
    # every CPU second the competitor spent in the timed span is another process's
    assert used > 0.05
    assert crowded.others_seconds >= 0.8 * used - 0.02


def test_contention_compares_each_backends_growth_under_the_busy_mode(tmp_path):
    found = []
    for round, (tiled, flash) in enumerate([((0.6, 1.8), (0.4, 0.8)), ((0.6, 2.4), (0.4, 0.8))], 1):
        for backend, (idle, busy) in (("tiled", tiled), ("flash", flash)):
            found += [timed(backend, idle, round), timed(backend, busy, round, busy=True)]
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    tiled = [busy / idle for idle, busy in ((0.6, 1.8), (0.6, 2.4))]
    flash = [busy / idle for idle, busy in ((0.4, 0.8), (0.4, 0.8))]
    growth = row(text, Shape="cpu ×2 forward float32 8,192", Met="no")
    assert over_rounds(growth["tiled busy ÷ idle"], tiled)
    assert over_rounds(growth["FLASH busy ÷ idle"], flash)
    assert over_rounds(
        growth["tiled growth ÷ FLASH growth"], [t / f for t, f in zip(tiled, flash, strict=True)]
    )
    # busy measurements stay out of the idle tables
    every = row(text, length="8,192")
    assert time_and_memory(every["flash"], 0.4, 2**20) and time_and_memory(
        every["tiled"], 0.6, 2**20
    )
    # an idle baseline taken on a busy machine cannot judge the target
    found[0] = {**found[0], "load_before": 9.0, "cpus": 2}
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    judged = row(
        text,
        Shape="cpu ×2 forward float32 8,192",
        Met="not judged: the idle runs were on a busy machine",
    )
    assert over_rounds(judged["tiled busy ÷ idle"], tiled)


def test_a_training_run_folder_gets_a_training_report(tmp_path):
    """The real step count (the last step, though only every 10th is logged), held-out bits
    per byte over steps and seconds, tokens/s, the configuration and the loss curve."""
    run = tmp_path / "run"
    run.mkdir()
    metrics = [
        {"kind": "train_step", "run": "a", "step": step, "loss": 5.0 - step / 100, "lr": 1e-3,
         "tokens_per_second": 1000.0 + step, "grad_norm": 0.5, "train_seconds": step / 10}
        for step in range(10, 501, 10)
    ] + [
        {"kind": "eval", "run": "a", "step": step, "val_loss": 4.5 - step / 1000,
         "val_bits_per_byte": 2.0 - step / 1000, "train_seconds": step / 10}
        for step in (250, 500)
    ]  # fmt: skip
    write(run / "metrics.jsonl", metrics)
    config = {"model": {"width": 64, "window": None}, "run": {"steps": 500, "lr": 1e-3}}
    (run / "config.json").write_text(json.dumps(config))
    output = tmp_path / "out" / "report.md"
    for given in (run, run / "metrics.jsonl"):
        assert main(["report", str(given), "--output", str(output)]) == 0
        text = output.read_text()
        assert text.startswith("# octlm training report")
        speeds = [m["tokens_per_second"] for m in metrics if m["kind"] == "train_step"]
        summary = f"500 steps in 50.00 s of training; median {statistics.median(speeds):,.0f}"
        assert summary in text and "held-out 1.5000 bits per byte at step 500" in text
        assert "not measured" not in text and "Baseline" not in text
        for evaluation in metrics[-2:]:
            held = row(text, Step=f"{evaluation['step']:,}", Bits_byte=ANY)
            assert shown(held["Bits/byte"]) == evaluation["val_bits_per_byte"]
            assert shown(held["Training seconds"]) == evaluation["train_seconds"]
        last = row(text, Step="500", Tokens_s=ANY)
        assert shown(last["Loss (nats/token)"]) == metrics[49]["loss"]
        assert row(text, Setting="model.width")["Value"] == "`64`"
        assert "model.window" not in text  # unset
        [picture] = output.parent.glob("*.png")
        assert f"![{picture.name}]({picture.name})" in text
        assert picture.read_bytes().startswith(PNG)


def test_a_run_report_goes_to_its_folder_and_replaces_no_benchmark_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    benchmark_report = Path(DEFAULT_OUTPUT)
    benchmark_report.parent.mkdir(parents=True)
    benchmark_report.write_text("the benchmark report\n")
    runs = []
    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        write(run / "metrics.jsonl", [{"kind": "train_step", "step": 1, "loss": 1.0}])
        runs.append(run)
    assert main(["report", str(runs[0])]) == 0
    assert (runs[0] / "report.md").read_text().startswith("# octlm training report")
    assert main(["report", *map(str, runs)]) == 0
    assert Path("runs/local/training-report.md").read_text().startswith("# octlm training")
    assert benchmark_report.read_text() == "the benchmark report\n"


def test_training_runs_and_benchmark_records_make_separate_reports(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write(run / "metrics.jsonl", [{"kind": "train_step", "step": 1, "loss": 1.0}])
    argv = ["report", str(run), str(FIXTURE), "--output", str(tmp_path / "r.md")]
    assert main(argv) == 2
    assert "make separate reports" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


def test_verify_run_twice_is_counted_once(tmp_path):
    """Two runs into one folder append to the same files; the report reads the latest run."""
    plan = replace(verify.QUICK, lengths=(64,), blocks=(32,))
    options = dict(plan=plan, dtypes=["float32"], experiments=["tiled-sdpa"], progress=False)
    first, paths = verify.run(tmp_path, **options)
    second, _ = verify.run(tmp_path, **options)
    assert len(records.read(paths[0])) == 2 * len(first) == 4
    assert len({r["run"] for r in first}) == 1 and first[0]["run"] != second[0]["run"]
    found = collect(paths)
    assert [r["run"] for r in found.verify] == [second[0]["run"]] * len(second)
    text = write_report(paths, tmp_path / "report.md").read_text()
    assert (
        f"{len(second)} verification records from the latest run of each of 1 experiments" in text
    )


def test_records_that_differ_in_feature_or_tiles_never_pair(tmp_path):
    """Within one round: plain FLASH and tiled, tiled at other tiles, and both with softcap.
    Each ratio compares like with like, and says which case it is."""
    found = [
        timed("flash", 0.5),
        timed("tiled", 1.0),
        {**timed("tiled", 5.0), "block": [16, 16]},
        {**timed("flash", 2.0), "feature": "softcap"},
        {**timed("tiled", 2.2), "feature": "softcap"},
    ]
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    for shape, ratio, seconds in (
        ("cpu ×2 forward float32 8,192", "tiled ÷ FLASH", 1.0 / 0.5),
        ("cpu ×2 forward float32 8,192", "tiled 16×16 ÷ FLASH", 5.0 / 0.5),
        ("cpu ×2 forward float32 8,192, softcap", "tiled ÷ FLASH", 2.2 / 2.0),
    ):
        assert over_rounds(
            row(text, Shape=shape, Ratio=ratio)["Median (min–max, rounds)"], [seconds]
        )
    # the table of plain measurements keeps the softcap runs out and the tilings apart
    every = row(text, length="8,192")
    assert time_and_memory(every["flash"], 0.5, 2**20) and time_and_memory(
        every["tiled"], 1.0, 2**20
    )
    assert time_and_memory(every["tiled 16×16"], 5.0, 2**20) and len(every) == 4


def test_ratios_pair_records_of_one_run_only(tmp_path):
    """A second run that measured tiled alone does not pair with the first run's FLASH under
    the same round number: that ratio was never measured side by side."""
    first = [timed("flash", 0.5), timed("tiled", 1.0)]
    second = [{**timed("tiled", 3.0), "run": "s"}]
    path = write(tmp_path / "b.jsonl", first + second)
    text = write_report([path], tmp_path / "r.md").read_text()
    assert "| tiled ÷ FLASH |" not in text
    assert "No round measured FLASH beside another backend" in text


def test_contention_rounds_that_never_meet_read_not_measured(tmp_path):
    """tiled idle and busy in round 1, FLASH in round 2 only: no growth to compare, no crash."""
    found = [timed("tiled", 0.6, 1), timed("tiled", 1.8, 1, busy=True)]
    found += [timed("flash", 0.4, 2), timed("flash", 0.8, 2, busy=True)]
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    growth = row(text, Shape="cpu ×2 forward float32 8,192")
    assert over_rounds(growth["tiled busy ÷ idle"], [1.8 / 0.6])
    assert over_rounds(growth["FLASH busy ÷ idle"], [0.8 / 0.4])
    assert growth["tiled growth ÷ FLASH growth"] == "—"


def test_a_busy_round_marks_the_median_it_joins(tmp_path):
    """Two rounds of FLASH, the first starved of CPU time: their median carries the mark."""
    found = [
        timed("flash", 1.5, 1, cpu_seconds=0.6, wall_seconds=1.0),  # 2 threads: 30%
        timed("flash", 0.5, 2, cpu_seconds=1.98, wall_seconds=1.0),
    ]
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    flash = row(text, length="8,192")["flash"]
    assert time_and_memory(flash, statistics.median([1.5, 0.5]), 2**20, busy=True)


def test_the_report_never_overwrites_its_records_and_reads_each_file_once(tmp_path, capsys):
    path = write(tmp_path / "b.jsonl", [timed("flash", 0.5), timed("tiled", 1.0)])
    before = path.read_text()
    assert main(["report", str(path), "--output", str(path)]) == 2
    assert "is one of the records read" in capsys.readouterr().err
    assert path.read_text() == before
    text = write_report([path, path, tmp_path / "." / "b.jsonl"], tmp_path / "r.md").read_text()
    assert "2 records from" in text


def test_verify_runs_of_different_dtypes_keep_each_others_figures():
    checks = [
        {"experiment": "tiled-sdpa", "run": "1", "dtype": "float32", "device": "cpu"},
        {"experiment": "tiled-sdpa", "run": "1", "dtype": "bfloat16", "device": "cpu"},
        {"experiment": "tiled-sdpa", "run": "2", "dtype": "bfloat16", "device": "cpu"},
    ]
    assert latest_runs(checks) == [checks[0], checks[2]]


def routed(backend: str, seconds: float, round: int, **grid) -> dict:
    """An ok record of the route suite's grid (8,192 tokens, float32) with ``grid``'s fields;
    ``auto``'s says which path it took, as the worker writes it."""
    [m] = replace(Grid(backends=(backend,), lengths=(8192,)), **grid).measurements()
    figures = dict(seconds_median=seconds, seconds=[seconds], extra_bytes=2**20, peak_bytes=2**30)
    chosen = {"route": "tiled: document_ids let blocks be skipped"} if grid else {}
    chosen = chosen or {"route": "sdpa: plain causal, no mask needed"}
    if backend != "auto":
        chosen = {}
    return make_record(m, "test", MACHINE, run="r", round=round, status="ok", **figures, **chosen)


def test_the_route_table_divides_auto_by_the_faster_path_of_each_round(tmp_path):
    """Per round, auto's time over the faster of FLASH and tiled, whichever that is; the path
    auto took; met when the median is at most 1.05."""
    plain = [(0.50, 0.40, 0.60), (0.45, 0.44, 0.70), (0.52, 0.50, 0.41)]  # auto, flash, tiled
    documents = [(0.25, 2.0, 0.20), (0.30, 2.1, 0.29), (0.205, 1.9, 0.20)]
    found = []
    for round, ((a, f, t), (da, df, dt)) in enumerate(zip(plain, documents, strict=True), 1):
        found += [routed("auto", a, round), routed("flash", f, round), routed("tiled", t, round)]
        documents_grid = {"features": ("documents",)}
        found += [routed(name, s, round, **documents_grid)
                  for name, s in (("auto", da), ("flash", df), ("tiled", dt))]  # fmt: skip
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    first = row(text, Case="plain causal, forward", auto_ran="sdpa")
    assert over_rounds(first["auto ÷ faster, median (min–max, rounds)"],
                       [a / min(f, t) for a, f, t in plain])  # fmt: skip
    assert first["auto ran"] == "sdpa" and first["Met"] == "no"  # median 1.25
    assert first["Faster of FLASH and tiled"] == "FLASH (2 of 3 rounds)"  # round 3: tiled
    second = row(text, Case="documents, forward", auto_ran="tiled")
    assert over_rounds(second["auto ÷ faster, median (min–max, rounds)"],
                       [a / min(f, t) for a, f, t in documents])  # fmt: skip
    assert second["auto ran"] == "tiled" and second["Met"] == "yes"  # median 0.30 / 0.29
    assert second["Faster of FLASH and tiled"] == "tiled (3 of 3 rounds)"


def test_the_route_table_says_not_measured_without_auto_beside_both_paths(tmp_path):
    found = [routed("auto", 0.5, 1), routed("flash", 0.4, 1)]  # no tiled in the round
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    assert "No round measured auto beside FLASH and tiled (`octlm bench route`)" in text


def stepped(attention: str, tokens_per_second: float, round: int, length: int = 1024,
            packed: bool = False) -> dict:  # fmt: skip
    """A ``train-attention`` record as ``octlm bench training --what attention``
    writes it."""
    return records.make("check", "train-attention", MACHINE, run="t") | {
        "attention": attention, "length": length, "packed": packed, "dtype": "float32",
        "batch": 4096 // length, "steps": 6, "status": "ok", "round": round,
        "tokens_per_second": tokens_per_second, "memory_metric": "ru_maxrss", "peak_bytes": 2**30,
    }  # fmt: skip


def test_the_training_step_table_judges_auto_by_the_faster_of_sdpa_and_tiled(tmp_path):
    speeds = [(900, 1000, 800), (1000, 950, 990), (700, 690, 720)]  # auto, sdpa, tiled tok/s
    found = [stepped(name, s, round, packed=True)
             for round, figures in enumerate(speeds, 1)
             for name, s in zip(("auto", "sdpa", "tiled"), figures, strict=True)]  # fmt: skip
    found.append(stepped("naive", 100, 1, packed=True))
    text = write_report([write(tmp_path / "b.jsonl", found)], tmp_path / "report.md").read_text()
    line = row(text, Batch___tokens__rows__dtype="4 × 1,024, packed, float32")
    assert line["auto tok/s"] == "900" and line["sdpa tok/s"] == "950"
    assert line["naive tok/s"] == "100" and line["tiled tok/s"] == "800"
    assert over_rounds(line["auto ÷ faster, median (min–max, rounds)"],
                       [max(s, t) / a for a, s, t in speeds])  # fmt: skip
