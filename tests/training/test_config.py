"""A training run's configuration (flags, files, presets, errors, the parameter count computed
from its sizes) and its optimiser and schedule.

Runs use a model of a few thousand parameters on a few kilobytes of generated text
(tests/training_helpers.py), so each takes about a second.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from octlm.model import ModelConfig, OctLM
from octlm.training import config, train
from octlm.training.config import resolve
from octlm.training.optim import lr_factor, make_optimizer
from tests.training_helpers import TINY_MODEL, configs


def test_flags_override_file_which_overrides_preset(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nwidth = 64\nn_heads = 4\n[run]\nsteps = 7\nlength = 32\n")
    model, run = resolve("small", path, model={"n_layers": 2}, run={"steps": 9})
    assert (model.width, model.n_heads, model.n_layers) == (64, 4, 2)
    assert model.n_kv_heads == config.PRESETS["small"]["n_kv_heads"]
    assert (run.steps, run.length, model.max_length) == (9, 32, 32)
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps(config.to_dict(model, run)))
    assert resolve(file=json_path) == (model, run)


def test_parameter_count_is_the_models():
    model_config = ModelConfig(**config.PRESETS["tiny"])
    count = sum(p.numel() for p in OctLM(model_config).parameters())
    assert config.parameter_count(model_config) == count


SHAPES = [
    dict(width=16, n_layers=1, n_heads=2),  # MHA
    dict(width=48, n_layers=3, n_heads=6, n_kv_heads=2),  # GQA
    dict(width=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=300),  # MQA, another vocab
    dict(width=40, n_layers=2, n_heads=4, max_length=64, window=8),  # mlp width rounded up to 8
    *config.PRESETS.values(),
]


def test_counts_need_no_model_and_equal_the_real_models(monkeypatch):
    def refuse(self, model_config):
        raise AssertionError("a parameter count built a model")

    with monkeypatch.context() as patch:
        patch.setattr(OctLM, "__init__", refuse)
        counts = [config.parameter_count(ModelConfig(**shape)) for shape in SHAPES]
        summary = config.preset_summary()
    for shape, count in zip(SHAPES, counts, strict=True):
        real = sum(p.numel() for p in OctLM(ModelConfig(**shape)).parameters())
        assert count == real, shape
    for name, sizes in config.PRESETS.items():
        bpe, byte = (
            sum(p.numel() for p in OctLM(ModelConfig(**sizes, vocab_size=vocab)).parameters())
            for vocab in (config.DEFAULT_BPE_VOCAB, 256)
        )
        [line] = [line for line in summary.splitlines() if line.startswith(f"{name}: ")]
        assert f"{bpe / 1e6:.2f}M parameters with BPE" in line
        assert f"({byte / 1e6:.2f}M with --tokenizer bytes)" in line


@pytest.mark.parametrize(
    "model, run, message",
    [
        ({}, {"steps": 0}, "steps must be a positive integer, got 0"),
        ({}, {"val_share": 1.0}, "val_share must be in"),
        ({}, {"dtype": "float64"}, "dtype must be one of"),
        ({"vocab_size": 100}, {"tokenizer": "bytes"}, "byte tokens need vocab_size 256, got 100"),
        ({"vocab_size": 300}, {"tokenizer": "bytes"}, "byte tokens need vocab_size 256, got 300"),
        ({}, {"prompt": "def\udcff"}, "prompt must be UTF-8 text"),
        ({}, {"pack": "false"}, "pack must be true or false, got 'false'"),
        ({}, {"compile": 0}, "compile must be one of ('auto', 'on', 'off'), got 0"),
        ({}, {"glob": 7}, "glob must be a string, got 7"),
        ({"max_length": 8}, {"length": 16}, "length (16) exceeds max_length (8)"),
        ({"attention": "ring"}, {}, "--context-parallel"),
        ({}, {"fsdp": True, "context_parallel": True}, "cannot be combined"),
        ({}, {"pack": True, "context_parallel": True}, "takes document_ids"),
        ({}, {"prompt": ""}, "prompt must be a non-empty string, got ''"),
        ({}, {"prompt": 5}, "prompt must be a string, got 5"),
        ({}, {"seed": 10**20}, "seed must be below 2**63"),
        ({}, {"device": "foo"}, "device must be 'cpu', 'cuda' or 'cuda:<index>', got 'foo'"),
        ({"max_length": 1}, {"length": 1}, "sample_tokens (96) needs max_length >= 2"),
    ],
)
def test_bad_configuration_raises(model, run, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(model=model, run=run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without")
def test_cuda_on_a_machine_without_it_is_a_clear_error(corpus, tmp_path):
    with pytest.raises(ValueError, match="has no CUDA device"):
        train(*configs(corpus, device="cuda"), tmp_path / "run", progress=False)


@pytest.mark.parametrize("content", ["5", '{"model": 5}', '{"run": [1]}'])
def test_config_file_of_the_wrong_shape_raises(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"config .*bad\.json"):
        resolve(file=path)


def test_config_file_with_unknown_key_raises(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model": {"widht": 8}}))
    with pytest.raises(ValueError, match="unknown keys \\['widht'\\]"):
        resolve(file=path)


def test_weight_decay_applies_to_matrices_only():
    model = OctLM(ModelConfig(**TINY_MODEL, max_length=8))
    decayed, plain = make_optimizer(model, 1e-3, 0.1).param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(
        p.dim() == 1 for p in plain["params"]
    )
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    factors = [lr_factor(step, warmup=4, steps=20, min_ratio=0.1) for step in range(20)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in itertools.pairwise(factors[4:]))


def test_a_run_stored_before_the_schedule_defaults_changed_keeps_its_schedule(tmp_path):
    """A config.json without ``muon_lr`` or ``min_lr_ratio`` was written when they defaulted
    to 6e-3 and 0.1: a resume takes those, not today's defaults; a new run takes today's."""
    model, run = resolve(model=TINY_MODEL, run={"tokenizer": "bytes"})
    assert (run.muon_lr, run.min_lr_ratio) == (0.012, 0.0)
    stored = config.to_dict(model, run)
    del stored["run"]["muon_lr"], stored["run"]["min_lr_ratio"]
    (tmp_path / config.CONFIG_FILE).write_text(json.dumps(stored))
    _model, resumed = resolve(resume=tmp_path)
    assert (resumed.muon_lr, resumed.min_lr_ratio) == (6e-3, 0.1)
