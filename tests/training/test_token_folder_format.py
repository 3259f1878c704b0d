"""Token folders keep their format: a corpus of every container, prepared now, gives the very
files that ``octlm prepare`` of ea5e4b0 made of it (tests/fixtures/make_token_folders.py)."""

import json
import shutil
from pathlib import Path

import pytest

from octlm.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tokens-ea5e4b0"
# What depends on where and when the corpus lies, not on what it holds.
PLACED = {"source", "files"}


@pytest.mark.parametrize(
    "name, flags",
    [("bytes", ["--tokenizer", "bytes"]), ("bpe", ["--tokenizer", "bpe", "--vocab-size", "300"])],
)
def test_a_corpus_prepares_into_the_files_of_ea5e4b0(tmp_path, name, flags):
    corpus = shutil.copytree(FIXTURE / "corpus", tmp_path / "corpus")
    out = tmp_path / name
    assert (
        main(["prepare", "--data", str(corpus), "--out", str(out), "--val-share", "0.2", *flags])
        == 0
    )
    made = sorted(p.name for p in out.iterdir())
    assert made == sorted(p.name for p in (FIXTURE / name).iterdir())
    for file in made:
        if file == "data.json":
            now, then = (json.loads((f / file).read_text()) for f in (out, FIXTURE / name))
            assert {k: v for k, v in now.items() if k not in PLACED} == {
                k: v for k, v in then.items() if k not in PLACED
            }
            assert [f[:2] for f in now["files"]] == [f[:2] for f in then["files"]]
        else:
            assert (out / file).read_bytes() == (FIXTURE / name / file).read_bytes(), file


def test_a_token_folder_of_ea5e4b0_trains_and_resumes(tmp_path):
    """``octlm train --data`` a token folder written by ea5e4b0: auto takes its BPE, and the
    run resumes."""
    tokens = shutil.copytree(FIXTURE / "bpe", tmp_path / "tokens")
    out = tmp_path / "run"
    command = ["train", "--data", str(tokens), "--out", str(out), "--width", "16"]
    command += ["--n-layers", "1", "--n-heads", "2", "--length", "16", "--batch", "4"]
    command += ["--eval-batches", "1", "--sample-tokens", "4", "--dtype", "float32"]
    command += ["--val-share", "0.2"]  # the folder's
    assert main([*command, "--steps", "2"]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert (stored["run"]["tokenizer"], stored["model"]["vocab_size"]) == ("bpe", 300)
    assert main([*command, "--steps", "3", "--resume"]) == 0
