"""``octlm prepare``: a corpus tokenised once into a token folder, found up to date or changed,
reused by a run's data folder; progress as plain lines outside a terminal."""

from __future__ import annotations

import gzip
import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from octlm.cli import main
from octlm.model import ModelConfig
from octlm.progress import Progress
from octlm.training import prepare
from octlm.training.config import RunConfig
from octlm.training.corpus import Corpus
from octlm.training.tokens import TOKEN_FILES, read_summary

BYTES, NONE = ModelConfig(vocab_size=256), frozenset()
RECORDS = [f"Story {i}: the fox and the hound went to the river {i} and swam." for i in range(400)]


def write_jsonl_gz(path: Path, records=RECORDS) -> Path:
    path.write_bytes(
        gzip.compress("".join(json.dumps({"text": r}) + "\n" for r in records).encode())
    )
    return path


def folder_state(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_prepare_once_then_up_to_date_then_again_when_the_corpus_changed(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    write_jsonl_gz(tmp_path / "c.jsonl.gz")
    args = ["prepare", "--data", "c.jsonl.gz", "--out", "tok", "--vocab-size", "300"]
    assert main(args) == 0
    assert "by a hash of each record's file and index" in capsys.readouterr().out
    summary = json.loads((tmp_path / "tok" / "data.json").read_text())
    assert summary["train_documents"] + summary["val_documents"] == len(RECORDS)
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    before = folder_state(tmp_path / "tok")
    assert main(args) == 0 and "up to date" in capsys.readouterr().err
    assert folder_state(tmp_path / "tok") == before
    write_jsonl_gz(tmp_path / "c.jsonl.gz", RECORDS[:300])
    assert main(args) == 0 and "files (c.jsonl.gz)" in capsys.readouterr().err
    summary = json.loads((tmp_path / "tok" / "data.json").read_text())
    assert summary["train_documents"] + summary["val_documents"] == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl.gz", "tok"]


def test_a_bad_record_is_one_line_and_the_earlier_folder_stays(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_jsonl_gz(tmp_path / "c.jsonl.gz")
    args = ["prepare", "--data", "c.jsonl.gz", "--out", "tok", "--tokenizer", "bytes"]
    assert main(args) == 0
    before = folder_state(tmp_path / "tok")
    lines = [json.dumps({"text": r}) for r in RECORDS] + ['{"body": "x"}']
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    capsys.readouterr()
    assert main(args) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            f"octlm prepare: c.jsonl.gz: line {len(RECORDS) + 1}: no field 'text' (it has 'body')"
        )
    )
    assert folder_state(tmp_path / "tok") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl.gz", "tok"]


def test_a_missing_corpus_is_named_before_any_tokenizer_is_trained(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "--data", "nothing", "--out", "tok"]) == 2
    err = capsys.readouterr().err
    assert "training a byte-level BPE" not in err
    assert err.strip() == (
        "octlm prepare: --data 'nothing' does not exist: expected a corpus file or a folder of them"
    )


def run_config(corpus: Path, **values) -> RunConfig:
    return RunConfig(data=str(corpus), tokenizer="bytes", **values)


def prepared(run: RunConfig, out: Path) -> dict:
    """``run``'s corpus prepared into the token folder ``out``; its summary."""
    return prepare.prepare_folder(out, Corpus.of(run), BYTES, run, progress=False).summary


def test_a_run_reuses_a_token_folder_by_links_and_records_it(tmp_path):
    run = run_config(write_jsonl_gz(tmp_path / "c.jsonl.gz"))
    prepared(run, tmp_path / "tok")
    run_folder = tmp_path / "run"
    summary = prepare.reuse(tmp_path / "tok", BYTES, run, NONE, run_folder / "data", run_folder)
    summary = summary.summary
    assert summary[prepare.PREPARED] == str((tmp_path / "tok").resolve())
    for name in TOKEN_FILES:
        assert (tmp_path / "run" / "data" / name).read_bytes() == (
            tmp_path / "tok" / name
        ).read_bytes()
    assert read_summary(tmp_path / "run" / "data")["train_tokens"] == summary["train_tokens"]
    with pytest.raises(
        ValueError,
        match=r"holds tokens of val_share 0.1, not the run's; train with --val-share 0.1",
    ):
        other = run_config(tmp_path, val_share=0.2)
        prepare.reuse(tmp_path / "tok", BYTES, other, NONE, tmp_path / "r2", tmp_path)


def test_progress_outside_a_terminal_is_plain_lines():
    out = io.StringIO()
    with Progress("tokenising", total=4000, unit="B", file=out, every=0) as progress:
        for _ in range(4):
            progress.update(1000)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and "\r" not in out.getvalue()
    assert lines[-1].startswith("tokenising: 4k") and "of 4kB (100%)" in lines[-1]


@pytest.mark.parametrize(
    ("values", "message"),
    [({"text_field": "a..b"}, "text_field must name a field"), ({"separator": ""}, "separator"),
     ({"tokenizer_sample": -1}, "tokenizer_sample must be an integer >= 0")],
)  # fmt: skip
def test_data_options_are_checked(values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**values)


def test_a_run_s_tokens_come_from_a_token_folder_or_its_corpus(tmp_path):
    corpus = write_jsonl_gz(tmp_path / "c.jsonl.gz")
    prepared(run_config(corpus), tmp_path / "tok")
    from_folder, from_corpus = run_config(tmp_path / "tok"), run_config(corpus)
    a, b = tmp_path / "a", tmp_path / "b"
    linked = prepare.run_tokens(a / "data", a, BYTES, from_folder, NONE, False, False).summary
    made = prepare.run_tokens(b / "data", b, BYTES, from_corpus, NONE, False, False).summary
    assert prepare.PREPARED in linked and prepare.PREPARED not in made
    for name in TOKEN_FILES:
        assert (tmp_path / "a" / "data" / name).read_bytes() == (
            tmp_path / "b" / "data" / name
        ).read_bytes()


def held_in_make(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """``make_tokens`` made to wait, once it has begun, until the test lets it go on: a
    prepare caught in the middle. The events: it began; let it go on."""
    began, go_on, make = threading.Event(), threading.Event(), prepare.make_tokens

    def waiting(*args, **kwargs):
        began.set()
        assert go_on.wait(60)
        return make(*args, **kwargs)

    monkeypatch.setattr(prepare, "make_tokens", waiting)
    return began, go_on


def test_a_second_prepare_of_a_folder_is_refused_naming_the_holder(tmp_path, monkeypatch, capsys):
    """Two prepares of one token folder: the second is one line naming the process that
    holds it, and the first ends with a whole folder."""
    corpus = write_jsonl_gz(tmp_path / "c.jsonl.gz")
    args = ["prepare", "--data", str(corpus), "--out", str(tmp_path / "tok")]
    args += ["--tokenizer", "bytes"]
    began, go_on = held_in_make(monkeypatch)
    first = threading.Thread(target=lambda: main(args))
    first.start()
    assert began.wait(60)
    assert main(args) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        f"octlm prepare: token folder {str(tmp_path / 'tok')!r} is in use by process "
        f"{os.getpid()} (another octlm prepare, or a run linking its files): wait for it to end"
    )
    go_on.set()
    first.join(60)
    assert prepare.is_prepared(tmp_path / "tok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl.gz", "tok"]


def test_a_run_that_starts_during_a_swap_gets_one_whole_folder(tmp_path, monkeypatch):
    """A run linking the token folder while a prepare replaces it waits for the prepare and
    takes the new folder whole: its tokenizer and tokens are of one preparation."""
    corpus = write_jsonl_gz(tmp_path / "c.jsonl.gz")
    old = RunConfig(data=str(corpus), tokenizer="bpe")
    bpe = ModelConfig(vocab_size=300)
    prepare.prepare_folder(tmp_path / "tok", Corpus.of(old), bpe, old, progress=False)
    write_jsonl_gz(tmp_path / "c.jsonl.gz", RECORDS[::-1][:250])  # another corpus
    began, go_on = held_in_make(monkeypatch)
    swap = threading.Thread(
        target=prepare.prepare_folder,
        args=(tmp_path / "tok", Corpus.of(old), bpe, old),
        kwargs={"progress": False},
    )
    swap.start()
    assert began.wait(60)
    run, linked = RunConfig(data=str(tmp_path / "tok"), tokenizer="bpe"), []
    reader = threading.Thread(
        target=lambda: linked.append(
            prepare.reuse(tmp_path / "tok", bpe, run, NONE, tmp_path / "r" / "data", tmp_path / "r")
        )
    )
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()  # waits for the prepare's swap
    go_on.set()
    swap.join(60)
    reader.join(60)
    for name in (*TOKEN_FILES, "tokenizer.json"):
        where = tmp_path / "r" / ("data" if name in TOKEN_FILES else "") / name
        assert where.read_bytes() == (tmp_path / "tok" / name).read_bytes(), name
    assert linked[0].summary["train_documents"] + linked[0].summary["val_documents"] == 250


KILLED_AT = """
import os, signal, sys
from octlm.cli import main
calls = [0]
replace = os.replace
def dying(source, target):
    calls[0] += 1
    if calls[0] == int(sys.argv[1]) and sys.argv[2] == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    replace(source, target)
    if calls[0] == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = dying
main(sys.argv[3:])
"""


@pytest.mark.parametrize(
    ("kill_at", "when"), [(1, "before"), (2, "before"), (3, "before"), (3, "after")]
)
def test_a_prepare_killed_at_its_swap_leaves_a_folder_the_next_one_restores(
    tmp_path, kill_at, when
):
    """SIGKILL at each rename of a prepare that replaces a token folder (its data.json's, the
    old folder's aside, the new one's into place) and after the last: the folder is its old or
    its new self, or the next run or prepare restores it; no leftover blocks the next one."""
    corpus = write_jsonl_gz(tmp_path / "c.jsonl.gz")
    args = ["prepare", "--data", str(corpus), "--out", str(tmp_path / "tok")]
    args += ["--tokenizer", "bytes"]
    assert main(args) == 0
    old = folder_state(tmp_path / "tok")
    write_jsonl_gz(tmp_path / "c.jsonl.gz", RECORDS[:300])
    renames = 4 + 1  # the four token files and data.json, then the two of the swap
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT, str(renames + kill_at - 1), when, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    if (tmp_path / "tok").exists():
        assert folder_state(tmp_path / "tok") == old or prepare.is_prepared(tmp_path / "tok")
    assert prepare.is_prepared(tmp_path / "tok")  # restored where the kill left none
    assert main(args) == 0
    summary = read_summary(tmp_path / "tok")
    assert summary["train_documents"] + summary["val_documents"] == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl.gz", "tok"]
