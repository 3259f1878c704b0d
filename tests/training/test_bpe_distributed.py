"""octlm train --tokenizer bpe on 2 gloo processes equals one process: DDP with packed rows,
FSDP2 and context parallelism train on the BPE tokens rank 0 writes, with the same losses and
bits per byte as one process."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

from octlm.training import resolve, train
from tests.helpers import once_per_session, trained_on_ranks
from tests.training.test_bpe import MODEL, RUN, VOCAB, records, write_corpus

pytestmark = pytest.mark.distributed

WORLD = 2
SPAWN_TIMEOUT = 240.0
# mode: (run options on 2 ranks, model options of both)
MODES = {
    "ddp-pack": ({"pack": True}, {"attention": "tiled"}),
    "fsdp": ({"fsdp": True}, {}),
    "context": ({"context_parallel": True}, {}),
}
RELATIVE = 1e-5  # float32 rounding over a few steps: summation order differs between ranks


def _configs(corpus: Path, run: dict, model: dict):
    return resolve(
        model={**MODEL, "vocab_size": VOCAB, **model},
        run={**RUN, "data": str(corpus), "length": 16, **run},
    )


def mode_configs(corpus: Path) -> dict:
    """Each mode's configs for :func:`tests.helpers.trained_on_ranks`, on BPE tokens."""
    return {mode: functools.partial(_configs, corpus, *MODES[mode]) for mode in MODES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two ranks' run folders, one per mode, from one tiny corpus."""

    def run(folder: Path) -> None:
        trained_on_ranks(folder, write_corpus(folder / "corpus"), __name__, WORLD, SPAWN_TIMEOUT)

    return once_per_session(tmp_path_factory, "two-ranks-bpe", run)


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_train_on_bpe_tokens_as_one_process(runs, tmp_path, mode):
    run, model = MODES[mode]
    single = {k: v for k, v in run.items() if k not in ("fsdp", "context_parallel")}
    model = {**model, "attention": "tiled"} if mode == "context" else model
    train(*_configs(runs / "corpus", single, model), tmp_path / "single", progress=False)
    for kind, field in (("train_step", "loss"), ("eval", "val_bits_per_byte")):
        one = {r["step"]: r[field] for r in records(tmp_path / "single", kind)}
        two = {r["step"]: r[field] for r in records(runs / mode, kind)}
        assert sorted(one) == sorted(two) and one
        assert all(math.isclose(one[s], two[s], rel_tol=RELATIVE) for s in one), (one, two)
    tokenizers = [(f / "tokenizer.json").read_text() for f in (tmp_path / "single", runs / mode)]
    assert tokenizers[0] == tokenizers[1]  # rank 0 trained the same BPE
