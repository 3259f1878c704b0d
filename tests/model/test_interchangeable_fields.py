"""How a model runs (attention, tiles, kernel, dropout) is one set of fields: a checkpoint loads
and a run resumes under any of their values, and the weights compute the same logits there."""

from dataclasses import asdict, replace

import pytest
import torch

from octlm.model import INTERCHANGEABLE, ModelConfig, OctLM
from octlm.training import checkpoint, config

SAVED = ModelConfig(width=16, n_layers=1, n_heads=2, max_length=16, attention="sdpa")
RUNS_OTHERWISE = replace(SAVED, attention="naive", block=(8, 4), kernel="pytorch", dropout=0.25)


def test_a_checkpoint_loads_under_every_interchangeable_field_and_gives_the_same_logits(tmp_path):
    changed = {
        name for name, value in asdict(RUNS_OTHERWISE).items() if asdict(SAVED)[name] != value
    }
    assert changed <= INTERCHANGEABLE
    torch.manual_seed(0)
    saved = OctLM(SAVED).eval()
    path = checkpoint.save(
        tmp_path, 1, {"model_config": asdict(SAVED), "model": saved.state_dict()}, keep=1
    )
    state = checkpoint.load(path, RUNS_OTHERWISE)
    loaded = OctLM(RUNS_OTHERWISE).eval()
    loaded.load_state_dict(state["model"])
    tokens = torch.randint(SAVED.vocab_size, (2, 12))
    torch.testing.assert_close(loaded(tokens), saved(tokens))


def test_a_run_resumes_under_another_dropout_but_not_another_width():
    run = config.RunConfig(length=16)
    stored = config.to_dict(SAVED, run)
    config.check_resumable(stored, RUNS_OTHERWISE, run)
    with pytest.raises(ValueError, match=r"model\.width: 16 in the run, 32 now"):
        config.check_resumable(stored, replace(RUNS_OTHERWISE, width=32), run)
