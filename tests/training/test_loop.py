"""The training loop: its records, picture and checkpoints, the loss it reaches, accumulation,
recomputed activations and mixed precision, each equal to the plain run where it should be.

Runs use a model of a few thousand parameters on a few kilobytes of generated text
(tests/training_helpers.py), so each takes about a second.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from octlm import load_run
from octlm.training import checkpoint, train
from octlm.training.config import resolve
from octlm.training.metrics import PICTURE
from tests.training_helpers import configs, losses, read_metrics, write_short_documents


def test_run_writes_records_picture_and_checkpoints(corpus, tmp_path):
    model_config, run = configs(corpus, keep=2)
    outcome = train(model_config, run, tmp_path / "run", progress=False)
    folder = tmp_path / "run"
    steps = read_metrics(folder, "train_step")
    assert [r["step"] for r in steps] == list(range(1, 7))
    for record in steps:
        assert record["loss"] > 0 and record["grad_norm"] > 0
        assert record["tokens_per_second"] > 0 and record["peak_bytes"] > 0
        assert record["memory_metric"] == "ru_maxrss" and record["experiment"] == "train"
    assert all(record["lr"] > 0 for record in steps[:-1])
    assert steps[-1]["lr"] == pytest.approx(run.lr * run.min_lr_ratio)  # the schedule's floor
    evals = read_metrics(folder, "eval")
    assert [r["step"] for r in evals] == [3, 6]
    for record in evals:
        assert record["val_bits_per_byte"] == pytest.approx(record["val_loss"] / math.log(2))
        assert record["sample"].startswith(run.prompt or "")  # held-out text's start without one
    assert outcome.val_loss == evals[-1]["val_loss"] and outcome.stopped_by is None
    assert len({record["run"] for record in steps + evals}) == 1  # the launch's run id
    assert isinstance(steps[0]["run"], str)
    best = evals[-1]["best_step"]  # its checkpoint is kept besides the last two
    assert [p.name for p in checkpoint.listed(folder)] == sorted(
        {"checkpoint-0000004.pt", "checkpoint-0000006.pt", f"checkpoint-{best:07d}.pt"}
    )
    assert (folder / PICTURE).stat().st_size > 0
    chosen = replace(run, compile="off")  # --compile auto is stored as chosen: a short run
    assert resolve(file=folder / "config.json") == (model_config, chosen)


def test_loss_falls(corpus, tmp_path):
    model_config, run = configs(corpus, steps=30, eval_every=30, checkpoint_every=30)
    outcome = train(model_config, run, tmp_path / "run", progress=False)
    curve = losses(tmp_path / "run")
    assert curve[30] < curve[1] - 1.0
    assert outcome.val_loss < math.log(256) - 1.0  # far below a uniform guess over bytes


@pytest.mark.parametrize("pack", [False, True])
def test_accumulation_equals_the_whole_batch(corpus, tmp_path, pack):
    corpus = write_short_documents(tmp_path / "short") if pack else corpus
    model_config, run = configs(corpus, pack=pack)  # rows count unequal numbers of targets
    train(model_config, run, tmp_path / "whole", progress=False)
    train(model_config, replace(run, accumulate=2), tmp_path / "halves", progress=False)
    whole, halves = losses(tmp_path / "whole"), losses(tmp_path / "halves")
    assert all(math.isclose(whole[s], halves[s], rel_tol=1e-5) for s in whole)


def test_activation_checkpointing_keeps_the_losses(corpus, tmp_path):
    model_config, run = configs(corpus)
    train(model_config, run, tmp_path / "plain", progress=False)
    train(model_config, replace(run, checkpoint_activations=True), tmp_path / "re", progress=False)
    plain, recomputed = losses(tmp_path / "plain"), losses(tmp_path / "re")
    assert all(math.isclose(plain[s], recomputed[s], rel_tol=1e-6) for s in plain)


def test_bfloat16_autocast_trains_close_to_float32(corpus, tmp_path):
    model_config, run = configs(corpus)
    train(model_config, run, tmp_path / "fp32", progress=False)
    train(model_config, replace(run, dtype="bfloat16"), tmp_path / "bf16", progress=False)
    fp32, bf16 = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    assert all(abs(fp32[s] - bf16[s]) < 0.05 * fp32[s] for s in fp32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_mixed_precision_trains_and_records_allocator_peak(corpus, tmp_path, dtype):
    model_config, run = configs(corpus, device="cuda", dtype=dtype, steps=12, eval_every=12)
    outcome = train(model_config, run, tmp_path / "run", progress=False)
    curve = losses(tmp_path / "run")
    assert curve[12] < curve[1] and math.isfinite(outcome.val_loss)
    assert read_metrics(tmp_path / "run", "train_step")[-1]["memory_metric"] == "cuda_max_allocated"
    model, _tokenizer, _step = load_run(tmp_path / "run", "cuda")
    assert next(model.parameters()).is_cuda
