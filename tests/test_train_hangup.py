"""A closed terminal or ssh session (SIGHUP) stops ``octlm train`` as SIGTERM does: after the
current step, with a checkpoint, exit 128 + 1."""

from __future__ import annotations

import signal
import subprocess
import sys

from octlm import load_run
from octlm.training.metrics import METRICS
from tests.test_run_folder_lock import environment, wait_for
from tests.training_helpers import losses, tiny_flags, write_corpus


def test_sighup_writes_a_checkpoint_and_exits_129(tmp_path):
    corpus, folder = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "octlm", *tiny_flags(corpus, folder, steps=1_000_000)],
        env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_for(lambda: (folder / METRICS).exists(), "the first step", process)
        process.send_signal(signal.SIGHUP)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGHUP, err.decode()[-2000:]
    assert b"stopped by SIGHUP after step" in out
    _model, _tokenizer, step = load_run(folder)
    assert 1 <= step < 1_000_000
    assert max(losses(folder)) == step
