"""``--optimizer muon``: Muon (orthogonalising in float32) steps the blocks' matrices and AdamW
the rest, under one schedule, and a run resumes from its checkpoints exactly as an AdamW run
does."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from octlm.cli import main
from octlm.model import ModelConfig, OctLM
from octlm.training import checkpoint, optim, train
from octlm.training.config import RunConfig, resolve
from octlm.training.optim import (
    Muon,
    lr_factor,
    make_optimizer,
    make_scheduler,
    orthogonalise_all,
)
from tests.training_helpers import configs, losses, read_metrics, write_corpus

MODEL = ModelConfig(width=32, n_layers=2, n_heads=2, n_kv_heads=1, max_length=16)


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def _one_step(model: OctLM, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Each parameter's change in float64 after one optimizer step, and its gradient."""
    before = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    tokens = torch.randint(256, (16, 17), generator=torch.Generator().manual_seed(1))  # (B, T + 1)
    logits = model(tokens[:, :-1])  # (B, T, V)
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grads = {name: p.grad.double().clone() for name, p in model.named_parameters()}
    optimizer.step()
    change = {name: p.detach().double() - before[name] for name, p in model.named_parameters()}
    return change, grads


def test_muon_holds_the_block_matrices_and_adamw_the_rest():
    model = OctLM(MODEL)
    adamw, muon = make_optimizer(model, 1e-3, 0.1, optimizer="muon", muon_lr=2e-2).parts
    names = {id(p): name for name, p in model.named_parameters()}
    held = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert held == {
        name for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2
    }
    rest = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert rest == set(names.values()) - held


def _spread(change: torch.Tensor) -> float:
    singular = torch.linalg.svdvals(change)  # float64
    return float(singular.max() / singular.min())


def test_muon_orthogonalises_the_mlp_updates_and_adamw_steps_the_rest():
    """Muon's update of a matrix has singular values near one another (Newton-Schulz makes it
    nearly orthogonal; the MLP's gradients here have full rank); AdamW's first step moves each
    entry by ``lr`` against its gradient, whatever the matrix's spectrum."""
    torch.manual_seed(0)
    model = OctLM(MODEL)
    optimizer = make_optimizer(model, 1e-3, 0.0, optimizer="muon", muon_lr=2e-3)
    change, grads = _one_step(model, optimizer)
    for name, delta in change.items():
        if ".mlp." in name:
            assert _spread(delta) < 2, name
        elif not name.startswith("blocks.") or delta.dim() == 1:  # embedding and norm gains
            moved = grads[name].abs() > 1e-4  # where Adam's eps is negligible
            assert torch.allclose(delta[moved], -1e-3 * grads[name][moved].sign(), rtol=1e-3)


def test_adamw_alone_leaves_the_mlp_updates_far_from_orthogonal():
    """The contrast that makes the test above tell the optimizers apart."""
    torch.manual_seed(0)
    model = OctLM(MODEL)
    change, _ = _one_step(model, make_optimizer(model, 1e-3, 0.0, optimizer="adamw"))
    assert all(_spread(delta) > 4 for name, delta in change.items() if ".mlp." in name)


def orthogonalise(update, coefficients, steps, eps, precision):
    """One matrix alone through the iteration: the reference the batched one is held to."""
    a, b, c = coefficients
    x = (update.T if update.size(0) > update.size(1) else update).to(precision)
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if update.size(0) > update.size(1) else x).to(update.dtype)


@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 20), (20, 48), (32, 32)])
def test_orthogonalise_keeps_the_singular_vectors_and_evens_the_singular_values(shape, precision):
    """Against float64 SVD ``G = U S V^T``: the result is ``U S' V^T`` with every ``S'`` near 1,
    off the diagonal within a few roundings of the iteration's precision."""
    generator = torch.Generator().manual_seed(0)
    update = torch.randn(shape, generator=generator) * torch.logspace(0, 1, shape[1])  # (A, B)
    result = orthogonalise(update, (3.4445, -4.775, 2.0315), 5, 1e-7, precision).double()
    u, _s, vh = torch.linalg.svd(update.double(), full_matrices=False)
    spectrum = u.T @ result @ vh.T  # S', diagonal where the singular vectors are kept
    diagonal = spectrum.diagonal()
    rounding = torch.finfo(precision).eps * max(shape)
    assert (spectrum - torch.diag(diagonal)).abs().max() < max(1e-4, rounding)
    assert diagonal.min() > 0.5 and diagonal.max() < 1.5


def test_matrices_orthogonalised_together_are_each_orthogonalised_alone():
    """Stacking the matrices of one shape (a tall one with its wide transpose among them)
    changes nothing but rounding: float64 results agree with one matrix at a time, each result
    keeps its own matrix's shape and dtype, and a tall matrix is no wide one's transpose."""
    generator = torch.Generator().manual_seed(1)
    shapes = [(48, 20), (20, 48), (48, 20), (32, 32), (20, 48), (7, 5)]
    updates = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    updates.append(torch.zeros(20, 48, dtype=torch.float64))  # no update: stays zero, no NaN
    coefficients = (3.4445, -4.775, 2.0315)
    together = orthogonalise_all(updates, coefficients, 5, 1e-7, torch.float64)
    for update, result in zip(updates, together, strict=True):
        alone = orthogonalise(update, coefficients, 5, 1e-7, torch.float64)
        assert result.shape == update.shape and result.dtype == update.dtype
        assert torch.allclose(result, alone, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(together[0], together[1].T, atol=1e-3)  # other matrices, shapes
    assert torch.equal(together[-1], torch.zeros(20, 48, dtype=torch.float64))


@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
def test_muon_steps_as_torch_muon_does_up_to_bfloat16_rounding(precision):
    """torch's Muon (its iteration in bfloat16) is the reference for momentum, Nesterov, decay
    and the step size; three steps, so the momentum buffer counts."""
    torch.manual_seed(0)
    weights = torch.randn(40, 24)
    ours, theirs = torch.nn.Parameter(weights.clone()), torch.nn.Parameter(weights.clone())
    mine = Muon([ours], lr=0.02, weight_decay=0.1, precision=precision)
    reference = torch.optim.Muon(
        [theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    start = ours.detach().clone()
    for step in range(3):
        grad = torch.randn(40, 24, generator=torch.Generator().manual_seed(step))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    moved, expected = (ours - start).detach(), (theirs - start).detach()
    assert (moved - expected).norm() < 0.02 * expected.norm()
    assert torch.equal(
        mine.state[ours]["momentum_buffer"], reference.state[theirs]["momentum_buffer"]
    )


def test_muon_without_torch_muon_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(optim, "_MUON", torch.optim.Optimizer)
    with pytest.raises(ValueError, match=r"optimizer 'muon' needs torch\.optim\.Muon"):
        make_optimizer(OctLM(MODEL), 1e-3, 0.1, optimizer="muon")


def test_one_schedule_drives_both_optimizers():
    model = OctLM(MODEL)
    optimizer = make_optimizer(model, 1e-3, 0.1, optimizer="muon", muon_lr=2e-2)
    scheduler = make_scheduler(optimizer, warmup=2, steps=10, min_ratio=0.1)
    for step in range(10):
        factor = lr_factor(step, warmup=2, steps=10, min_ratio=0.1)
        rates = [group["lr"] for group in optimizer.param_groups]
        assert rates == pytest.approx([1e-3 * factor, 1e-3 * factor, 2e-2 * factor])
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("pack", [False, True])
def test_a_resumed_muon_run_repeats_the_uninterrupted_losses_exactly(corpus, tmp_path, pack):
    model_config, run = configs(corpus, optimizer="muon", muon_lr=2e-2, pack=pack)
    model_config = replace(model_config, dropout=0.1)  # dropout's RNG must resume too
    train(model_config, run, tmp_path / "whole", progress=False)
    train(model_config, run, tmp_path / "cut", progress=False)
    for later in checkpoint.listed(tmp_path / "cut")[2:]:  # as if stopped right after step 4
        later.unlink()
    outcome = train(model_config, run, tmp_path / "cut", resume=True, progress=False)
    assert outcome.step == 6
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")  # exact, float for float

    def evaluations(folder):
        return [(r["step"], r["val_loss"]) for r in read_metrics(folder, "eval")]

    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "whole")


def test_a_muon_run_learns(corpus, tmp_path):
    model_config, run = configs(
        corpus, optimizer="muon", muon_lr=2e-2, steps=30, eval_every=30, checkpoint_every=30
    )
    outcome = train(model_config, run, tmp_path / "run", progress=False)
    curve = losses(tmp_path / "run")
    assert curve[30] < curve[1] - 1.0
    assert outcome.val_loss < math.log(256) - 1.0


def test_resume_refuses_another_optimizer(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2, optimizer="adamw")
    train(model_config, run, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match=r"run\.optimizer: 'adamw' in the run, 'muon' now"):
        train(
            model_config, replace(run, optimizer="muon", steps=4), tmp_path / "run",
            resume=True, progress=False,
        )  # fmt: skip


def test_an_unknown_optimizer_is_refused_by_name(capsys):
    expected = r"optimizer must be one of \('adamw', 'muon'\), got 'sgd'"
    with pytest.raises(ValueError, match=expected):
        RunConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="muon_lr must be a finite number >= 0, got -1"):
        RunConfig(muon_lr=-1)
    with pytest.raises(SystemExit):
        main(["train", "--out", "unused", "--optimizer", "sgd"])
    assert "invalid choice: 'sgd'" in capsys.readouterr().err


def test_a_run_older_than_the_optimizer_flag_resumes_with_adamw(corpus, tmp_path):
    """Its config.json has no ``optimizer``: it was trained with AdamW, whatever the default."""
    model_config, run = configs(corpus, optimizer="adamw")
    train(model_config, run, tmp_path / "whole", progress=False)
    cut = tmp_path / "cut"
    train(model_config, run, cut, progress=False)
    for later in checkpoint.listed(cut)[2:]:
        later.unlink()
    stored = json.loads((cut / "config.json").read_text())
    del stored["run"]["optimizer"], stored["run"]["muon_lr"]
    (cut / "config.json").write_text(json.dumps(stored))
    model_config, resumed = resolve(resume=cut)  # as ``octlm train --resume`` does
    assert resumed.optimizer == "adamw"
    train(model_config, resumed, cut, resume=True, progress=False)
    assert losses(cut) == losses(tmp_path / "whole")
