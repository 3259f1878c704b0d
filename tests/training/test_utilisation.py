"""A run's share of the machine's peak: FLOPs per token against torch's own count of a step's
products, and the peak measured once a machine and cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from octlm.lab.report import write_report
from octlm.model import ModelConfig, OctLM
from octlm.training import train, utilisation
from tests.training_helpers import configs, read_metrics


@pytest.mark.parametrize(
    "sizes",
    [dict(width=32, n_layers=2, n_heads=4, n_kv_heads=2), dict(width=48, n_layers=1, n_heads=3)],
)
@pytest.mark.parametrize("tied_head", [True, False])
def test_flops_per_token_are_the_products_a_step_runs(sizes, tied_head):
    """torch's flop counter over a forward and backward of naive attention (which multiplies
    the whole square, masked) gives 6 N + 12 L T d a token; the formula counts causal at half,
    6 L T d less."""
    config = ModelConfig(
        vocab_size=96, max_length=24, attention="naive", tied_head=tied_head, **sizes
    )
    model = OctLM(config)
    tokens = torch.randint(96, (3, 24))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        logits.float().square().mean().backward()
    counted = counter.get_total_flops() / tokens.numel()
    # the test's own count: every Linear's weight, and the head (the tied embedding) once
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if tied_head:
        weights += model.embedding.weight.numel()
    whole_square = 6 * weights + 12 * config.n_layers * 24 * config.n_heads * config.head_size
    assert counted == whole_square
    causal_half = 6 * config.n_layers * 24 * config.n_heads * config.head_size
    assert utilisation.flops_per_token(config, 24) == whole_square - causal_half


def test_a_window_counts_the_keys_it_sees():
    config = ModelConfig(vocab_size=96, width=32, n_layers=2, n_heads=4, window=8)
    wide = ModelConfig(vocab_size=96, width=32, n_layers=2, n_heads=4)
    assert utilisation.flops_per_token(config, 64) == utilisation.flops_per_token(wide, 8)


def test_the_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(utilisation.PEAK_VARIABLE, raising=False)
    measured = []
    monkeypatch.setattr(
        utilisation, "measure_peak", lambda device, dtype: measured.append(dtype) or 1e9
    )
    cpu = torch.device("cpu")
    assert utilisation.peak(cpu, "float32") == 1e9
    assert utilisation.peak(cpu, "float32") == 1e9
    assert utilisation.peak(cpu, "bfloat16") == 1e9
    assert measured == ["float32", "bfloat16"]
    cached = json.loads((tmp_path / "octlm" / "peak.json").read_text())
    assert len(cached) == 2 and all("torch" in key for key in cached)
    monkeypatch.setenv(utilisation.PEAK_VARIABLE, "0")
    assert utilisation.peak(cpu, "float32") is None
    monkeypatch.setenv(utilisation.PEAK_VARIABLE, "fast")
    with pytest.raises(ValueError, match="OCTLM_PEAK_FLOPS must be a number"):
        utilisation.peak(cpu, "float32")


def test_a_measured_peak_is_a_rate_of_products():
    """The measurement itself: a positive rate, below what two cores could do at 100 GHz."""
    rate = utilisation.measure_peak(torch.device("cpu"), "float32")
    assert 1e8 < rate < 2 * 100e9 * 64


def test_every_step_record_and_the_report_give_the_share_of_peak(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv(utilisation.PEAK_VARIABLE, "2e9")
    model_config, run = configs(corpus)
    train(model_config, run, tmp_path / "run", progress=False)
    steps = read_metrics(tmp_path / "run", "train_step")
    flops = utilisation.flops_per_token(model_config, run.length)
    for record in steps:
        assert record["model_flops_per_second"] == pytest.approx(
            record["tokens_per_second"] * flops
        )
        assert record["mfu"] == pytest.approx(record["tokens_per_second"] * flops / 2e9)
    report = write_report([str(tmp_path / "run")], tmp_path / "report.md")
    assert "of the machines' peak (MFU)" in Path(report).read_text()
