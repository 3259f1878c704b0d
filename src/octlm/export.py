"""``octlm export``: a run (at its latest or a given checkpoint) or a model file as a
transformers folder that loads with no octlm installed.

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``); docs/transformers.md says what maps
to what. It is written beside ``out`` under a hidden name and renamed into place once whole,
so ``out`` is absent or complete: a failed or interrupted export (Ctrl-C, SIGTERM, SIGHUP)
leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import NamedTuple

from octlm.integrations import llama_format, tokenizer_files
from octlm.model import OctLM
from octlm.run_folder import load_model
from octlm.tokenizer import TOKENIZER_FILE

BYTES = "bytes"  # the tokenizer of a byte model: ids are the UTF-8 bytes


class Exported(NamedTuple):
    """What :func:`export` wrote: the folder, the class transformers builds from it, the
    checkpoint's step (None for a model file) and the tokenizer (``"bytes"``, ``"bpe"`` or
    None)."""

    folder: Path
    architecture: str
    step: int | None
    tokenizer: str | None


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP during an export, which then removes what it had written."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def export(
    source: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None
) -> Exported:
    """Write the model of ``source`` (a run folder, or a file saved with ``OctLM.save``) to the
    new folder ``out``; ``step`` picks a run's checkpoint (default: its latest).

    A run's tokenizer goes with it (its ``tokenizer.json``, else bytes); a model file has bytes
    as its tokenizer when its vocabulary is 256, and none otherwise.
    """
    source = Path(source)
    if source.is_dir():
        model, step = load_model(source, step=step)
        bpe = source / TOKENIZER_FILE
        tokenizer = bpe if bpe.is_file() else BYTES
    elif source.is_file():
        if step is not None:
            raise ValueError(
                f"step picks a checkpoint of a run folder, and {str(source)!r} is a model file"
            )
        model = OctLM.load(source)
        tokenizer = BYTES if model.config.vocab_size == tokenizer_files.BYTES else None
    else:
        raise ValueError(
            f"{str(source)!r} does not exist: expected a run folder or a model file saved with "
            "OctLM.save"
        )
    folder = export_model(model, out, tokenizer=tokenizer)
    kind = None if tokenizer is None else BYTES if tokenizer == BYTES else "bpe"
    architecture = llama_format.FAMILY["mistral" if model.config.window else "llama"]
    return Exported(folder, architecture, step, kind)


def export_model(
    model: OctLM, out: str | os.PathLike, *, tokenizer: str | os.PathLike | None = BYTES
) -> Path:
    """Write ``model`` to the new folder ``out`` as transformers' Llama (Mistral with a window),
    weights in their dtype, with ``tokenizer``: ``"bytes"``, the path of a BPE
    ``tokenizer.json``, or None for no tokenizer files. Returns ``out``."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"out {str(out)!r} exists and is not an empty folder: choose a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _signals_interrupt():
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
        try:
            _permissions_of_a_new_folder(staging)
            llama_format.write(staging, model.config, model.state_dict())
            if tokenizer is not None:
                bpe = None if tokenizer == BYTES else tokenizer
                tokenizer_files.write(staging, bpe, model.config.max_length)
            for file in staging.iterdir():
                _sync(file)
            os.replace(staging, out)  # replaces an empty folder; then the folder is whole
            _sync(out.parent)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out


def _permissions_of_a_new_folder(folder: Path) -> None:
    """mkdtemp makes a folder only its owner may read; the export is an ordinary folder."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def _signals_interrupt():
    """SIGTERM and SIGHUP raise :class:`Interrupted` (as Ctrl-C raises KeyboardInterrupt), so
    the export removes its staging folder before the process ends."""

    def handler(signum, _frame):
        raise Interrupted(signum)

    try:
        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
