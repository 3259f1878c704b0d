"""``octlm train --time-budget``: the run ends once its training time is spent, with an
evaluation and a checkpoint, its learning rate follows time rather than steps, and a resumed
run carries its time and its schedule on.

No test waits: the loop's clock is a fake one that each optimizer step moves on by a fixed
number of seconds (the step itself is real).
"""

from __future__ import annotations

import itertools
import json
import math
from functools import partialmethod
from pathlib import Path

import pytest
import torch

from octlm.cli import main
from octlm.progress import Progress
from octlm.training import checkpoint, loop, train
from octlm.training.budget import parse_duration
from octlm.training.config import resolve
from octlm.training.metrics import METRICS

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = dict(width=16, n_layers=1, n_heads=2, n_kv_heads=1)
RUN = dict(
    batch=4, length=16, eval_every=1000, eval_batches=2, checkpoint_every=1000, keep=10,
    log_every=1, sample_tokens=4, warmup=0, lr=1e-2, min_lr_ratio=0.1, tokenizer="bytes",
    optimizer="adamw",
)  # fmt: skip


class Clock:
    """Seconds that move only when a step runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def corpus(tmp_path) -> Path:
    generator = torch.Generator().manual_seed(0)
    words = [b"def ", b"return ", b"self", b"(x)", b": ", b"\n    ", b"0", b"1"]
    for index in range(10):
        picks = torch.randint(len(words), (300,), generator=generator).tolist()
        path = tmp_path / "corpus" / f"doc{index}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(words[i] for i in picks))
    return tmp_path / "corpus"


@pytest.fixture
def step_seconds(monkeypatch):
    """``step_seconds(s)``: from then on each optimizer step takes ``s`` seconds of a fresh
    fake clock, which it returns."""

    real = loop.Training.step

    def slow(seconds: float) -> Clock:
        clock = Clock()

        def step(*args):
            clock.now += seconds
            return real(*args)

        monkeypatch.setattr(loop.Training, "step", step)
        return clock

    return slow


def run_budget(corpus: Path, out: Path, clock: Clock, resume: bool = False, **run):
    model_config, run_config = resolve(
        model=None if resume else MODEL,
        run=run if resume else {**RUN, "data": str(corpus), **run},
        resume=out if resume else None,
    )
    return train(model_config, run_config, out, resume=resume, progress=False, clock=clock)


def records(folder: Path, kind: str) -> list[dict]:
    lines = (folder / METRICS).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def rates(folder: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in records(folder, "train_step")}


def test_the_run_ends_at_its_budget_with_an_evaluation_and_a_checkpoint(
    corpus, tmp_path, step_seconds
):
    clock = step_seconds(7.0)
    outcome = run_budget(corpus, tmp_path / "run", clock, time_budget="60s")
    last = math.ceil(60 / 7)  # the first step whose end is past 60 s
    assert (outcome.step, outcome.stopped_by) == (last, None)
    assert outcome.val_bits_per_byte is not None
    evaluations = records(tmp_path / "run", "eval")
    assert [r["step"] for r in evaluations] == [last]
    assert evaluations[0]["train_seconds"] == 7.0 * last
    assert [checkpoint.path_for(tmp_path / "run", last)] == checkpoint.listed(tmp_path / "run")
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]


def test_the_learning_rate_follows_training_time_not_steps(corpus, tmp_path, step_seconds):
    quick = run_budget(corpus, tmp_path / "quick", step_seconds(7.0), time_budget="84s")
    slow = run_budget(corpus, tmp_path / "slow", step_seconds(14.0), time_budget="84s")
    assert (quick.step, slow.step) == (12, 6)
    fast_rates, slow_rates = rates(tmp_path / "quick"), rates(tmp_path / "slow")
    # A step's rate is set when the step before it ends: step n runs at 7 (n - 1) s, or 14.
    for seconds in (14, 28, 42, 70):
        assert fast_rates[seconds // 7 + 1] == slow_rates[seconds // 14 + 1], seconds
    assert fast_rates[3] != slow_rates[3]
    # Half the budget is half-way down the cosine, from lr to lr * min_lr_ratio.
    assert fast_rates[42 // 7 + 1] == pytest.approx((1e-2 + 1e-3) / 2)
    ordered = [fast_rates[step] for step in sorted(fast_rates)]
    assert all(later < earlier for earlier, later in itertools.pairwise(ordered))


@pytest.mark.parametrize("budget, steps", [("84s", 5), ("35s", 100)], ids=["steps", "time"])
def test_with_steps_too_the_run_ends_at_whichever_comes_first(
    corpus, tmp_path, step_seconds, budget, steps
):
    """And its rate has come down its whole schedule by then."""
    outcome = run_budget(
        corpus, tmp_path / "run", step_seconds(7.0), time_budget=budget, steps=steps
    )
    assert outcome.step == 5 and outcome.stopped_by is None
    assert [r["step"] for r in records(tmp_path / "run", "eval")] == [5]
    if steps == 5:  # the last step runs at the bottom of the schedule
        assert rates(tmp_path / "run")[5] == pytest.approx(1e-3)


def test_a_resumed_run_carries_its_time_and_its_schedule_on(corpus, tmp_path, step_seconds):
    whole = run_budget(corpus, tmp_path / "whole", step_seconds(7.0), time_budget="63s")
    assert whole.step == 9
    first = run_budget(corpus, tmp_path / "parts", step_seconds(7.0), time_budget="35s")
    assert first.step == 5
    resumed = run_budget(
        corpus, tmp_path / "parts", step_seconds(7.0), resume=True, time_budget="63s"
    )
    assert resumed.step == 9
    steps = records(tmp_path / "parts", "train_step")
    assert [(r["step"], r["train_seconds"]) for r in steps] == [(n, 7.0 * n) for n in range(1, 10)]
    whole_rates, part_rates = rates(tmp_path / "whole"), rates(tmp_path / "parts")
    assert [part_rates[n] for n in range(6, 10)] == [whole_rates[n] for n in range(6, 10)]
    with pytest.raises(ValueError, match=r"trained for 63 s already and --time-budget is 63s"):
        run_budget(corpus, tmp_path / "parts", step_seconds(7.0), resume=True)


@pytest.mark.parametrize(
    "text, seconds",
    [("90s", 90), ("10m", 600), ("1h", 3600), ("1h30m", 5400), ("1.5h", 5400), ("45", 45)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["10 minutes", "1h30", "0s", "-5m", "", "10M"])
def test_a_bad_duration_is_one_clear_line(text, tmp_path, capsys):
    with pytest.raises(ValueError, match="time_budget must be a positive duration such as 90s"):
        resolve(run={"time_budget": text})
    assert main(["train", "--out", str(tmp_path / "run"), f"--time-budget={text}"]) == 2
    error = capsys.readouterr().err
    assert error == (
        "octlm train: --time-budget must be a positive duration such as 90s, 10m, 1h or 1h30m, "
        f"got {text!r}\n"
    )
    assert not (tmp_path / "run").exists()


def test_the_progress_bar_shows_the_budget_spent_and_the_time_left(
    corpus, tmp_path, step_seconds, capsys, monkeypatch
):
    monkeypatch.setattr(Progress, "__init__", partialmethod(Progress.__init__, every=0.0))
    clock = step_seconds(10.0)
    model_config, run = resolve(
        model=MODEL, run={**RUN, "data": str(corpus), "time_budget": "1m", "log_every": 1}
    )
    train(model_config, run, tmp_path / "run", progress=True, clock=clock)
    err = capsys.readouterr().err
    assert "budget 50%; left 30s" in err  # a line each step: stderr is no terminal here
