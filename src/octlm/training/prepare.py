"""A corpus tokenised once, trained on many times.

:func:`tokenize` is the one preparation: a byte-level BPE learned from (a sample of) the
training split of an opened :class:`~octlm.training.corpus.Corpus`, then every document
encoded into the token files of :mod:`octlm.training.tokens`. A run does it into its own
folder (``data/`` and ``tokenizer.json``); ``octlm prepare --data CORPUS --out TOKENS`` does it
into a token folder of its own (:func:`prepare_folder`), with ``tokenizer.json`` beside
``data.json``.

data.json's ``files`` (each file's relative name, size and modification time), ``formats``,
``glob``, ``val_share`` and tokenizer are the corpus's fingerprint: preparing the same corpus
into the same folder again finds it up to date and writes nothing; a corpus that changed
since is prepared again.

A token folder has the guarantees of a run folder. One ``octlm prepare`` at a time writes it:
it holds ``.TOKENS.lock`` beside the folder (an OS lock, released however the process ends)
and a second is refused naming the holder. The new folder is made as ``.TOKENS.preparing``
and swapped in by two renames (the old one to ``.TOKENS.earlier``, the new one into place);
the next writer finishes a swap that a kill cut short, so the folder is always its old or
its new self. ``octlm train --data TOKENS`` takes the same lock shared while it links the
files (:func:`reuse`), so it gets one whole folder, never a mix of two.

``octlm train --data TOKENS`` reuses a token folder: its files are hard-linked (copied where
links fail) into the run folder's ``data/``, whose data.json records where they came from
(``prepared_from``), so the run folder is whole on its own and resumes, samples and reports as
any other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from octlm.chatml import CHAT_TOKENS
from octlm.model import ModelConfig
from octlm.progress import Progress
from octlm.tokenizer import (
    BYTE_VOCAB,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    with_chat_tokens,
)
from octlm.training import lock, recipe, tokens
from octlm.training.config import RunConfig
from octlm.training.corpus import Corpus
from octlm.training.formats import Formats
from octlm.training.precision import AUTO

PREPARED = "prepared_from"  # data.json of a run's data/: the token folder its files came from
# What a token folder's data.json must match for the corpus and options given.
FINGERPRINT = ("files", "glob", "val_share", "formats", "tokenizer", "vocab_size")


def is_prepared(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a token folder: a folder holding data.json and token files (or one
    whose swap a killed ``octlm prepare`` left half done, which this completes)."""
    if path is None:
        return False
    path = Path(path)
    if not path.exists() and _beside(path, "earlier").is_dir():
        with _held(path, fcntl.LOCK_EX, wait=True):
            _finish_swap(path)
    return all((path / name).is_file() for name in (tokens.SUMMARY, *tokens.TOKEN_FILES))


def say(line: str, progress: bool) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


class Made(NamedTuple):
    """Token files made for a run: their summary, and the model and run as the tokens settled
    them (``--tokenizer auto``'s choice), with what auto chose and why (None: nothing)."""

    summary: dict
    model: ModelConfig
    run: RunConfig
    said: str | None


def make_tokens(
    found: Corpus,
    data_folder: Path,
    tokenizer_folder: Path,
    model: ModelConfig,
    run: RunConfig,
    given: frozenset = frozenset(),
    *,
    progress: bool = True,
) -> Made:
    """The corpus ``found`` tokenised into ``data_folder`` as ``run`` asks: bytes, or a BPE of
    ``model.vocab_size`` tokens learned here and saved in ``tokenizer_folder``; with
    ``--tokenizer auto``, as :mod:`octlm.training.recipe`'s rule settles it (``given``: the
    fields the user set, which auto keeps)."""
    auto, said = run.tokenizer == AUTO, None
    if auto:
        size = round(found.estimated_bytes * (1 - found.val_share))
        name, why = recipe.tokenizer_for(run, model, given, size)
        settled, run, rows = recipe.with_tokenizer(model, run, given, name, None)
    else:
        settled, rows, why = model, "", ""
    tokenizer, learned = ByteTokenizer(), None
    if run.tokenizer == "bpe":
        try:
            tokenizer, learned = learn_bpe(
                found, settled.vocab_size, run.tokenizer_sample, progress
            )
        except Unreachable:
            if not auto or "vocab_size" in given or model.vocab_size != BYTE_VOCAB:
                raise
            why = f"{why}, but the training text cannot reach a BPE of {settled.vocab_size:,}"
            settled, run, rows = recipe.with_tokenizer(model, run, given, "bytes", None)
    if run.chat:  # learned or bytes, with the chat tokens after its last id
        tokenizer = with_chat_tokens(tokenizer)
        settled = replace(settled, vocab_size=tokenizer.vocab_size)
    summary = tokenize(found, data_folder, tokenizer, limit=chat_limit(run), progress=progress)
    if run.chat or learned is not None:
        _note_bpe(summary, data_folder, run.tokenizer_sample, learned)
        tokenizer.save(tokenizer_folder)
    if auto:
        settled, run, fit = recipe.fitted(settled, run, given, summary["val_tokens"])
        said = f"--tokenizer {run.tokenizer} (auto: {why}){rows}{fit}"
    return Made(summary, settled, run, said)


class Unreachable(ValueError):
    """A BPE's vocabulary that its training text cannot reach."""


def learn_bpe(found: Corpus, vocab_size: int, sample: int, progress: bool) -> tuple:
    """A byte-level BPE of ``vocab_size`` tokens learned from the training split of ``found``
    (up to ``sample`` bytes of it; 0: all), and the bytes it read; :class:`Unreachable` where
    the text cannot reach that vocabulary, ValueError where the corpus cannot be split."""
    texts = found.training_texts(sample or None)  # the files checked before anything is said
    size = found.estimated_bytes
    sampled = f", a sample of {sample / 1e6:,.0f} MB" if sample and size > sample else ""
    say(f"training a byte-level BPE of {vocab_size:,} tokens on {found.root}{sampled}", progress)
    learned = [0]
    with Progress("learning the BPE from", min(size, sample or size), "B", enabled=progress) as bar:
        try:
            tokenizer = BPETokenizer.train(_counted(texts, bar, learned), vocab_size)
        except ValueError as error:  # a corpus too small for the vocabulary
            raise Unreachable(f"{error}; or --tokenizer bytes, which learns nothing") from None
    return tokenizer, learned[0]


def tokenize(
    found: Corpus,
    data_folder: Path,
    tokenizer: ByteTokenizer | BPETokenizer,
    *,
    limit: int | None = None,
    progress: bool = True,
) -> dict:
    """The corpus ``found`` encoded by ``tokenizer`` into ``data_folder`` (conversations cut
    to ``limit`` tokens); the summary."""
    with Progress(f"tokenising {found.root}", found.estimated_bytes, "B", enabled=progress) as bar:
        return tokens.write_tokens(found, data_folder, tokenizer, bar.update, limit)


def chat_limit(run: RunConfig) -> int | None:
    """The tokens a conversation may keep in ``run``: a packed row's inputs and its last
    target; None for plain documents."""
    return run.length + 1 if run.chat else None


def _note_bpe(summary: dict, data_folder: Path, sample: int, learned: int) -> None:
    """Record in ``data_folder``'s data.json how much text the BPE of ``summary`` learned from."""
    summary["tokenizer_sample"] = sample
    summary["tokenizer_learned_bytes"] = learned
    tokens.write_summary(data_folder, summary)


def _counted(texts: Iterator[bytes], bar: Progress, total: list[int]) -> Iterator[bytes]:
    for text in texts:
        bar.update(len(text))
        total[0] += len(text)
        yield text


def changes(
    folder: Path, found: Corpus, tokenizer: str, vocab_size: int, limit: int | None = None
) -> list[str]:
    """How the corpus ``found`` and the tokens asked for differ from those ``folder``'s tokens
    were prepared from (its data.json's fingerprint, and the length conversations were cut to:
    ``limit``); none when it is up to date."""
    summary = tokens.read_summary(folder)
    if limit is not None and (summary.get("chat") or {}).get("limit") != limit:
        return [f"conversations cut to {limit} tokens"]
    now = {"files": found.fingerprint, "glob": found.glob, "val_share": found.val_share}
    now |= {"formats": found.options, "tokenizer": tokenizer, "vocab_size": vocab_size}
    differ = [name for name in FINGERPRINT if summary.get(name) != now[name]]
    if "files" in differ:
        was = {f[0]: f[1:] for f in summary.get("files") or []}
        names = [f[0] for f in now["files"] if was.pop(f[0], None) != f[1:]] + list(was)
        differ[differ.index("files")] = f"files ({', '.join(names[:3])}{'...' * (len(names) > 3)})"
    return differ


def _beside(out: Path, what: str) -> Path:
    """The hidden sibling of the token folder ``out``: its lock, or a folder of a swap."""
    return out.with_name(f".{out.name}.{what}")


@contextlib.contextmanager
def _held(out: Path, mode: int, wait: bool) -> Iterator[None]:
    """The lock beside the token folder ``out``: exclusive for its writer (a second one is
    refused naming the holder, unless ``wait``), shared for a run linking its files."""
    path = _beside(out, "lock")
    path.parent.mkdir(parents=True, exist_ok=True)

    def refused(holder: str) -> ValueError:
        return ValueError(
            f"token folder {str(out)!r} is in use by process {holder} (another octlm prepare, "
            "or a run linking its files): wait for it to end"
        )

    try:
        descriptor = lock.locked(path, mode, refused)
    except ValueError:
        if not wait:
            raise
        say(f"waiting for process {lock.holder(path)}, which prepares {out}", True)
        descriptor = lock.locked(path, mode, None)
    try:
        yield
    finally:
        if mode == fcntl.LOCK_EX:
            path.unlink(missing_ok=True)  # still locked: a waiting process tries afresh
        os.close(descriptor)


def _finish_swap(out: Path) -> None:
    """What a writer killed mid-swap left, put right (under the writer's lock): the old
    folder back where the new one never arrived, else the old one removed; a half-made new
    one removed."""
    earlier = _beside(out, "earlier")
    if earlier.is_dir() and not out.exists():
        os.replace(earlier, out)
    shutil.rmtree(earlier, ignore_errors=True)
    shutil.rmtree(_beside(out, "preparing"), ignore_errors=True)


def prepare_folder(
    out: str | os.PathLike,
    found: Corpus,
    model: ModelConfig,
    run: RunConfig,
    given: frozenset = frozenset(),
    progress: bool = True,
) -> Made:
    """``octlm prepare``: the corpus ``found`` tokenised as ``run`` and ``model`` ask
    (:func:`make_tokens`) into the token folder ``out``, unless it holds them already, up to
    date (with ``--tokenizer auto`` and no ``--vocab-size``, whatever tokens it holds). One
    writer at a time; ``out`` is its old or its new self whatever stops this."""
    out = Path(out)
    with _held(out, fcntl.LOCK_EX, wait=False):
        _finish_swap(out)
        if out.exists() and not is_prepared(out) and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(
                f"--out {str(out)!r} exists and is no token folder of octlm prepare; choose another"
            )
        if is_prepared(out):
            summary = tokens.read_summary(out)
            # a conversation folder's BPE has the chat tokens too (a byte run's vocab has them)
            chat = len(CHAT_TOKENS) * (run.chat and run.tokenizer != "bytes")
            wanted = (run.tokenizer, model.vocab_size + chat)
            if run.tokenizer == AUTO and "vocab_size" in given:  # auto takes what it names
                named = "bytes" if model.vocab_size == BYTE_VOCAB else "bpe"
                wanted = (named, model.vocab_size + chat)
            elif run.tokenizer == AUTO:
                wanted = (summary["tokenizer"], summary["vocab_size"])
            differ = changes(out, found, *wanted, limit=chat_limit(run))
            if not differ:
                say(f"{out} is up to date with {found.root}: nothing to prepare", progress)
                return Made(summary, model, run, None)
            say(f"{out} was prepared from other data ({'; '.join(differ)}): preparing again", True)
        making = _beside(out, "preparing")
        try:
            made = make_tokens(found, making, making, model, run, given, progress=progress)
            earlier = _beside(out, "earlier")
            if out.exists():
                os.replace(out, earlier)
            os.replace(making, out)
            shutil.rmtree(earlier, ignore_errors=True)
        except BaseException:
            shutil.rmtree(making, ignore_errors=True)
            raise
    return made


def run_tokens(
    data_folder: Path,
    run_folder: Path,
    model: ModelConfig,
    run: RunConfig,
    given: frozenset,
    imported: bool,
    progress: bool,
) -> Made:
    """A new run's token files in ``data_folder``: linked from the token folder ``run.data``
    names, or its corpus tokenised there (by the tokenizer already in ``run_folder`` when
    ``imported``, else by the run's own, saved there)."""
    if is_prepared(run.data):
        ours = run_folder / TOKENIZER_FILE
        theirs = Path(run.data) / TOKENIZER_FILE
        if imported and not (theirs.is_file() and theirs.read_bytes() == ours.read_bytes()):
            raise ValueError(
                f"--init-from brings its own tokenizer, and the token folder {run.data!r} was "
                "prepared with another: give --data the corpus, or prepare it with --init-from"
            )
        return reuse(Path(run.data), model, run, given, data_folder, run_folder, progress)
    found = Corpus.of(run)
    if not imported:
        return make_tokens(found, data_folder, run_folder, model, run, given, progress=progress)
    tokenizer = BPETokenizer.from_file(run_folder / TOKENIZER_FILE)
    summary = tokenize(found, data_folder, tokenizer, limit=chat_limit(run), progress=progress)
    return Made(summary, model, run, None)


def reuse(
    prepared: Path,
    model: ModelConfig,
    run: RunConfig,
    given: frozenset,
    data_folder: Path,
    tokenizer_folder: Path,
    progress: bool = True,
) -> Made:
    """The token folder ``prepared`` linked into a run's ``data_folder`` (its tokenizer copied
    into ``tokenizer_folder``) under its lock, shared, so a prepare cannot swap it meanwhile.
    ``--tokenizer auto`` takes the folder's tokens. ValueError when they are not those the run
    asks for (tokenizer, vocabulary, validation share)."""
    prepared, said = Path(prepared), None
    with _held(prepared, fcntl.LOCK_SH, wait=True):
        summary = tokens.read_summary(prepared)
        if run.tokenizer == AUTO:
            vocab = None if "vocab_size" in given else summary["vocab_size"]
            model, run, rows = recipe.with_tokenizer(model, run, given, summary["tokenizer"], vocab)
            said = f"--tokenizer {run.tokenizer} (auto: the tokens of {prepared}){rows}"
        chat = summary.get("chat")
        if run.chat != (chat is not None):
            held = "conversations" if chat is not None else "plain documents"
            raise ValueError(
                f"--data {str(prepared)!r} holds {held}: "
                + ("train on it with --chat" if chat is not None else "give --chat conversations")
            )
        if chat is not None and chat["limit"] is not None and chat["limit"] > chat_limit(run):
            raise ValueError(
                f"--data {str(prepared)!r} keeps conversations of up to {chat['limit']} tokens, "
                f"longer than rows of --length {run.length}: prepare it with --length {run.length}"
            )
        wanted = {"tokenizer": run.tokenizer, "vocab_size": model.vocab_size}
        wanted["val_share"] = run.val_share
        wrong = {name: value for name, value in wanted.items() if summary.get(name) != value}
        if wrong:
            found = ", ".join(f"{name} {summary.get(name)}" for name in wrong)
            flags = " ".join(f"--{name.replace('_', '-')} {summary.get(name)}" for name in wrong)
            raise ValueError(
                f"--data {str(prepared)!r} holds tokens of {found}, not the run's; train with "
                f"{flags}, or prepare the corpus again with the run's options"
            )
        _note_changes(prepared, summary)
        data_folder.mkdir(parents=True, exist_ok=True)
        for name in tokens.TOKEN_FILES + tokens.MASK_FILES * ("chat" in summary):
            _link(prepared / name, data_folder / name)
        if (prepared / TOKENIZER_FILE).is_file():
            _put(prepared / TOKENIZER_FILE, tokenizer_folder / TOKENIZER_FILE, shutil.copyfile)
    summary[PREPARED] = str(prepared.resolve())
    tokens.write_summary(data_folder, summary)
    say(f"tokens from {prepared}", progress)
    return Made(summary, model, run, said)


def _note_changes(prepared: Path, summary: dict) -> None:
    """Say so where the corpus a token folder was prepared from changed since."""
    source = Path(summary["source"])
    if "files" not in summary or not source.exists():
        return
    try:
        found = Corpus.open(
            source, summary["glob"], summary["val_share"], Formats(**summary["formats"])
        )
    except ValueError:  # its files are gone: the tokens are what there is
        return
    differ = changes(prepared, found, summary["tokenizer"], summary["vocab_size"])
    if differ:
        say(
            f"note: {source} changed since {prepared} was prepared ({'; '.join(differ)}); "
            "training on the tokens as prepared (octlm prepare again to update them)",
            True,
        )


def _link(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` (a copy where links fail)."""
    try:
        _put(source, target, os.link)
    except OSError:
        _put(source, target, shutil.copyfile)


def _put(source: Path, target: Path, how: Callable[[Path, Path], object]) -> None:
    """``source`` put at ``target`` by ``how`` (a link or a copy) under a temporary name."""
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.unlink(missing_ok=True)
    how(source, temporary)
    os.replace(temporary, target)
