"""One process at a time in a run folder: a second start or resume is refused at once, touches
nothing, and names the holder; a holder killed with SIGKILL leaves no lock behind."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import octlm
from octlm.cli import main
from octlm.training import lock, resolve, train
from octlm.training.metrics import METRICS
from tests.helpers import join_gloo, spawn
from tests.training_helpers import (
    TINY_MODEL,
    TINY_RUN,
    losses,
    read_metrics,
    tiny_flags,
    write_corpus,
)

SOURCE = str(Path(octlm.__file__).parents[1])  # the tested octlm, for the processes started here
HOLD = (
    "import sys, time; from octlm.training import lock; lock.acquire(sys.argv[1]); "
    "print('held', flush=True); time.sleep(600)"
)


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SOURCE, os.environ.get("PYTHONPATH", "")])}


def contents(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with a hash of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


def wait_for(predicate, what: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, f"{what}: the process ended with {process.returncode}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.05)


def training_past_its_first_step(corpus: Path, folder: Path, stdout=subprocess.DEVNULL):
    """An ``octlm train`` process on ``folder`` that would run for a million steps, returned
    once its first step is recorded. Eager: ``--compile auto`` would compile a run that long,
    seconds of CPU before the first step, and the tests that start it are not about compiling."""
    flags = [*tiny_flags(corpus, folder, steps=1_000_000), "--no-compile"]
    process = subprocess.Popen(
        [sys.executable, "-m", "octlm", *flags],
        env=environment(), stdout=stdout, stderr=subprocess.PIPE,
    )  # fmt: skip
    wait_for(lambda: (folder / METRICS).exists(), "the run's first step", process)
    return process


def test_a_held_folder_is_refused_untouched_and_a_killed_holder_leaves_no_lock(
    corpus, tmp_path, capsys
):
    folder = tmp_path / "run"
    assert main(tiny_flags(corpus, folder, steps=2)) == 0
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], env=environment(), stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        before = contents(folder)
        capsys.readouterr()
        for extra in ([], ["--overwrite"], ["--resume", "--steps", "3"]):
            assert main([*tiny_flags(corpus, folder, steps=3), *extra]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err  # one line
            assert f"is in use by process {holder.pid}" in err
        assert contents(folder) == before
    finally:
        holder.kill()  # SIGKILL: the kernel drops the lock with the process
        holder.wait()
    assert main([*tiny_flags(corpus, folder, steps=3), "--resume", "--steps", "3"]) == 0
    assert sorted(losses(folder)) == [1, 2, 3]
    # A start refused before it prepared anything (float16 on a CPU) leaves no folder or lock.
    assert main([*tiny_flags(corpus, tmp_path / "new", steps=2), "--dtype", "float16"]) == 2
    assert not (tmp_path / "new").exists()


def test_two_octlm_train_on_one_folder_leave_the_first_run_whole(corpus, tmp_path, capsys):
    """The issue's case: a second ``octlm train`` on a folder that one is writing. The second
    is refused at once; the first trains on and stops cleanly, with one run in its records."""
    folder = tmp_path / "same"
    first = training_past_its_first_step(corpus, folder)
    try:
        assert main(tiny_flags(corpus, folder, steps=2)) == 2
        assert f"is in use by process {first.pid}" in capsys.readouterr().err
        assert main([*tiny_flags(corpus, folder, steps=2), "--resume"]) == 2
        assert f"is in use by process {first.pid}" in capsys.readouterr().err
        assert first.poll() is None  # still training
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    steps = [record["step"] for record in read_metrics(folder, "train_step")]
    assert steps == list(range(1, len(steps) + 1))
    assert len({record["run"] for record in read_metrics(folder, "train_step")}) == 1


def _rank_worker(rank: int, corpus: str, folder: str, store: str) -> None:
    join_gloo(rank, 2, store)
    model_config, run = resolve(model=TINY_MODEL, run={**TINY_RUN, "data": corpus})
    try:
        train(model_config, run, Path(folder), progress=False)
        outcome = "trained"
    except ValueError as error:
        outcome = str(error)
    Path(store).with_name(f"rank{rank}.txt").write_text(outcome)


@pytest.mark.distributed
def test_under_torchrun_every_rank_is_refused_while_another_process_holds_the_folder(
    corpus, tmp_path
):
    """Rank 0 takes the lock; the other ranks wait for its verdict and share it."""
    folder = tmp_path / "run"
    held = lock.acquire(folder)
    try:
        spawn(_rank_worker, (str(corpus), str(folder), str(tmp_path / "store")), 2, 240, "ranks")
    finally:
        held.release(keep=False)
    for rank in range(2):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert f"is in use by process {os.getpid()}" in outcome, (rank, outcome)
    assert not folder.exists()
