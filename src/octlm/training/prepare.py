"""A corpus tokenised once, trained on many times.

:func:`tokenize` is the one preparation: a byte-level BPE learned from (a sample of) the
training split, then every document encoded into the token files of
:mod:`octlm.training.data`. A run does it into its own folder (``data/`` and
``tokenizer.json``); ``octlm prepare --data CORPUS --out TOKENS`` does it into a token folder
of its own (:func:`prepare_folder`), with ``tokenizer.json`` beside ``data.json``.

data.json's ``files`` (each file's relative name, size and modification time), ``formats``,
``glob``, ``val_share`` and tokenizer are the corpus's fingerprint: preparing the same corpus
into the same folder again finds it up to date and writes nothing; a corpus that changed
since is prepared again, the earlier folder kept whole until the new one is.

``octlm train --data TOKENS`` reuses a token folder (:func:`reuse`): its files are hard-linked
(copied where links fail) into the run folder's ``data/``, whose data.json records where they
came from (``prepared_from``), so the run folder is whole on its own and resumes, samples and
reports as any other.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from octlm.progress import Progress
from octlm.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer
from octlm.training import data

PREPARED = "prepared_from"  # data.json of a run's data/: the token folder its files came from
# What a token folder's data.json must match for the corpus and options given.
FINGERPRINT = ("files", "glob", "val_share", "formats", "tokenizer", "vocab_size")


def corpus_of(run) -> tuple[Path, str]:
    """The corpus a run names and the glob of its files: ``--data`` (every format by default),
    or this Python's standard library."""
    if run.data is None:
        root, glob = data.default_corpus()
        return root, run.glob or glob
    return Path(run.data), run.glob or data.DEFAULT_GLOB


def formats_of(run) -> data.Formats:
    return data.Formats(run.text_field, run.separator)


def is_prepared(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a token folder: a folder holding data.json and token files."""
    return path is not None and all(
        (Path(path) / name).is_file() for name in (data.SUMMARY, *data.TOKEN_FILES)
    )


def say(line: str, progress: bool) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def tokenize(
    run,
    vocab_size: int,
    data_folder: Path,
    tokenizer_folder: Path,
    *,
    tokenizer: BPETokenizer | None = None,
    progress: bool = True,
) -> dict:
    """The corpus of ``run`` tokenised into ``data_folder`` by ``tokenizer``, or by the run's
    own: bytes, or a BPE of ``vocab_size`` tokens learned here from the training split (up to
    ``run.tokenizer_sample`` bytes of it) and saved in ``tokenizer_folder``; the summary."""
    source, glob = corpus_of(run)
    formats = formats_of(run)
    sample = run.tokenizer_sample or None
    learned = None
    if tokenizer is None and run.tokenizer == "bpe":
        texts = data.training_texts(source, glob, run.val_share, formats=formats, sample=sample)
        found = data.Corpus.open(source, glob, run.val_share, formats)
        size = data.estimated_bytes(found)
        sampled = f", a sample of {sample / 1e6:,.0f} MB" if sample and size > sample else ""
        say(f"training a byte-level BPE of {vocab_size:,} tokens on {source}{sampled}", progress)
        learned = [0]
        total = min(size, sample) if sample else size
        with Progress("learning the BPE from", total, "B", enabled=progress) as bar:
            try:
                tokenizer = BPETokenizer.train(_counted(texts, bar, learned), vocab_size)
            except ValueError as error:  # a corpus too small for the vocabulary
                raise ValueError(f"{error}; or --tokenizer bytes, which learns nothing") from None
    elif tokenizer is None:
        tokenizer = ByteTokenizer()
    found = data.Corpus.open(source, glob, run.val_share, formats)
    with Progress(
        f"tokenising {source}", data.estimated_bytes(found), "B", enabled=progress
    ) as bar:
        summary = data.write_tokens(
            source, glob, run.val_share, data_folder, tokenizer, bar.update, formats=formats
        )
    if learned is not None:
        summary["tokenizer_sample"] = run.tokenizer_sample
        summary["tokenizer_learned_bytes"] = learned[0]
        data.write_summary(data_folder, summary)
        tokenizer.save(tokenizer_folder)
    return summary


def _counted(texts: Iterator[bytes], bar: Progress, total: list[int]) -> Iterator[bytes]:
    for text in texts:
        bar.update(len(text))
        total[0] += len(text)
        yield text


def status(summary: dict) -> str:
    """One line on what a preparation made: documents, skipped ones, tokens, the split."""
    documents = summary["train_documents"] + summary["val_documents"]
    size = (summary["train_bytes"] + summary["val_bytes"]) / 1e6
    tokens = summary["train_tokens"] + summary["val_tokens"]
    skipped = f" ({summary['empty_skipped']:,} empty skipped)" if summary["empty_skipped"] else ""
    rule = data.RULES.get(summary.get("split", "file"), "")
    share = 100 * data.held_out_share(summary)
    return (
        f"data: {documents:,} documents{skipped}, {size:,.1f} MB -> {tokens:,} tokens; "
        f"validation {summary['val_documents']:,} documents, {share:.1f}% of bytes "
        f"(--val-share {summary['val_share']}), by {rule}"
    )


def changes(folder: Path, run, vocab_size: int) -> list[str]:
    """How the corpus and options of ``run`` differ from those ``folder``'s tokens were
    prepared from (its data.json's fingerprint); none when it is up to date."""
    summary = data.read_summary(folder)
    source, glob = corpus_of(run)
    found = data.Corpus.open(source, glob, run.val_share, formats_of(run))
    now = {"files": data.fingerprint(found), "glob": glob, "val_share": run.val_share}
    now |= {"formats": data.options_of(found), "tokenizer": run.tokenizer}
    now["vocab_size"] = vocab_size
    differ = [name for name in FINGERPRINT if summary.get(name) != now[name]]
    if "files" in differ:
        was = {f[0]: f[1:] for f in summary.get("files") or []}
        names = [f[0] for f in now["files"] if was.pop(f[0], None) != f[1:]] + list(was)
        differ[differ.index("files")] = f"files ({', '.join(names[:3])}{'...' * (len(names) > 3)})"
    return differ


def prepare_folder(run, vocab_size: int, out: str | os.PathLike, progress: bool = True) -> dict:
    """``octlm prepare``: the corpus of ``run`` tokenised into the token folder ``out``, unless
    it is there already, up to date; its summary. ``out`` is written under another name and
    renamed into place once whole, so an error or a signal leaves an earlier folder as it was."""
    out = Path(out)
    if out.exists() and not is_prepared(out) and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"--out {str(out)!r} exists and is no token folder of octlm prepare; choose another"
        )
    if is_prepared(out):
        differ = changes(out, run, vocab_size)
        if not differ:
            say(f"{out} is up to date with {corpus_of(run)[0]}: nothing to prepare", progress)
            return data.read_summary(out)
        say(f"{out} was prepared from other data ({'; '.join(differ)}): preparing again", progress)
    making = out.with_name(f".{out.name}.preparing")
    shutil.rmtree(making, ignore_errors=True)  # what a killed preparation left
    try:
        summary = tokenize(run, vocab_size, making, making, progress=progress)
        say(status(summary), progress)
        earlier = out.with_name(f".{out.name}.earlier")
        if out.exists():
            os.replace(out, earlier)
        os.replace(making, out)
        shutil.rmtree(earlier, ignore_errors=True)
    except BaseException:
        shutil.rmtree(making, ignore_errors=True)
        raise
    return summary


def reuse(
    prepared: Path, run, vocab_size: int, data_folder: Path, tokenizer_folder: Path, progress=True
) -> dict:
    """The token folder ``prepared`` linked into a run's ``data_folder`` (its tokenizer copied
    into ``tokenizer_folder``); the summary. ValueError when its tokens are not those the run
    asks for (tokenizer, vocabulary, validation share)."""
    prepared = Path(prepared)
    summary = data.read_summary(prepared)
    wanted = {"tokenizer": run.tokenizer, "vocab_size": vocab_size, "val_share": run.val_share}
    wrong = {name: value for name, value in wanted.items() if summary.get(name) != value}
    if wrong:
        found = ", ".join(f"{name} {summary.get(name)}" for name in wrong)
        flags = " ".join(f"--{name.replace('_', '-')} {summary.get(name)}" for name in wrong)
        raise ValueError(
            f"--data {str(prepared)!r} holds tokens of {found}, not the run's; train with "
            f"{flags}, or prepare the corpus again with the run's options"
        )
    source = Path(summary["source"])
    if "files" in summary and source.exists():
        run_of_source = dataclasses.replace(
            run, data=str(source), glob=summary["glob"], **summary["formats"]
        )
        differ = changes(prepared, run_of_source, vocab_size)
        if differ:
            say(
                f"note: {source} changed since {prepared} was prepared ({'; '.join(differ)}); "
                "training on the tokens as prepared (octlm prepare again to update them)",
                True,
            )
    data_folder.mkdir(parents=True, exist_ok=True)
    for name in data.TOKEN_FILES:
        _link(prepared / name, data_folder / name)
    if (prepared / TOKENIZER_FILE).is_file():
        _link(prepared / TOKENIZER_FILE, tokenizer_folder / TOKENIZER_FILE, copy=True)
    summary[PREPARED] = str(prepared.resolve())
    data.write_summary(data_folder, summary)
    say(f"tokens from {prepared}", progress)
    return summary


def _link(source: Path, target: Path, copy: bool = False) -> None:
    """``target`` as a hard link to ``source`` (a copy where links fail, or with ``copy``),
    put in place under a temporary name."""
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.unlink(missing_ok=True)
    try:
        if copy:
            raise OSError("a copy is asked for")
        os.link(source, temporary)
    except OSError:
        shutil.copyfile(source, temporary)
    os.replace(temporary, target)


def run_tokens(
    data_folder: Path, run_folder: Path, vocab_size: int, run, imported: bool, progress: bool
) -> dict:
    """A run's token files in ``data_folder``: linked from the token folder ``run.data`` names,
    or the corpus tokenised there (by the tokenizer already in ``run_folder`` when
    ``imported``, else by the run's own, saved there); the summary."""
    if is_prepared(run.data):
        if imported:
            raise ValueError(
                f"--init-from brings its own tokenizer: give --data the corpus, not the token "
                f"folder {run.data!r}"
            )
        return reuse(Path(run.data), run, vocab_size, data_folder, run_folder, progress)
    tokenizer = BPETokenizer.from_file(run_folder / TOKENIZER_FILE) if imported else None
    return tokenize(
        run, vocab_size, data_folder, run_folder, tokenizer=tokenizer, progress=progress
    )
