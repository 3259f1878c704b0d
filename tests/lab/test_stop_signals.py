"""octlm's commands stop cleanly on SIGINT, SIGTERM and SIGHUP: exit status 128 + the signal,
one line on stderr, every finished record kept, no child process and no temporary file left.
Real signals to real processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from octlm import records
from tests.lab.test_bench import alive, children

DEADLINE = 180  # seconds for a process to reach the point where it is stopped


def start(argv: list[str], tmp_path: Path) -> subprocess.Popen:
    """``argv`` under this Python, with its temporary files in ``tmp_path / "tmp"``."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    return subprocess.Popen(
        [sys.executable, *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def wait_for(process: subprocess.Popen, ready, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not ready():
        assert process.poll() is None, f"the command ended before {what}: {process.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE} s"
        time.sleep(0.05)


def stop(process: subprocess.Popen, signum: int) -> str:
    """Send ``signum``; the command's stderr once it has ended."""
    try:
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return stderr


def has_records(path: Path):
    return lambda: size(path) > 0


def size(path: Path) -> int:
    """``path``'s size, 0 where it is not there (a writer may replace it as it is looked at)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def assert_stopped_cleanly(process, stderr: str, signum: int, tmp_path: Path) -> None:
    name = signal.Signals(signum).name
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {name}"
    assert process.returncode == 128 + signum, stderr
    [line] = stderr.strip().splitlines()
    assert said in line
    assert list((tmp_path / "tmp").iterdir()) == []


def test_verify_stops_with_its_finished_records(tmp_path):
    signum = signal.SIGHUP
    out = tmp_path / "runs"
    process = start(["-m", "octlm", "verify", "--quick", "--out", str(out)], tmp_path)
    wait_for(process, lambda: any(size(p) for p in out.glob("*.jsonl")), "a record")
    stderr = stop(process, signum)
    assert_stopped_cleanly(process, stderr, signum, tmp_path)
    assert f"finished records are in {out}" in stderr
    skipped = []
    assert [r for path in out.glob("*.jsonl") for r in records.read(path, skipped)]
    assert skipped == []


@pytest.mark.parametrize(
    "command, signum",
    [
        (["-m", "octlm", "bench", "decode"], signal.SIGTERM),
        (["-m", "octlm.lab.bench.decode"], signal.SIGHUP),
    ],
    ids=["octlm bench decode, SIGTERM", "the alias, SIGHUP"],
)
def test_the_decode_suite_and_its_alias_stop_with_their_records(command, signum, tmp_path):
    output = tmp_path / "decode.jsonl"
    sizes = ["--contexts", "16", "--new-tokens", "2", "--rounds", "100000", "--repeats", "1"]
    sizes += ["--chunk", "8", "--kv-heads", "2", "--output", str(output)]
    process = start([*command, *sizes], tmp_path)
    wait_for(process, has_records(output), "a record")
    stderr = stop(process, signum)
    assert_stopped_cleanly(process, stderr, signum, tmp_path)
    assert f"finished records are in {output}" in stderr
    skipped = []
    assert records.read(output, skipped) and skipped == []


def test_the_training_suite_stops_its_octlm_train_child_and_removes_its_scratch(tmp_path):
    output = tmp_path / "training.jsonl"
    argv = ["-m", "octlm", "bench", "training", "--what", "attention"]
    argv += ["--lengths", "16", "--steps", "100000", "--dtypes", "float32", "--output", str(output)]
    process = start(argv, tmp_path)

    def training():
        return [pid for pid, line in children(process.pid).items() if "octlm train" in line]

    wait_for(process, training, "octlm train child")
    [child] = training()
    stderr = stop(process, signal.SIGHUP)
    assert_stopped_cleanly(process, stderr, signal.SIGHUP, tmp_path)
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "octlm train outlived the suite that started it"
