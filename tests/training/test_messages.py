"""What a user of octlm train and octlm sample reads: errors in the flags they typed, one line
for a command-line mistake, progress while the data is prepared, which step a validation
figure is from, and a run folder left with no temporary file of a killed write."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import fields
from functools import partialmethod
from pathlib import Path

import pytest
import torch

import octlm
from octlm.cli import build_parser, main
from octlm.model import ModelConfig, OctLM
from octlm.progress import Progress
from octlm.training import checkpoint, loop, train
from tests.training_helpers import configs, read_metrics, tiny_flags

pytestmark = pytest.mark.usefixtures("one_thread")


# A child that trains and is SIGKILLed halfway through writing the checkpoint of step 3.
KILLED_MID_WRITE = """
import os, signal, sys, torch
from octlm.training import resolve, train
from tests.training_helpers import TINY_MODEL, TINY_RUN
save = torch.save
def dying(contents, out, *args, **kwargs):
    if isinstance(contents, dict) and contents.get("step") == 3:
        out.write(b"half a checkpoint")
        out.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return save(contents, out, *args, **kwargs)
torch.save = dying
run = {**TINY_RUN, "data": sys.argv[1], "steps": 4, "checkpoint_every": 1}
train(*resolve(model=TINY_MODEL, run=run), sys.argv[2], progress=False)
"""


def test_resume_removes_the_temporary_file_of_a_killed_checkpoint_write(corpus, tmp_path):
    folder = tmp_path / "run"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, str(corpus), str(folder)],
        capture_output=True,
        cwd=Path(__file__).parents[2],
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    left = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and checkpoint.is_own(left[0])  # .checkpoint-0000003.pt.<hex>.tmp
    assert checkpoint.latest(folder) == checkpoint.path_for(folder, 2)
    train(*configs(corpus, steps=4), folder, resume=True, progress=False)
    assert not list(folder.glob("*.tmp")) and not list(folder.glob(".*.tmp"))
    assert checkpoint.latest(folder) == checkpoint.path_for(folder, 4)


def test_errors_name_the_flag_typed(corpus, tmp_path, capsys):
    assert main([*tiny_flags(corpus, tmp_path / "a", steps=3), "--steps", "-5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "octlm train: --steps must be a positive integer, got -5"
    )
    assert main([*tiny_flags(corpus, tmp_path / "b", steps=3), "--time-budget", "-5m"]) == 2
    err = capsys.readouterr().err
    assert "--time-budget must be a positive duration" in err and "'-5m'" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_command_line_mistake_is_one_line_pointing_to_help(capsys):
    for argv, prog in (
        (["train", "--steps", "x"], "octlm train"),
        (["train", "--stepz", "3"], "octlm train"),
        (["bogus"], "octlm"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "usage:" not in err
        assert err.startswith(f"{prog}: ") and f"{prog} --help" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"octlm {octlm.__version__}"


def test_every_model_flag_has_help_and_max_length_says_its_default():
    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]
    helps = {a.dest[6:]: a.help for a in train_parser._actions if a.dest.startswith("model.")}
    assert set(helps) == {f.name for f in fields(ModelConfig)}
    assert all(helps.values())
    assert "--length" in helps["max_length"] and "refused" in helps["max_length"]
    model = OctLM(ModelConfig(width=16, n_layers=1, n_heads=2, max_length=8))
    with pytest.raises(ValueError, match="max_length"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_a_bare_time_budget_is_said_to_be_seconds(corpus, tmp_path, capsys):
    flags = [*tiny_flags(corpus, tmp_path / "run", steps=3), "--time-budget", "600"]
    flags.append("--no-compile")  # a budget this long would compile the steps
    assert main(flags) == 0
    assert "time budget 600 seconds" in capsys.readouterr().out
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "bare number is seconds" in re.sub(r"\s+", " ", help_text)


def test_sample_says_what_a_folder_is_when_it_is_no_run(tmp_path, capsys):
    transformers = tmp_path / "llama"
    transformers.mkdir()
    (transformers / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["sample", str(transformers), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "is a transformers folder" in err and "OctLM.from_pretrained" in err
    assert "--init-from" in err
    assert main(["sample", str(tmp_path / "missing"), "--prompt", "a"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_preparing_the_data_shows_progress(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Progress, "__init__", partialmethod(Progress.__init__, every=0.0))
    model_config, run = configs(corpus, steps=1, tokenizer="bpe")
    model_config = type(model_config)(**{**model_config.__dict__, "vocab_size": 300})
    train(model_config, run, tmp_path / "run", progress=True)
    err = capsys.readouterr().err
    assert "training a byte-level BPE of 300 tokens" in err
    assert f"tokenising {corpus}" in err
    train(*configs(corpus, steps=1), tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""


def test_a_run_ending_a_step_after_an_evaluation_prints_one(corpus, tmp_path, capsys):
    outcome = train(*configs(corpus, steps=4, eval_every=3), tmp_path / "run", progress=True)
    assert [r["step"] for r in read_metrics(tmp_path / "run", "eval")] == [3]
    assert (outcome.step, outcome.val_step) == (4, 3)
    printed = capsys.readouterr()
    shown = printed.out + printed.err
    assert shown.count("val loss") == 1 and "step 3: val loss" in shown
    assert "nats per token" in shown


def test_after_a_signal_the_closing_line_names_the_evaluated_step(
    corpus, tmp_path, capsys, monkeypatch
):
    step = loop.Training.step
    calls = []

    def signalled_step(*args):
        calls.append(1)
        if len(calls) == 3:  # after the evaluation of step 2
            os.kill(os.getpid(), signal.SIGINT)
        return step(*args)

    monkeypatch.setattr(loop.Training, "step", signalled_step)
    flags = [*tiny_flags(corpus, tmp_path / "run", steps=10), "--eval-every", "2"]
    assert main(flags) == 128 + signal.SIGINT
    out = capsys.readouterr().out
    assert re.search(r"validation at step 2: val loss [\d.]+ nats per token", out)
    assert "(step 3)" in out


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "--data '{data}' does not exist: expected a corpus file or a folder of them"),
        ("empty", "--data '{data}' is empty"),
        ("all-held-out", "the training split is empty (its only non-empty file is held out"),
    ],
)
def test_a_data_problem_under_bpe_is_named_as_it_is(tmp_path, capsys, case, message):
    data = tmp_path / ("nothing" if case == "missing" else "corpus")
    if case == "empty":
        data.write_text("")
    elif case == "all-held-out":
        data.mkdir()
        (data / "a.txt").write_text("some text " * 20)
    flags = [*tiny_flags(data, tmp_path / "run", steps=1), "--tokenizer", "bpe"]
    if case == "all-held-out":
        flags += ["--val-share", "0.999999"]
    assert main([*flags, "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.format(data=data) in err and "which learns nothing" not in err
