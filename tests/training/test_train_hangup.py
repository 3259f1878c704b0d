"""A closed terminal or ssh session (SIGHUP) stops ``octlm train`` as SIGTERM does: after the
current step, with a checkpoint, exit 128 + 1."""

from __future__ import annotations

import signal
import subprocess

from octlm import load_run
from tests.training.test_run_folder_lock import training_past_its_first_step
from tests.training_helpers import losses, write_corpus


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
