"""Run folders: a start that fails leaves no run, octlm clears only what it wrote, and a damaged
folder is a clear error.

Runs use a model of a few thousand parameters on a few kilobytes of generated text
(tests/training_helpers.py), so each takes about a second.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from octlm import load_run
from octlm.training import checkpoint, config, train
from octlm.training.tokens import SUMMARY
from tests.training_helpers import configs, file_hashes, write_corpus


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("no-match", "no file matching glob"),
        ("all-empty", "every matched file is empty"),
        ("one-document", "the training split is empty"),
        ("too-short", "too few for one sequence"),
        ("float16-on-cpu", "float16 needs CUDA"),
        ("batch-split", "multiple of data-parallel ranks x accumulate"),
        ("triton-on-cpu", "kernel 'triton' runs on CUDA only"),
    ],
)
def test_bad_data_and_runs_raise(tmp_path, case, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    run = {"data": str(corpus)}
    if case == "missing":
        run["data"] = str(tmp_path / "nothing")
    elif case == "no-match":
        (corpus / "a.csv").write_text("text")
    elif case == "all-empty":
        (corpus / "a.txt").write_text("")
    elif case == "one-document":  # a folder of one document, held out by its hash
        (corpus / "a.txt").write_text("x" * 100)
        run["val_share"] = 0.999999
    elif case == "too-short":
        write_corpus(corpus, documents=12, size=3)
    else:
        write_corpus(corpus)
        run |= {"float16-on-cpu": {"dtype": "float16"}, "batch-split": {"accumulate": 3}}.get(
            case, {}
        )
    model_config, run_config = configs(corpus, **run)
    if case == "triton-on-cpu":
        model_config = replace(model_config, attention="tiled", kernel="triton")
    with pytest.raises(ValueError, match=message):
        train(model_config, run_config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / config.CONFIG_FILE).exists()  # no run that cannot resume


def test_a_failed_start_leaves_a_folder_the_next_start_can_use(corpus, tmp_path):
    """A start that fails before its first step (here: documents too short for a sequence)
    leaves no configuration, so the folder is no run: started again with good data, it is
    cleared and used; no --resume or --overwrite is asked for."""
    short = write_corpus(tmp_path / "short", documents=12, size=3)
    with pytest.raises(ValueError, match="too few for one sequence"):
        train(*configs(short), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / config.CONFIG_FILE).exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    with pytest.raises(ValueError, match="every matched file is empty"):
        train(*configs(empty), tmp_path / "run", progress=False)
    assert not list((tmp_path / "run").rglob("*.tmp"))
    outcome = train(*configs(corpus, steps=2), tmp_path / "run", progress=False)
    assert outcome.step == 2 and (tmp_path / "run" / config.CONFIG_FILE).is_file()


def test_a_file_as_the_run_folder_is_refused(corpus, tmp_path):
    (tmp_path / "run").write_text("mine")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        train(*configs(corpus), tmp_path / "run", progress=False)
    assert (tmp_path / "run").read_text() == "mine"


def test_existing_run_folder_is_refused_then_overwritten(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    before = file_hashes(tmp_path / "run")
    with pytest.raises(ValueError, match=r"--resume .* or --overwrite"):
        train(model_config, run, tmp_path / "run", progress=False)
    assert file_hashes(tmp_path / "run") == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="clears only run folders"):
        train(model_config, run, tmp_path / "other", overwrite=True, progress=False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    train(model_config, replace(run, steps=1), tmp_path / "run", overwrite=True, progress=False)
    assert [p.name for p in checkpoint.listed(tmp_path / "run")] == ["checkpoint-0000001.pt"]


def test_overwrite_clears_only_what_octlm_wrote(corpus, tmp_path):
    """A folder with a config.json that is not a run's (a Hugging Face model folder), or a run
    folder holding files octlm did not write, is refused by --overwrite and left whole."""
    model_config, run = configs(corpus, steps=1)
    theirs = tmp_path / "hf-model"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "config.json").write_text('{"model_type": "llama"}')
    (theirs / "sub" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"has no octlm config\.json"):
        train(model_config, run, theirs, overwrite=True, progress=False)
    folder = tmp_path / "run"
    train(model_config, run, folder, progress=False)
    (folder / "analysis.ipynb").write_text("mine")
    (folder / SUMMARY).touch()  # a name of the data folder's, in the wrong place
    with pytest.raises(ValueError, match=r"also holds analysis\.ipynb, data\.json: move them"):
        train(model_config, run, folder, overwrite=True, progress=False)
    assert (folder / "analysis.ipynb").read_text() == "mine"
    assert (theirs / "sub" / "notes.txt").read_text() == "mine"
    assert checkpoint.latest(folder) is not None


def test_a_folder_of_someone_elses_token_files_is_never_cleared(corpus, tmp_path):
    """Files named like octlm's own (train.bin, val.bin, data.json) in a folder octlm did not
    make are not octlm's: a plain start and --overwrite both refuse it, and leave it as it was."""
    theirs = tmp_path / "project" / "data"
    theirs.mkdir(parents=True)
    for name in ("train.bin", "val.bin", "data.json"):
        (theirs / name).write_text(f"their {name}")
    with pytest.raises(ValueError, match="is not empty"):
        train(*configs(corpus), tmp_path / "project", progress=False)
    with pytest.raises(ValueError, match="clears only run folders"):
        train(*configs(corpus), tmp_path / "project", overwrite=True, progress=False)
    # A failed start of octlm's is cleared next time, but not once someone put a file there.
    short = write_corpus(tmp_path / "short", documents=12, size=3)
    with pytest.raises(ValueError, match="too few for one sequence"):
        train(*configs(short), tmp_path / "failed", progress=False)
    (tmp_path / "failed" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        train(*configs(corpus), tmp_path / "failed", progress=False)
    assert (tmp_path / "failed" / "notes.txt").read_text() == "mine"
    assert sorted(p.read_text() for p in theirs.iterdir()) == [
        "their data.json", "their train.bin", "their val.bin"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "content", ['{"run": {}}', '{"model": {"foo": 1}}', "[1]", '{"model": {"width": "x"}}']
)
def test_a_run_folder_with_a_damaged_config_is_a_clear_error(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=r"config|width must be a positive int"):
        load_run(tmp_path)
