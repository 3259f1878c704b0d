"""``octlm verify``: the quick run passes and writes the records of docs/design.md, 'Records', a
broken implementation fails it with a record that says which check and by how much, and an
interrupted run keeps every record it finished."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import octlm.attention.tiled.attention
from octlm import cli
from octlm.lab import verify
from octlm.lab.verify.structure import STRUCTURES

FIELDS = {
    # every record (records.make)
    *("kind", "run", "experiment", "time", "torch", "device", "threads", "host_cpu"),
    # every verification record
    *("check", "left", "right", "dtype", "length", "block", "kv_heads", "head_size", "causal"),
    *("window", "error", "base_error", "tolerance", "max_abs_diff", "passed"),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def lines(folder: Path) -> list[dict]:
    """Every line of every records file, parsed strictly (a torn line fails the test)."""
    return [
        json.loads(line)
        for path in sorted(folder.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


@pytest.mark.slow
def test_quick_run_passes_and_writes_design_records(tmp_path, capsys):
    assert cli.main(["verify", "--quick", "--out", str(tmp_path)]) == 0
    files = sorted(tmp_path.glob("*.jsonl"))
    assert [path.name.split("-", 3)[3] for path in files] == sorted(
        f"{name}.jsonl" for name in verify.EXPERIMENTS
    )
    found = lines(tmp_path)
    assert {record["experiment"] for record in found} == set(verify.EXPERIMENTS)
    for record in found:
        assert record.keys() >= FIELDS, FIELDS - record.keys()
        assert record["passed"], record
    assert {record["kind"] for record in found} == {"verify"}
    assert len({record["run"] for record in found}) == 1
    # Token counts and loss curves are not judged by the equality rule: no tolerance, their
    # own figures instead.
    greedy = [record for record in found if record["check"].startswith("greedy")]
    curves = [record for record in found if record["experiment"] == "training"]
    assert greedy and curves
    for record in greedy:
        assert record["tolerance"] is None and record["mismatched_tokens"] == 0
        assert record["tokens_differing_from_naive"] == 0
    for record in curves:
        assert record["error"] is None and record["tolerance"] is None
        assert record["loss_relative_difference"] <= record["loss_tolerance"]
    output = capsys.readouterr().out
    assert "worst error" in output and "FAIL" not in output
    assert all(str(path) in output for path in files)


def perturb_forward(monkeypatch):
    forward = octlm.attention.tiled.attention.forward_rows

    def broken(*args, **kwargs):
        out, rows = forward(*args, **kwargs)
        return out + 1e-3, rows

    monkeypatch.setattr(octlm.attention.tiled.attention, "forward_rows", broken)


def perturb_backward(monkeypatch):
    backward = octlm.attention.tiled.attention.attend_backward

    def broken(*args, **kwargs):
        grad_query, grad_key, grad_value = backward(*args, **kwargs)
        return grad_query, grad_key, grad_value + 1e-3

    monkeypatch.setattr(octlm.attention.tiled.attention, "attend_backward", broken)


@pytest.mark.parametrize(
    "perturb, experiment, check",
    [
        (perturb_forward, "tiled-sdpa", "tiled vs sdpa output"),
        (perturb_backward, "gradients", "gradient of value"),
    ],
)
def test_broken_tiled_fails_and_says_where(perturb, experiment, check, tmp_path, monkeypatch):
    perturb(monkeypatch)
    argv = ["verify", "--quick", "--out", str(tmp_path), "--dtype", "float32", "--only"]
    assert cli.main([*argv, experiment]) == 1
    failed = [record for record in lines(tmp_path) if not record["passed"]]
    assert failed and {record["check"] for record in failed} == {check}
    for record in failed:
        assert record["error"] > record["tolerance"]
        assert record["error"] == pytest.approx(1e-3, rel=0.05)  # the perturbation, seen


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_interrupted_run_keeps_every_finished_record(stop, tmp_path):
    command = [sys.executable, "-m", "octlm", "verify", "--quick", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(path.stat().st_size for path in tmp_path.glob("*.jsonl")):
            assert process.poll() is None, "verify ended before writing a record"
            assert time.monotonic() < deadline, "no record within 120 s"
            time.sleep(0.05)
        process.send_signal(stop)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    if stop == signal.SIGINT:
        assert process.returncode == 130 and "interrupted" in stderr
    else:
        assert process.returncode == -signal.SIGKILL
    found = lines(tmp_path)
    assert found and all(record.keys() >= FIELDS for record in found)


@pytest.mark.parametrize(
    "argv, named",
    [(["--device", "tpu"], "device"), (["--device", "cuda:7"], "device")],
)
def test_bad_options_name_the_argument(argv, named, tmp_path, capsys):
    if argv[-1].startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert cli.main(["verify", "--out", str(tmp_path), *argv]) == 2
    assert named in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_check(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["verify", "--out", str(blocker / "runs"), "--only", "training"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "cannot be written" in err


def test_structure_cases_cover_every_implementation_and_catch_an_ignored_keyword(
    tmp_path, monkeypatch
):
    """Every structure case runs in each single-process implementation that lists its keywords
    (sdpa and tiled besides the naive base); a tiled that ignores document ids fails exactly
    the document checks, output and gradients, and no other."""
    honest = octlm.attention.tiled.attention._rules_with

    def without_documents(rules, *tensors):
        return dataclasses.replace(honest(rules, *tensors), documents=None)

    monkeypatch.setattr(octlm.attention.tiled.attention, "_rules_with", without_documents)
    argv = ["verify", "--quick", "--out", str(tmp_path), "--dtype", "float32", "--only"]
    assert cli.main([*argv, "structure"]) == 1
    found = lines(tmp_path)
    covered = {(record["structure"], record["left"]) for record in found}
    assert covered == {(name, left) for name in STRUCTURES for left in ("sdpa", "tiled", "auto")}
    failed = {(record["structure"], record["left"]) for record in found if not record["passed"]}
    # auto gives documents to tiled, so it fails with it
    documents = ("documents", "documents, fewer queries than keys")
    assert failed == {(name, left) for name in documents for left in ("tiled", "auto")}
    wrong = {record["check"].split(": ")[1] for record in found if not record["passed"]}
    assert {"output", "gradient of query"} <= wrong


def test_records_go_to_runs_local_unless_told(tmp_path, monkeypatch):
    """A plain `octlm verify` leaves the committed reference records in runs/ as they are."""
    monkeypatch.chdir(tmp_path)
    argv = ["verify", "--quick", "--dtype", "float32", "--only", "tiled-sdpa"]
    assert cli.main(argv) == 0
    assert list((tmp_path / "runs" / "local").glob("*-tiled-sdpa.jsonl"))
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["local"]
