"""``octlm prepare``: a corpus tokenised once into a token folder, found up to date or changed,
reused by a run's data folder; progress as plain lines outside a terminal."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest

from octlm.progress import Progress
from octlm.training import data, prepare
from octlm.training.config import RunConfig
from tests.training_helpers import octlm

RECORDS = [f"Story {i}: the fox and the hound went to the river {i} and swam." for i in range(400)]


def write_jsonl_gz(path: Path, records=RECORDS) -> Path:
    path.write_bytes(
        gzip.compress("".join(json.dumps({"text": r}) + "\n" for r in records).encode())
    )
    return path


def folder_state(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_prepare_once_then_up_to_date_then_again_when_the_corpus_changed(tmp_path):
    write_jsonl_gz(tmp_path / "c.jsonl.gz")
    args = ("prepare", "--data", "c.jsonl.gz", "--out", "tok", "--vocab-size", "300")
    first = octlm(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "by a hash of each record's file and index" in first.stderr
    summary = json.loads((tmp_path / "tok" / "data.json").read_text())
    assert summary["train_documents"] + summary["val_documents"] == len(RECORDS)
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    before = folder_state(tmp_path / "tok")
    again = octlm(*args, cwd=tmp_path)
    assert again.returncode == 0 and "up to date" in again.stderr
    assert folder_state(tmp_path / "tok") == before
    write_jsonl_gz(tmp_path / "c.jsonl.gz", RECORDS[:300])
    changed = octlm(*args, cwd=tmp_path)
    assert changed.returncode == 0 and "files (c.jsonl.gz)" in changed.stderr
    summary = json.loads((tmp_path / "tok" / "data.json").read_text())
    assert summary["train_documents"] + summary["val_documents"] == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl.gz", "tok"]


def test_a_bad_record_is_one_line_and_the_earlier_folder_stays(tmp_path):
    write_jsonl_gz(tmp_path / "c.jsonl.gz")
    args = ("prepare", "--data", "c.jsonl.gz", "--out", "tok", "--tokenizer", "bytes")
    assert octlm(*args, cwd=tmp_path).returncode == 0
    before = folder_state(tmp_path / "tok")
    lines = [json.dumps({"text": r}) for r in RECORDS] + ['{"body": "x"}']
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    bad = octlm(*args, cwd=tmp_path)
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"octlm prepare: c.jsonl.gz: line {len(RECORDS) + 1}: no field 'text' (it has 'body')"
        )
    )
    assert folder_state(tmp_path / "tok") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl.gz", "tok"]


def test_a_missing_corpus_is_named_before_any_tokenizer_is_trained(tmp_path):
    found = octlm("prepare", "--data", "nothing", "--out", "tok", cwd=tmp_path)
    assert found.returncode == 2 and "training a byte-level BPE" not in found.stderr
    assert found.stderr.strip() == (
        "octlm prepare: --data 'nothing' does not exist: expected a corpus file or a folder of them"
    )


def run_config(corpus: Path, **values) -> RunConfig:
    return RunConfig(data=str(corpus), tokenizer="bytes", **values)


def test_a_run_reuses_a_token_folder_by_links_and_records_it(tmp_path):
    run = run_config(write_jsonl_gz(tmp_path / "c.jsonl.gz"))
    prepare.prepare_folder(run, 256, tmp_path / "tok", progress=False)
    summary = prepare.reuse(tmp_path / "tok", run, 256, tmp_path / "run" / "data", tmp_path / "run")
    assert summary[prepare.PREPARED] == str((tmp_path / "tok").resolve())
    for name in data.TOKEN_FILES:
        assert (tmp_path / "run" / "data" / name).read_bytes() == (
            tmp_path / "tok" / name
        ).read_bytes()
    assert data.read_summary(tmp_path / "run" / "data")["train_tokens"] == summary["train_tokens"]
    with pytest.raises(
        ValueError,
        match=r"holds tokens of val_share 0.1, not the run's; train with --val-share 0.1",
    ):
        prepare.reuse(
            tmp_path / "tok", run_config(tmp_path, val_share=0.2), 256, tmp_path / "r2", tmp_path
        )


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
    prepare.prepare_folder(run_config(corpus), 256, tmp_path / "tok", progress=False)
    linked = prepare.run_tokens(
        tmp_path / "a" / "data", tmp_path / "a", 256, run_config(tmp_path / "tok"), False, False
    )
    made = prepare.run_tokens(
        tmp_path / "b" / "data", tmp_path / "b", 256, run_config(corpus), False, False
    )
    assert prepare.PREPARED in linked and prepare.PREPARED not in made
    for name in data.TOKEN_FILES:
        assert (tmp_path / "a" / "data" / name).read_bytes() == (
            tmp_path / "b" / "data" / name
        ).read_bytes()
