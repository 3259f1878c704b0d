"""A run folder written before runs named their best checkpoint still samples, exports and
resumes: the best is then the last, said as such, until the resumed run evaluates.

``tests/fixtures/run-d72e769`` is what ``octlm train`` wrote at commit d72e769 (its loss
picture and lock left out), from 12 documents of ``tests/training_helpers.write_corpus``::

    octlm train --data corpus --out run --steps 6 --width 8 --n-layers 1 --n-heads 2
        --n-kv-heads 1 --batch 4 --length 16 --eval-every 3 --checkpoint-every 2 --keep 2
        --log-every 1 --eval-batches 1 --sample-tokens 4 --dtype float32 --tokenizer bytes
        --optimizer adamw --warmup 2 --lr 1e-2
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from octlm import load_run
from octlm.cli import main
from octlm.training import checkpoint
from tests.training_helpers import read_metrics

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run-d72e769"


@pytest.fixture
def old_run(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "run"))


def test_it_samples_and_exports_its_last_checkpoint_saying_why(old_run, tmp_path, capsys):
    assert main(["sample", str(old_run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    said = capsys.readouterr().err
    assert "checkpoint of step 6, the last: the run records no best" in said
    assert load_run(old_run).step == 6 and load_run(old_run, step=4).step == 4
    for out in ("model.gguf", "folder"):
        assert main(["export", str(old_run), str(tmp_path / out)]) == 0, capsys.readouterr().err
        said = capsys.readouterr().out
        assert "checkpoint of step 6, the last: the run records no best" in said


def test_it_resumes_and_then_names_its_best(old_run, capsys):
    resumed = main(["train", "--out", str(old_run), "--resume", "--steps", "9"])
    assert resumed == 0, capsys.readouterr().err
    evaluations = read_metrics(old_run, "eval")
    assert [r["step"] for r in evaluations] == [3, 6, 9]
    assert "best_step" not in evaluations[1] and evaluations[2]["best_step"] == 9
    assert [checkpoint.step_of(p) for p in checkpoint.listed(old_run)] == [8, 9]
    assert load_run(old_run).step == 9
