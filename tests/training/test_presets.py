"""The presets' explicit MLP widths: they go with the preset's width, and a run of a preset whose
config.json holds ModelConfig's own MLP width (8/3 of the width) resumes with the preset named."""

from __future__ import annotations

import json

from octlm import ModelConfig
from octlm.training.config import CONFIG_FILE, PRESETS, RunConfig, resolve, to_dict


def test_a_given_width_leaves_the_mlp_width_to_model_config_s_rule():
    assert resolve(preset="tiny")[0].mlp_width == PRESETS["tiny"]["mlp_width"] == 384
    assert (
        resolve(preset="tiny", model={"width": 64})[0].mlp_width == ModelConfig(width=64).mlp_width
    )
    assert resolve(preset="tiny", model={"mlp_width": 100})[0].mlp_width == 100


def test_a_run_of_the_preset_with_model_config_s_mlp_width_resumes_with_the_preset(tmp_path):
    sizes = {name: value for name, value in PRESETS["tiny"].items() if name != "mlp_width"}
    model = ModelConfig(vocab_size=256, max_length=128, **sizes)
    assert model.mlp_width == 344  # 8/3 of 128, rounded up to 8
    run = RunConfig(tokenizer="bytes", dtype="float32")
    (tmp_path / CONFIG_FILE).write_text(json.dumps(to_dict(model, run)))
    resumed, _run = resolve(preset="tiny", run={"steps": 2000}, resume=tmp_path)
    assert resumed == model
