"""octlm.load_run: a run folder's model at its best, last or a chosen checkpoint, with the run's
tokenizer, from a light ``import octlm``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import octlm
from octlm import ModelConfig
from octlm.training import folder
from octlm.training.folder import choose
from octlm.training.metrics import METRICS
from tests.transformers_folders import make_run

CONFIG = ModelConfig(vocab_size=256, width=32, n_layers=1, n_heads=4, max_length=32)

pytestmark = pytest.mark.usefixtures("one_thread")


def name_best(folder: Path, step: int) -> None:
    """Metrics naming ``step`` the run's best, as ``octlm train`` writes them."""
    record = {"kind": "eval", "step": step, "val_loss": 1.0, "best_step": step}
    (folder / METRICS).write_text(json.dumps(record) + "\n")


def test_the_best_the_last_or_a_chosen_checkpoint_with_the_runs_tokenizer(tmp_path):
    models = make_run(tmp_path / "run", CONFIG, steps=(3, 6))
    ids = torch.randint(256, (1, 10), generator=torch.Generator().manual_seed(0))
    assert octlm.load_run(tmp_path / "run").step == 6  # no best recorded: the last
    name_best(tmp_path / "run", 3)
    model, tokenizer, step = octlm.load_run(tmp_path / "run")
    assert step == 3 and not model.training
    for asked, expected in (("best", 3), ("last", 6), (6, 6), (3, 3)):
        loaded, _tokenizer, at = octlm.load_run(tmp_path / "run", step=asked)
        assert at == expected
        with torch.no_grad():
            assert torch.equal(loaded(ids), models[expected](ids))
    text = "héllo ☃\n".encode()
    assert tokenizer.encode(text) == list(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.name, tokenizer.vocab_size) == ("bytes", 256)
    expected = r"step must be 'best', 'last' or one of the run's checkpoints \[3, 6\], got 4"
    with pytest.raises(ValueError, match=expected):
        octlm.load_run(tmp_path / "run", step=4)


def test_a_best_whose_checkpoint_is_gone_gives_the_last_saying_so(tmp_path):
    make_run(tmp_path / "run", CONFIG, steps=(3, 6))
    name_best(tmp_path / "run", 2)
    chosen = choose(tmp_path / "run")
    assert (chosen.step, chosen.how) == (6, "the last: the run records no best")
    name_best(tmp_path / "run", 3)
    assert choose(tmp_path / "run").how == "the best (lowest validation loss)"


def test_export_reads_a_run_folder_without_the_sampling_code():
    code = "import sys, octlm.export\nprint('octlm.training.sample' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert octlm.Run is folder.Run and octlm.load_run is folder.load_run


def test_import_octlm_loads_neither_training_nor_file_formats():
    code = (
        "import sys, octlm\n"
        "print('octlm.training' in sys.modules)\n"
        "assert callable(octlm.load_run)\n"
        "heavy = ('safetensors', 'tokenizers', 'transformers')\n"
        "print([name for name in heavy if name in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False", "[]"]
