"""Resuming a run and its checkpoints: exact losses, what may change, and damage refused with every
checkpoint left as it was.

Runs use a model of a few thousand parameters on a few kilobytes of generated text
(tests/training_helpers.py), so each takes about a second.
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import replace

import pytest
import torch

from octlm import load_run
from octlm.training import checkpoint, config, loop, train
from octlm.training.config import resolve
from octlm.training.metrics import METRICS
from octlm.training.optim import lr_factor
from tests.training_helpers import (
    configs,
    file_hashes,
    flip_a_weight_bit,
    losses,
    read_metrics,
    write_short_documents,
)


@pytest.mark.parametrize(("pack", "compile"), [(False, "off"), (True, "off"), (False, "on")])
def test_resumed_run_repeats_the_uninterrupted_losses_exactly(corpus, tmp_path, pack, compile):
    corpus = write_short_documents(tmp_path / "short") if pack else corpus
    model_config, run = configs(corpus, pack=pack, compile=compile)
    model_config = replace(model_config, dropout=0.1)  # dropout's RNG must resume too
    train(model_config, run, tmp_path / "whole", progress=False)
    train(model_config, run, tmp_path / "cut", progress=False)
    cut = tmp_path / "cut"
    for later in checkpoint.listed(cut):  # as if stopped right after step 4
        if checkpoint.step_of(later) > 4:
            later.unlink()
    if not pack:  # a run older than --pack has no such field: it resumes as unpacked
        stored = json.loads((cut / "config.json").read_text())
        del stored["run"]["pack"]
        (cut / "config.json").write_text(json.dumps(stored))
    outcome = train(model_config, run, cut, resume=True, progress=False)
    assert outcome.step == 6
    assert losses(cut) == losses(tmp_path / "whole")  # exact, float for float

    def evaluations(folder):
        return [(r["step"], r["val_loss"], r["sample"]) for r in read_metrics(folder, "eval")]

    assert evaluations(cut) == evaluations(tmp_path / "whole")


@pytest.mark.parametrize(
    "damage",
    ["truncated tokens", "no tokens", "no summary", "torn summary", "summary of nothing",
     "offsets swapped", "offsets past the end"],
)  # fmt: skip
def test_damaged_token_files_are_refused_on_resume(corpus, tmp_path, damage):
    model_config, run = configs(corpus, steps=2, pack=True)
    train(model_config, run, tmp_path / "run", progress=False)
    tokens = tmp_path / "run" / "data"
    if damage == "truncated tokens":
        content = (tokens / "train.bin").read_bytes()
        (tokens / "train.bin").write_bytes(content[: len(content) // 2])
        message = "train.bin' holds .* bytes where data.json says"
    elif damage == "no tokens":
        (tokens / "train.bin").unlink()
        message = "train.bin' is missing"
    elif damage == "no summary":
        (tokens / "data.json").unlink()
        message = "data.json' is missing"
    elif damage == "torn summary":
        (tokens / "data.json").write_text('{"train_bytes": 1')
        message = "data.json' is damaged"
    elif damage == "summary of nothing":
        (tokens / "data.json").write_text("{}")
        message = "data.json' is damaged"
    elif damage == "offsets swapped":
        offsets = array("q")
        offsets.frombytes((tokens / "train.starts.bin").read_bytes())
        offsets[1], offsets[2] = offsets[2], offsets[1]
        (tokens / "train.starts.bin").write_bytes(offsets.tobytes())
        message = "offsets must rise from 0 inside the train tokens"
    else:  # the same size, other offsets: one past the tokens
        starts = torch.frombuffer(
            bytearray((tokens / "train.starts.bin").read_bytes()), dtype=torch.int64
        )
        starts[-1] = 10**12
        (tokens / "train.starts.bin").write_bytes(starts.numpy().tobytes())
        message = "offsets must rise from 0 inside the train tokens"
    with pytest.raises(ValueError, match=message):
        train(model_config, replace(run, steps=4), tmp_path / "run", resume=True, progress=False)


@pytest.mark.filterwarnings("error::octlm.records.RecordsWarning")  # the plot reads them too
def test_resuming_a_diverged_run_keeps_its_non_finite_records(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    with (tmp_path / "run" / METRICS).open("a") as records:
        for step in (2, 3):  # as a diverged run writes them: NaN, after the checkpoint's step
            records.write(json.dumps({"kind": "train_step", "step": step, "loss": math.nan}))
            records.write("\n")
    train(model_config, replace(run, steps=3), tmp_path / "run", resume=True, progress=False)
    steps = [r["step"] for r in read_metrics(tmp_path / "run", "train_step")]
    assert steps == [1, 2, 2, 3]  # the NaN record of step 2 stays; step 3 is written again
    assert math.isnan(read_metrics(tmp_path / "run", "train_step")[2]["loss"])


def test_a_run_resumed_for_more_steps_takes_the_longer_run_s_rates_from_there(corpus, tmp_path):
    """The schedule is a function of the step and the run's length (docs/design.md): after the
    resumed step the rates are the longer straight run's, before it the shorter run's."""
    model_config, run = configs(corpus, steps=6, warmup=2)
    train(model_config, replace(run, steps=12), tmp_path / "straight", progress=False)
    train(model_config, run, tmp_path / "extended", progress=False)
    train(model_config, replace(run, steps=12), tmp_path / "extended", resume=True, progress=False)

    def rates(folder):
        return {r["step"]: r["lr"] for r in read_metrics(folder, "train_step")}

    straight, extended = rates(tmp_path / "straight"), rates(tmp_path / "extended")
    assert [extended[step] for step in range(7, 13)] == [straight[step] for step in range(7, 13)]
    assert extended[6] < straight[6]  # the shorter run had decayed further by then
    assert losses(tmp_path / "extended")[12] != losses(tmp_path / "straight")[12]


def test_a_run_resumed_for_more_steps_follows_the_new_schedule_at_once(corpus, tmp_path):
    model_config, run = configs(corpus, steps=6, warmup=2)
    train(model_config, run, tmp_path / "run", progress=False)
    train(model_config, replace(run, steps=12), tmp_path / "run", resume=True, progress=False)
    rates = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run", "train_step")}
    for step in range(7, 13):  # step k runs with the factor of k - 1 steps done
        expected = run.lr * lr_factor(step - 1, warmup=2, steps=12, min_ratio=run.min_lr_ratio)
        assert rates[step] == pytest.approx(expected, rel=1e-6), step


def test_resume_with_another_configuration_raises_and_keeps_checkpoints(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    before = file_hashes(tmp_path / "run")
    with pytest.raises(ValueError, match=r"model\.width: 16 in the run, 32 now"):
        train(replace(model_config, width=32), run, tmp_path / "run", resume=True, progress=False)
    with pytest.raises(ValueError, match=r"run\.batch: 4 in the run, 8 now"):
        train(model_config, replace(run, batch=8), tmp_path / "run", resume=True, progress=False)
    assert file_hashes(tmp_path / "run") == before


def test_resume_keeps_its_new_steps_and_refuses_to_do_nothing(corpus, tmp_path):
    """A run resumed with more steps writes them to config.json, so a plain --resume after an
    interruption goes on to them; --steps at or below the run's step is refused."""
    model_config, run = configs(corpus, steps=2)
    folder = tmp_path / "run"
    train(model_config, run, folder, progress=False)
    with pytest.raises(ValueError, match="at step 2 already and --steps is 2"):
        train(model_config, run, folder, resume=True, progress=False)
    train(model_config, replace(run, steps=4), folder, resume=True, progress=False)
    assert json.loads((folder / config.CONFIG_FILE).read_text())["run"]["steps"] == 4
    model_config, run = resolve(resume=folder)
    assert run.steps == 4


def test_an_evaluation_that_fails_loses_no_step(corpus, tmp_path, monkeypatch):
    """The step's checkpoint is written before its evaluation, so the run resumes after it."""
    model_config, run = configs(corpus, steps=4, eval_every=2, checkpoint_every=2)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop.Training, "evaluate", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        train(model_config, run, tmp_path / "run", progress=False)
    assert [p.name for p in checkpoint.listed(tmp_path / "run")] == ["checkpoint-0000002.pt"]


def test_a_resume_that_fails_in_its_first_step_keeps_the_runs_config(corpus, tmp_path, monkeypatch):
    """config.json takes a resume's new flags only once its first step has worked, so a plain
    --resume after the failure is the run as it was."""
    model_config, run = configs(corpus, steps=2)
    folder = tmp_path / "run"
    train(model_config, run, folder, progress=False)
    before = (folder / config.CONFIG_FILE).read_text()

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop.Training, "step", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        train(model_config, replace(run, steps=5), folder, resume=True, progress=False)
    assert (folder / config.CONFIG_FILE).read_text() == before
    monkeypatch.undo()
    train(model_config, replace(run, steps=5), folder, resume=True, progress=False)
    assert json.loads((folder / config.CONFIG_FILE).read_text())["run"]["steps"] == 5


def test_checkpoints_load_under_another_attention(corpus, tmp_path):
    """Attention, tiles and kernel say how attention is computed, not what the model is: a run
    resumes, and its checkpoints load, under any of them; the width still may not change."""
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    other = replace(model_config, attention="tiled", block=(8, 4), kernel="pytorch")
    checkpoint.load(checkpoint.latest(tmp_path / "run"), other)
    outcome = train(other, replace(run, steps=3), tmp_path / "run", resume=True, progress=False)
    assert outcome.step == 3
    with pytest.raises(ValueError, match="n_layers 1 \\(expected 2\\)"):
        checkpoint.load(checkpoint.latest(tmp_path / "run"), replace(other, n_layers=2))


def test_checkpoint_of_another_model_raises(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="written for another model: n_layers 1 \\(expected 2\\)"):
        checkpoint.load(checkpoint.latest(tmp_path / "run"), replace(model_config, n_layers=2))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", "corrupted or not an octlm checkpoint"),
        ("garbage", "corrupted or not an octlm checkpoint"),
        ("flipped bit", "corrupted: its checksum does not match"),
    ],
)
def test_corrupted_checkpoint_raises_and_is_left_alone(corpus, tmp_path, damage, message):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    latest = checkpoint.latest(tmp_path / "run")
    content = latest.read_bytes()
    damaged = {
        "truncated": lambda: content[: len(content) // 2],
        "garbage": lambda: b"\x00" * 64,
        "flipped bit": lambda: flip_a_weight_bit(latest),
    }[damage]()
    latest.write_bytes(damaged)
    before = file_hashes(tmp_path / "run")
    with pytest.raises(ValueError, match=message):
        train(model_config, replace(run, steps=4), tmp_path / "run", resume=True, progress=False)
    with pytest.raises(ValueError, match="corrupted"):
        load_run(tmp_path / "run")
    assert file_hashes(tmp_path / "run") == before
