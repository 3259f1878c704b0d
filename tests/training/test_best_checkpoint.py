"""The best checkpoint: every evaluation names the lowest validation loss so far, its checkpoint
is kept whatever ``--keep`` says (written if its step had none), through a signal and a resume;
``octlm sample``, ``octlm export`` and ``load_run`` take it by default and say so; validation
that has risen is said once per best, in ``octlm train`` and ``octlm report``, and
``--early-stop`` ends the run there.

The runs learn at a rate (0.3, hardly decaying) that makes validation rise and fall again
within 40 steps of a model of a few thousand parameters, each in about two seconds. The
uninterrupted run is trained once per session and only read by the tests that share it.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from octlm import load_run
from octlm.cli import main
from octlm.training import checkpoint, loop, train
from octlm.training.metrics import best_of, risen
from tests.helpers import once_per_session
from tests.training_helpers import configs, losses, read_metrics, tiny_flags, write_corpus

RISING = dict(steps=40, eval_every=2, checkpoint_every=5, keep=1, lr=0.3, warmup=0)
RISING |= dict(min_lr_ratio=0.9)


def rising_flags(corpus, folder, steps=40) -> list[str]:
    flags = tiny_flags(corpus, folder, steps)
    flags[flags.index("--eval-every") + 1] = "2"
    flags[flags.index("--checkpoint-every") + 1] = "5"
    return [*flags, "--keep", "1", "--lr", "0.3", "--warmup", "0", "--min-lr-ratio", "0.9"]


def kept_steps(folder) -> list[int]:
    return [checkpoint.step_of(path) for path in checkpoint.listed(folder)]


@pytest.fixture(scope="module")
def rising(tmp_path_factory):
    """The folder holding ``corpus``, the uninterrupted ``run`` of :data:`RISING` on it, and
    ``outcome.json``, what its ``train`` returned. Tests only read it."""

    def build(folder):
        outcome = train(*configs(write_corpus(folder / "corpus"), **RISING), folder / "run",
                        progress=False)  # fmt: skip
        returned = {"step": outcome.step, "best_step": outcome.best_step}
        (folder / "outcome.json").write_text(json.dumps(returned))

    return once_per_session(tmp_path_factory, "rising-run", build)


def test_every_evaluation_names_the_best_so_far_and_its_checkpoint_stays(rising):
    folder = rising / "run"
    evaluations = read_metrics(folder, "eval")
    for index, record in enumerate(evaluations):
        assert record["best_step"] == best_of(evaluations[: index + 1])["step"]
    best = evaluations[-1]["best_step"]
    assert best != 40 and best % 5 != 0  # the case: a best between checkpoints, not the last
    assert json.loads((rising / "outcome.json").read_text())["best_step"] == best
    assert kept_steps(folder) == [best, 40]  # --keep 1 and the best
    model, _tokenizer, step = load_run(folder)
    assert step == best
    stored = checkpoint.load(checkpoint.path_for(folder, best), model.config)["model"]
    weights = {name: value for name, value in stored.items() if isinstance(value, torch.Tensor)}
    assert all(torch.equal(model.state_dict()[name], value) for name, value in weights.items())
    assert load_run(folder, step="last").step == 40


def test_the_best_survives_a_signal_and_a_resume(rising, tmp_path, monkeypatch):
    model_config, run = configs(rising / "corpus", **RISING)
    whole = rising / "run"
    step = loop.Training.step

    def stopped_at_23(state, batch):
        result = step(state, batch)
        if state.scheduler.last_epoch == 23:  # the loop sees it after this step
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(loop.Training, "step", stopped_at_23)
    cut = train(model_config, run, tmp_path / "cut", progress=False)
    monkeypatch.setattr(loop.Training, "step", step)
    assert cut.stopped_by == "SIGINT" and cut.step == 23
    best_then = read_metrics(tmp_path / "cut", "eval")[-1]["best_step"]
    assert kept_steps(tmp_path / "cut") == sorted({best_then, 23})
    train(model_config, run, tmp_path / "cut", resume=True, progress=False)
    assert losses(tmp_path / "cut") == losses(whole)

    def evaluations(folder):
        return [(r["step"], r["val_loss"], r["best_step"]) for r in read_metrics(folder, "eval")]

    assert evaluations(tmp_path / "cut") == evaluations(whole)
    assert kept_steps(tmp_path / "cut") == kept_steps(whole)


def test_early_stop_ends_the_run_where_validation_has_risen(corpus, tmp_path, capsys):
    folder = tmp_path / "run"
    assert main([*rising_flags(corpus, folder), "--early-stop", "2"]) == 0
    said = "".join(capsys.readouterr())
    evaluations = read_metrics(folder, "eval")
    last = evaluations[-1]["step"]
    best = risen(evaluations, 2)
    assert best is not None and last < 40  # it ended early, at the first rise
    assert risen(evaluations[:-1], 2) is None
    assert f"validation has risen for 2 evaluations since step {best['step']}" in said
    assert "the run ends here (--early-stop 2)" in said
    assert max(losses(folder)) == last
    assert kept_steps(folder) == [best["step"], last]  # the best and the run's end


def test_a_rise_is_said_once_per_best_in_the_run_and_in_its_report(corpus, tmp_path, capsys):
    folder = tmp_path / "run"
    assert main(rising_flags(corpus, folder)) == 0
    output = "".join(capsys.readouterr())
    evaluations = read_metrics(folder, "eval")
    bests = {
        risen(evaluations[:count], 3)["step"]
        for count in range(1, len(evaluations) + 1)
        if risen(evaluations[:count], 3) is not None
    }
    assert bests  # the case: validation rose at least once
    assert output.count("validation has risen for 3 evaluations since step") == len(bests)
    assert "or --early-stop 3" in output
    report = tmp_path / "report" / "report.md"
    assert main(["report", str(folder), "--output", str(report)]) == 0, capsys.readouterr().err
    text = report.read_text()
    if risen(evaluations, 3) is not None:  # the rise holds at the run's end
        assert f"since step {risen(evaluations, 3)['step']}" in text
    else:
        assert "Validation has risen" not in text


def test_sample_and_export_take_the_best_and_say_which(rising, tmp_path, capsys):
    folder = str(rising / "run")
    best = read_metrics(rising / "run", "eval")[-1]["best_step"]
    assert main(["sample", folder, "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    said = capsys.readouterr().err
    assert f"checkpoint of step {best}, the best (lowest validation loss)" in said
    last = ["sample", folder, "--prompt", "def ", "--max-new-tokens", "4", "--step", "last"]
    assert main(last) == 0
    assert "checkpoint of step 40, the last" in capsys.readouterr().err
    assert main(["export", folder, str(tmp_path / "model.gguf")]) == 0
    said = capsys.readouterr().out
    assert f"checkpoint of step {best}, the best (lowest validation loss)" in said
    assert main(["export", folder, str(tmp_path / "other.gguf"), "--step", "first"]) == 2
    assert f"step must be 'best', 'last' or one of the run's checkpoints [{best}, 40]" in (
        capsys.readouterr().err
    )
