"""octlm.load_run: a run folder's model at its latest or a chosen checkpoint, with the run's
tokenizer, from a light ``import octlm``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import octlm
from octlm import ModelConfig
from tests.transformers_folders import make_run

CONFIG = ModelConfig(vocab_size=256, width=32, n_layers=1, n_heads=4, max_length=32)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_latest_or_a_chosen_checkpoint_with_the_runs_tokenizer(tmp_path):
    models = make_run(tmp_path / "run", CONFIG, steps=(3, 6))
    ids = torch.randint(256, (1, 10), generator=torch.Generator().manual_seed(0))
    model, tokenizer, step = octlm.load_run(tmp_path / "run")
    assert step == 6 and not model.training
    earlier = octlm.load_run(tmp_path / "run", step=3)
    for chosen, (loaded, _tokenizer, at) in ((6, (model, tokenizer, step)), (3, earlier)):
        assert at == chosen
        with torch.no_grad():
            assert torch.equal(loaded(ids), models[chosen](ids))
    text = "héllo ☃\n".encode()
    assert tokenizer.encode(text) == list(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.name, tokenizer.vocab_size) == ("bytes", 256)
    with pytest.raises(ValueError, match=r"step must be one of the run's checkpoints \[3, 6\]"):
        octlm.load_run(tmp_path / "run", step=4)


def test_import_octlm_loads_neither_training_nor_file_formats():
    code = (
        "import sys, octlm\n"
        "assert callable(octlm.load_run)\n"
        "heavy = ('octlm.training', 'safetensors', 'tokenizers', 'transformers')\n"
        "print([name for name in heavy if name in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
