"""SIGINT and SIGTERM during octlm train: a checkpoint after the step, or no run at all while it
prepares; a closed terminal or ssh session (SIGHUP) stops a run as SIGTERM does.

Runs use a model of a few thousand parameters on a few kilobytes of generated text
(tests/training_helpers.py), so each takes about a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from octlm import load_run
from octlm.cli import main
from octlm.training import checkpoint, config, loop, readers, train
from octlm.training.metrics import METRICS
from tests.training.test_run_folder_lock import training_past_its_first_step
from tests.training_helpers import configs, losses, tiny_flags, write_corpus


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_signal_writes_a_checkpoint_and_exits_cleanly(corpus, tmp_path, capsys, signal_number):
    folder = tmp_path / "run"

    def interrupt_once_training():
        deadline = time.monotonic() + 60
        while not (folder / METRICS).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal_number)

    sender = threading.Thread(target=interrupt_once_training)
    sender.start()
    # Eager: --compile auto would compile a run this long, which is not what is tested here.
    status = main([*tiny_flags(corpus, folder, steps=1_000_000), "--no-compile"])
    sender.join()
    assert status == 128 + signal_number  # stopped early, as a shell reports a signal
    assert f"stopped by {signal_number.name}" in capsys.readouterr().out
    _model, _tokenizer, step = load_run(folder)
    assert 1 <= step < 1_000_000
    assert max(losses(folder)) == step


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_preparing_stops_at_once_and_leaves_no_run(
    corpus, tmp_path, capsys, monkeypatch, signal_number
):
    """Before the first step a signal stops the preparation where it is: no run, no
    half-written token file, exit 128 + signal; the next start begins afresh."""
    folder = tmp_path / "run"
    read, documents = readers.read, []

    def signalled(*args):  # the third document read: the split files are open, half written
        for document in read(*args):
            documents.append(document)
            if len(documents) == 3:
                os.kill(os.getpid(), signal_number)
            yield document

    monkeypatch.setattr(readers, "read", signalled)
    assert main(tiny_flags(corpus, folder, steps=2)) == 128 + signal_number
    monkeypatch.setattr(readers, "read", read)
    assert len(documents) == 3  # it stopped there
    assert "before the first step; start it again" in capsys.readouterr().err
    assert not (folder / config.CONFIG_FILE).exists() and not list(folder.rglob("*.tmp"))
    assert main(tiny_flags(corpus, folder, steps=2)) == 0


def test_a_signal_during_the_last_step_ends_nothing_early(corpus, tmp_path, monkeypatch):
    step = loop.Training.step

    def signalled_step(*args):
        os.kill(os.getpid(), signal.SIGINT)  # the loop sees it after this step, the last
        return step(*args)

    monkeypatch.setattr(loop.Training, "step", signalled_step)
    outcome = train(*configs(corpus, steps=1), tmp_path / "run", progress=False)
    assert outcome.stopped_by is None and outcome.step == 1
    assert checkpoint.latest(tmp_path / "run") is not None


def test_sighup_writes_a_checkpoint_and_exits_129(tmp_path):
    corpus, folder = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    process = training_past_its_first_step(corpus, folder, stdout=subprocess.PIPE)
    try:
        process.send_signal(signal.SIGHUP)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGHUP, err.decode()[-2000:]
    assert b"stopped by SIGHUP after step" in out
    _model, _tokenizer, step = load_run(folder)
    assert 1 <= step < 1_000_000
    assert max(losses(folder)) == step
