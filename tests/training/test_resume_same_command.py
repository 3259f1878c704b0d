"""``--resume`` added to the command line that started a run: a ``--preset`` or ``--config``
that resolves to the run's own values is accepted (job schedulers, shell history and Makefiles
rerun the same command), one that sets another value is refused by name where a resume may not
change it, and applied where it may."""

from __future__ import annotations

import pytest

from octlm.cli import main
from octlm.training import checkpoint
from tests.training_helpers import losses, tiny_flags, write_corpus

# Values no flag of the command gives, so that the resume compares them with the run's.
CONFIG = """\
[model]
n_kv_heads = 1

[run]
warmup = 3
seed = 7
"""


@pytest.mark.parametrize("source", ["preset", "config"])
def test_the_same_command_with_resume_continues_the_run_exactly(tmp_path, source):
    corpus = write_corpus(tmp_path / "corpus")
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    extra = ["--preset", "tiny"] if source == "preset" else ["--config", str(config)]
    extra += ["--checkpoint-every", "2", "--keep", "10"]
    for folder in (tmp_path / "whole", tmp_path / "cut"):
        assert main([*tiny_flags(corpus, folder, steps=4), *extra]) == 0
    for later in checkpoint.listed(tmp_path / "cut")[1:]:  # as if stopped after step 2
        later.unlink()
    assert main([*tiny_flags(corpus, tmp_path / "cut", steps=4), *extra, "--resume"]) == 0
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")  # exact


def test_a_preset_or_config_that_departs_from_the_run_is_refused_or_applied(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    folder = tmp_path / "run"
    assert main([*tiny_flags(corpus, folder, steps=2), "--preset", "tiny"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(folder), "--resume", "--preset", "small"]) == 2
    err = capsys.readouterr().err
    assert "--preset small sets model.width to 256, and the run's config.json has 16" in err
    reseeded = tmp_path / "reseeded.toml"
    reseeded.write_text("[run]\nseed = 5\n")
    assert main(["train", "--out", str(folder), "--resume", "--config", str(reseeded)]) == 2
    err = capsys.readouterr().err
    assert f"--config {reseeded} sets run.seed to 5, and the run's config.json has 0" in err
    config = tmp_path / "longer.toml"
    config.write_text("[run]\nsteps = 3\n")  # steps may change on resume: it does
    assert main(["train", "--out", str(folder), "--resume", "--config", str(config)]) == 0
    assert sorted(losses(folder)) == [1, 2, 3]
