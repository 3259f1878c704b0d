"""``octlm train`` and ``octlm sample`` on the command line, and text from a run's checkpoint.

Runs use a model of a few thousand parameters on a few kilobytes of generated text
(tests/training_helpers.py), so each takes about a second.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partialmethod

import pytest
import torch

from octlm import load_run
from octlm.cli import main
from octlm.model import ModelConfig, OctLM
from octlm.progress import Progress
from octlm.training import checkpoint, train
from octlm.training.sample import generate_text
from tests.training_helpers import configs, losses, tiny_flags


def test_command_line_trains_refuses_resumes_and_samples(corpus, tmp_path, capsys):
    folder = tmp_path / "run"
    assert main(tiny_flags(corpus, folder, steps=2)) == 0
    assert main(tiny_flags(corpus, folder, steps=2)) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["train", "--out", str(folder), "--resume", "--width", "32"]) == 2
    assert "model.width: 16 in the run, 32 now" in capsys.readouterr().err
    assert main(["train", "--out", str(folder), "--resume", "--steps", "3"]) == 0
    assert sorted(losses(folder)) == [1, 2, 3]
    capsys.readouterr()
    assert main(["sample", str(folder), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def ") and "step 3" in err


def test_text_generation_needs_two_positions():
    """With max_length 1 there is no room for a byte of context and the next one: a clear
    error, where the window loop once spun forever; with 2 it makes progress a byte at a time."""
    small = ModelConfig(width=16, n_layers=1, n_heads=2, max_length=1)
    with pytest.raises(ValueError, match="needs max_length >= 2"):
        generate_text(OctLM(small), "x", 3)
    assert generate_text(OctLM(small), "x", 0) == "x"
    assert len(generate_text(OctLM(replace(small, max_length=2)), "x", 5).encode()) >= 6


def test_a_triton_run_samples_on_a_cpu(corpus, tmp_path):
    model_config, run = configs(corpus, steps=1)
    train(model_config, run, tmp_path / "run", progress=False)
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    stored["model"] |= {"attention": "tiled", "kernel": "triton"}  # as a GPU run writes it
    (tmp_path / "run" / "config.json").write_text(json.dumps(stored))
    model, _tokenizer, _step = load_run(tmp_path / "run")
    assert (model.config.attention, model.config.kernel) == ("tiled", "pytorch")
    assert generate_text(model, "def ", 4).startswith("def ")


def test_sample_is_the_models_own_decoding(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    model, _tokenizer, step = load_run(tmp_path / "run")
    assert step == 2
    state = torch.load(checkpoint.latest(tmp_path / "run"), weights_only=True)["model"]
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, saved in state.items():  # tensors, and the config the model carries beside them
        assert (
            torch.equal(loaded[name], saved)
            if isinstance(saved, torch.Tensor)
            else (loaded[name] == saved)
        )
    prompt = torch.tensor([list(b"def ")])  # (1, 4)
    expected = model.eval().generate(prompt, 6)[0].tolist()  # greedy
    assert generate_text(model, "def ", 6) == bytes(expected).decode("utf-8", errors="replace")
    drawn = [generate_text(model, "def ", 6, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert drawn[0] == drawn[1]


def test_a_log_outside_a_terminal_is_plain_lines_and_samples_start_from_held_out_text(
    tmp_path, capsys, monkeypatch
):
    """Not a terminal (as a log file is): plain progress lines, no bar frames; without
    --prompt the evaluation sample starts with the held-out text, whatever the corpus."""
    monkeypatch.setattr(Progress, "__init__", partialmethod(Progress.__init__, every=0.0))
    corpus = tmp_path / "verse.txt"
    corpus.write_text("Shall I compare thee to a summer's day?\n" * 40)
    flags = tiny_flags(corpus, tmp_path / "run", steps=12)
    flags[flags.index("--eval-every") + 1] = "6"
    assert main(flags) == 0
    out, err = capsys.readouterr()
    assert "\r" not in err and "step/s]" not in err
    progress = [line for line in err.splitlines() if line.startswith("training: ")]
    assert len(progress) == 13 and progress[-1].startswith("training: 12 of 12 steps (100%)")
    samples = [line for line in out.splitlines() if line.startswith("  sample: ")]
    # The held-out tenth of 40 lines of 40 bytes starts at a line; the prompt is 8 bytes of it.
    assert len(samples) == 2 and all(line.startswith("  sample: 'Shall I ") for line in samples)
