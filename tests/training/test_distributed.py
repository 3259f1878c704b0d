"""octlm train on 2 gloo processes equals one process: DDP, FSDP2 and context parallelism.

One spawn of two ranks runs every mode in turn on the same tiny run (the spawn costs seconds,
each run well under one); the test process runs the single-process references and compares
the loss curves of ``metrics.jsonl``. Every mode's checkpoint must then load in one process.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from octlm import load_run
from octlm.training import resolve, train
from tests.helpers import once_per_session, trained_on_ranks
from tests.training_helpers import TINY_MODEL, TINY_RUN, losses, write_corpus

pytestmark = pytest.mark.distributed

WORLD = 2
SPAWN_TIMEOUT = 240.0
# mode: (run options on 2 ranks, model options of the 1-process reference)
MODES = {
    "ddp": ({}, {}),
    "ddp-accumulate": ({"accumulate": 2}, {}),
    "fsdp": ({"fsdp": True}, {}),
    "context": ({"context_parallel": True}, {"attention": "tiled"}),
}
RELATIVE = 1e-5  # float32 rounding over a few steps: summation order differs between ranks


def _run_options(corpus: Path, mode_options: dict) -> dict:
    return {**TINY_RUN, "data": str(corpus), "steps": 4, "eval_every": 4, **mode_options}


def mode_configs(corpus: Path) -> dict:
    """Each mode's model and run configs, as :func:`tests.helpers.trained_on_ranks` takes them."""
    return {
        mode: functools.partial(resolve, model=TINY_MODEL, run=_run_options(corpus, options))
        for mode, (options, _reference) in MODES.items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A folder with one run folder per mode, trained by 2 gloo ranks."""

    def run(folder: Path) -> None:
        trained_on_ranks(folder, write_corpus(folder / "corpus"), __name__, WORLD, SPAWN_TIMEOUT)

    return once_per_session(tmp_path_factory, "two-ranks", run)


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_give_the_single_process_loss_curve(runs, tmp_path, mode):
    options, reference_model = MODES[mode]
    single_options = {k: v for k, v in options.items() if k not in ("fsdp", "context_parallel")}
    model_config, run = resolve(
        model={**TINY_MODEL, **reference_model}, run=_run_options(runs / "corpus", single_options)
    )
    train(model_config, run, tmp_path / "single", progress=False)
    single, ranks = losses(tmp_path / "single"), losses(runs / mode)
    assert sorted(ranks) == sorted(single) == [1, 2, 3, 4]
    differences = {s: abs(ranks[s] - single[s]) / single[s] for s in single}
    assert all(d <= RELATIVE for d in differences.values()), differences
    assert not math.isclose(single[1], single[4], rel_tol=1e-3)  # the curve moved


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_of_every_mode_loads_in_one_process(runs, mode):
    model, _tokenizer, step = load_run(runs / mode)
    assert step == 4
    assert model.config.attention != "ring"  # ring attention's one-process twin
    logits = model(torch.zeros(1, 8, dtype=torch.int64))  # (1, 8, V)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_resumes_in_one_process(runs, tmp_path, mode):
    """A run of any mode goes on in one process: ``--no-fsdp`` or ``--no-context-parallel``
    (with another attention, since ring attention needs the ranks), for two more steps."""
    folder = tmp_path / mode
    shutil.copytree(runs / mode, folder)
    options, reference_model = MODES[mode]
    switched = {name: False for name in ("fsdp", "context_parallel") if name in options}
    model_config, run = resolve(model=reference_model, run={"steps": 6, **switched}, resume=folder)
    outcome = train(model_config, run, folder, resume=True, progress=False)
    assert outcome.step == 6
    stored = json.loads((folder / "config.json").read_text())
    assert stored["run"]["steps"] == 6  # the next --resume goes on from here
    assert all(stored["run"][name] is False for name in switched)
    assert sorted(losses(folder)) == [1, 2, 3, 4, 5, 6]
