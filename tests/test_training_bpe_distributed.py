"""octlm train --tokenizer bpe on 2 gloo processes equals one process: DDP with packed rows,
FSDP2 and context parallelism train on the BPE tokens rank 0 writes, with the same losses and
bits per byte as one process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist

from octlm.training import resolve, train
from tests.helpers import join_gloo, spawn
from tests.test_training_bpe import MODEL, RUN, VOCAB, records, write_corpus

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


def _worker(rank: int, corpus: str, folder: str) -> None:
    join_gloo(rank, WORLD, f"{folder}/store")
    failures = {}
    for mode, (run, model) in MODES.items():
        try:
            train(*_configs(Path(corpus), run, model), Path(folder, mode), progress=False)
        except Exception as error:  # reported by the test, with the mode that failed
            failures[mode] = f"{type(error).__name__}: {error}"
    dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(failures))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("two-ranks-bpe")
    corpus = write_corpus(folder / "corpus")
    spawn(_worker, (str(corpus), str(folder)), WORLD, SPAWN_TIMEOUT, "BPE training workers")
    for rank in range(WORLD):
        failures = json.loads((folder / f"rank{rank}.json").read_text())
        assert not failures, f"rank {rank}: {failures}"
    return folder


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
