"""The named suites measure what their readers need, and the program suites (decode, documents,
ring, training) run as ``octlm bench NAME`` with options of their own."""

import argparse
import importlib
import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from octlm import records
from octlm.cli import main
from octlm.lab.bench import worker
from octlm.lab.bench.suites import ALIASES, FEATURES, PROGRAMS, SUITES, suite
from octlm.lab.report.baseline import baseline_rows

CONTEXT = {"torch": "x", "device": "cpu", "threads": 1, "host_cpu": "test"}


def as_records(measurements) -> list[dict]:
    """The ok records a run of ``measurements`` would write (made-up figures)."""
    figures = dict(status="ok", seconds_median=0.1, extra_bytes=1, peak_bytes=2, run="r")
    return [worker.make_record(m, "bench-test", CONTEXT, **figures) for m in measurements]


def shape_of(measurement):
    return replace(measurement, backend="", block=None)


def test_the_report_reads_every_baseline_measurement_and_the_alias_is_the_same_suite():
    baseline = suite("baseline")
    assert suite("seed") == baseline
    assert len(baseline_rows(as_records(baseline))) == len(baseline)


@pytest.mark.parametrize("name", [name for name in SUITES if name != "cuda"])
def test_every_cpu_measurement_is_one_its_backend_takes(name):
    """No suite asks a backend for a keyword or shape it refuses (the sketch only where it runs)."""
    for m in suite(name):
        assert m.device == "cpu"
        query = key = value = torch.empty(0)
        worker.attention_call(m, query, key, value, worker.structure(m, torch.device("cpu")))


@pytest.mark.parametrize("name", SUITES)
def test_at_every_shape_a_suite_compares_all_its_backends(name):
    """A suite is comparisons: each shape is measured by every backend its grid lists, so the
    report pairs them in every round; the longest length too, where the memory guard (not the
    suite) decides what cannot run."""
    at = defaultdict(set)
    for m in suite(name):
        at[shape_of(m)].add(m.backend)
    for grid in SUITES[name]:
        for m in grid.measurements():
            assert at[shape_of(m)] >= set(grid.backends), m
    assert {m.device.split(":")[0] for m in suite(name)} == {"cuda" if name == "cuda" else "cpu"}


def test_the_structure_suite_covers_every_feature_and_structural_rule_in_both_modes():
    found = suite("structure")
    features = {m.feature for m in found if m.feature}
    assert features == set(FEATURES)
    for feature in features - {"left padding"}:  # learned or score keywords: with gradients
        assert {m.mode for m in found if m.feature == feature} == {"forward", "train"}
    assert any(m.window for m in found) and any(m.padding for m in found)
    assert any(m.q_len == 1 for m in found) and any(1 < m.q_len < m.length for m in found)


def test_every_suite_the_makefile_names_exists():
    named = re.findall(r"octlm bench (\S+)", (Path(__file__).parents[2] / "Makefile").read_text())
    assert named and set(named) <= {*SUITES, *PROGRAMS, *ALIASES}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_program_suite_writes_to_runs_local_unless_told(name):
    """A plain run leaves the committed reference records in runs/ as they are."""
    own = argparse.ArgumentParser()
    importlib.import_module(PROGRAMS[name]).add_arguments(own)
    assert Path(own.parse_args([]).output).parent == Path("runs", "local")


def test_the_reference_target_names_the_committed_file_of_every_suite_it_runs():
    """`make reference` writes runs/*.jsonl only because each of its lines says so."""
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    target = makefile.split("\nreference:")[1].split("\n\n")[0].replace("\\\n", " ")
    runs = [line for line in target.splitlines() if re.search(r"octlm( bench|\.lab\.bench)", line)]
    assert len(runs) == target.count("$(PY) -m octlm") - 2  # all but verify and report
    for line in runs:
        assert re.search(r"--output runs/bench-[a-z]+-cpu\.jsonl\b", line), line


@pytest.mark.parametrize("name", [*SUITES, *PROGRAMS])
def test_every_suites_help_is_the_program_it_runs(name, capsys):
    """``octlm bench NAME --help`` shows NAME's own options: a program suite's are those of
    its module's parser, and no grid option; a grid suite's are the grid's."""
    with pytest.raises(SystemExit) as stop:
        main(["bench", name, "--help"])
    assert stop.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: octlm bench {name} ")
    if name in PROGRAMS:
        own = argparse.ArgumentParser()
        importlib.import_module(PROGRAMS[name]).add_arguments(own)
        options = {option for action in own._actions for option in action.option_strings}
        assert "--backends" not in shown and "--busy" not in shown
    else:
        options = {"--backends", "--lengths", "--dtypes", "--busy", "--rounds", "--resume"}
    assert all(option in shown for option in options), options


def test_a_program_suite_runs_under_octlm_bench_with_its_own_options(tmp_path):
    output = tmp_path / "decode.jsonl"
    argv = ["bench", "decode", "--contexts", "16", "--new-tokens", "2"]
    argv += ["--rounds", "1", "--repeats", "1", "--chunk", "8", "--kv-heads", "2"]
    assert main([*argv, "--output", str(output)]) == 0
    stages = {r["stage"] for r in records.read(output)}
    assert stages == {"prefill", "decode", "attention"}


@pytest.mark.parametrize(
    "argv, named",
    [
        (["ring", "--length", "100", "--worlds", "3", "--layout", "plain"], "(100)"),
        (["ring", "--worlds", "0"], "--worlds"),
    ],
)
def test_a_program_suites_refusal_is_one_line_and_exit_2(argv, named, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    assert main(["bench", *argv, "--output", str(output)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("octlm bench ring: ") and named in line
    assert not output.exists()


@pytest.mark.parametrize(
    "suite_name, argv, named",
    [
        ("training", ["--lengths", "99999"], "--lengths must be at most 4096"),
        ("documents", ["--rounds", "2"], "--rounds must be at least 3"),
        ("decode", ["--lengths", "64"], "unrecognized arguments: --lengths"),  # a grid option
    ],
)
def test_a_program_suites_options_are_its_own(suite_name, argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", suite_name, *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"octlm bench {suite_name}" in err and named in err


def test_the_training_suite_alternates_the_attentions_round_by_round(tmp_path, monkeypatch):
    """Every (round, length, packing) runs each implementation once, reversed in even rounds,
    at a fixed number of tokens per step; each record says its run and round."""
    from octlm.lab.bench import training

    calls = []

    def fake(corpus, folder, name, length, packed, dtype, half):
        calls.append((name, length, packed))
        return records.make("check", "train-attention", CONTEXT) | {"attention": name}

    monkeypatch.setattr(training, "_train_attention", fake)
    output = tmp_path / "steps.jsonl"
    argv = ["--what", "attention", "--attention", "sdpa", "tiled", "auto", "--lengths", "256",
            "--packing", "off", "on", "--dtypes", "float32", "--rounds", "2"]  # fmt: skip
    assert training.main([*argv, "--output", str(output)]) == 0
    forward, backward = ["sdpa", "tiled", "auto"], ["auto", "tiled", "sdpa"]
    assert [name for name, _, _ in calls] == forward * 2 + backward * 2
    assert [packed for _, _, packed in calls] == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    found = records.read(output)
    assert [r["round"] for r in found] == [1] * 6 + [2] * 6
    assert len({r["run"] for r in found}) == 1


def test_one_training_step_run_is_a_real_octlm_train_with_packed_rows(tmp_path):
    """The suite's own command trains (auto, packed rows) and reports warm steps only."""
    from octlm.lab.bench import training

    corpus = training._corpus(tmp_path)
    assert len(list(corpus.rglob("*.txt"))) > 10  # many documents, for packing
    record = training._train_attention(
        corpus, tmp_path / "run", "auto", 128, True, "float32", half=1
    )
    assert record["status"] == "ok", record
    assert record["batch"] == training.TOKENS_PER_STEP // 128 and record["packed"] is True
    assert record["tokens_per_second"] > 0 and record["peak_bytes"] > 0
