"""A run folder's whole life: made and locked, checked, cleared for ``--overwrite``, read back
(:func:`load_run`, which ``octlm.load_run`` is, at the checkpoint :func:`choose` picks).

A run folder holds ``config.json`` (which makes it a run), the token files under ``data/``,
the run's tokenizer, ``metrics.jsonl`` with its picture, the last checkpoints and the best
(named by the metrics), and the lock of
the run that holds it (:mod:`octlm.training.lock`). ``config.json`` is written only once
everything before the first step has worked; until then the folder carries ``PREPARING``, and
a start that did not get that far is cleared by the next one. Whoever holds the lock also
removes what a killed write of a run's own left behind (a checkpoint's temporary file), so
nothing of a crash stays for good.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from octlm.model import ModelConfig, OctLM, is_int_at_least
from octlm.tokenizer import STORING as STORING_TOKENIZER
from octlm.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    with_chat_tokens,
)
from octlm.training import checkpoint, lock, tokens
from octlm.training.base import is_run, step_of, tokenizer_of
from octlm.training.config import (
    CONFIG_FILE,
    RunConfig,
    check_resumable,
    local_device,
    read_file,
    single_process,
    stored_model,
    to_dict,
)
from octlm.training.metrics import METRICS, PICTURE, recorded_best
from octlm.training.prepare import Made, run_tokens

DATA_FOLDER = "data"
# Marks a run folder that octlm made and has not yet brought to its first step.
PREPARING = ".octlm-preparing"
# config.json while it is written (then renamed into place).
STORING = f".{CONFIG_FILE}.tmp"
# Temporary files of a run's own writers, which a killed process leaves behind.
TEMPORARIES = {STORING, STORING_TOKENIZER, f".{METRICS}.tmp"}
# Everything a run writes in its folder, checkpoints aside.
RUN_ENTRIES = {
    CONFIG_FILE,
    PREPARING,
    DATA_FOLDER,
    METRICS,
    PICTURE,
    TOKENIZER_FILE,
    lock.LOCK_FILE,
}
RUN_ENTRIES |= TEMPORARIES


@contextlib.contextmanager
def hold(folder: Path, cluster):
    """The run folder's lock, held by rank 0 of ``cluster`` for the run's life. Every rank
    waits until rank 0 holds it, and all raise its ValueError when it is refused."""
    held = []
    cluster.on_main(lambda: held.append(lock.acquire(folder)))
    try:
        yield
    finally:
        ours = (folder / PREPARING).exists() or (folder / CONFIG_FILE).exists()
        for folder_lock in held:  # rank 0's
            folder_lock.release(keep=ours)


def prepare(
    folder: Path,
    model_config: ModelConfig,
    run: RunConfig,
    resume: bool,
    overwrite: bool,
    progress: bool = False,
    given: frozenset = frozenset(),
) -> Made:
    """Check or create the held run folder and write the token files (saying so on stderr with
    ``progress``: a large corpus takes a while): their summary, and the model and run as a new
    run's ``--tokenizer auto`` settles them (``given``: the fields the user set).

    ``config.json`` is written by :func:`store_config` once the run reaches its first step.
    """
    imported = base = None
    if run.init_from is not None and not resume:  # refused before the folder is touched
        base = tokenizer_of(run.init_from)
        imported = with_chat_tokens(base) if run.chat else base
        if is_run(run.init_from):  # its checkpoint, found before anything is written
            choose(run.init_from, step_of(run.init_step))
    if not resume and _unfinished(folder):  # a start of ours that failed: what it left goes
        shutil.rmtree(folder / DATA_FOLDER, ignore_errors=True)
        for name in (CONFIG_FILE, TOKENIZER_FILE, PREPARING, *TEMPORARIES):
            (folder / name).unlink(missing_ok=True)
    if (folder / CONFIG_FILE).is_file():  # a run's folder: a killed write's leftovers go
        remove_temporaries(folder)
    if resume:
        _check_resumable(folder, model_config, run)
    elif any(entry.name != lock.LOCK_FILE for entry in folder.iterdir()):
        if not overwrite:
            raise ValueError(
                f"run folder {str(folder)!r} is not empty: pass --resume to continue its run "
                "or --overwrite to start it again"
            )
        _check_overwritable(folder)
        for entry in folder.iterdir():  # all but the lock, which this run holds
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            elif entry.name != lock.LOCK_FILE:
                entry.unlink()
    if not resume:  # this folder is empty and ours: marked, so a failed start can be cleared
        (folder / PREPARING).touch()
    # the run keeps the tokenizer its weights were trained with (and the chat tokens)
    source = None if run.init_from is None else Path(run.init_from) / TOKENIZER_FILE
    if imported is base is not None and source.is_file():
        shutil.copyfile(source, folder / TOKENIZER_FILE)  # as it is, byte for byte
    elif imported is not None:
        imported.save(folder)  # nothing for plain bytes
    summary = tokens.read_summary(folder / DATA_FOLDER)
    if summary is None and resume:
        raise ValueError(
            f"--resume: {str(folder / DATA_FOLDER / tokens.SUMMARY)!r} is missing, so the run's "
            "token files cannot be checked; start the run again (--overwrite)"
        )
    made = Made(summary, model_config, run, None)
    if summary is None:
        made = run_tokens(
            folder / DATA_FOLDER,
            folder,
            model_config,
            run,
            given,
            (folder / TOKENIZER_FILE).is_file() and imported is not None,
            progress,
        )
    _check_tokenizer(folder, made.summary, made.model, made.run)
    return made


def _check_resumable(folder: Path, model_config: ModelConfig, run: RunConfig) -> None:
    """Raise ValueError unless ``folder`` holds a run that ``--resume`` can continue as given."""
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"--resume: {str(folder)!r} holds no run (no {CONFIG_FILE})")
    check_resumable(read_file(config_path), model_config, run)
    if checkpoint.latest(folder) is None:
        raise ValueError(
            f"--resume: {str(folder)!r} has no checkpoint to resume from (the run stopped "
            "before its first one): start it again with --overwrite"
        )


def store_config(folder: Path, model_config: ModelConfig, run: RunConfig) -> None:
    """Write ``config.json`` atomically and durably: a temporary file, fsynced, renamed."""
    stored = folder / STORING
    with stored.open("w") as out:
        out.write(json.dumps(to_dict(model_config, run), indent=2) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(stored, folder / CONFIG_FILE)


def begun(folder: Path, model_config: ModelConfig, run: RunConfig) -> None:
    """The start worked up to its first step: the folder becomes a run (``config.json``)."""
    store_config(folder, model_config, run)
    (folder / PREPARING).unlink()


def remove_temporaries(folder: Path) -> list[str]:
    """Delete the temporary files a killed write of the run's own left in ``folder`` (a
    checkpoint's ``.checkpoint-N.pt.<hex>.tmp``, config.json's, metrics'); their names. Only the
    run folder's holder may call it: a live writer's file would go too."""
    removed = []
    for entry in folder.iterdir():
        kind = checkpoint.TEMPORARY.fullmatch(entry.name) or entry.name in TEMPORARIES
        if kind and entry.is_file() and not entry.is_symlink():
            entry.unlink()
            removed.append(entry.name)
    return sorted(removed)


def _check_tokenizer(folder: Path, summary: dict, model_config: ModelConfig, run) -> None:
    """Raise ValueError unless the token files (``data.json``) and the run folder's tokenizer
    are those the run's configuration names: its tokenizer and vocabulary."""
    tokenizer = load_tokenizer(folder)
    expected = (run.tokenizer, model_config.vocab_size)
    found = {
        f"{DATA_FOLDER}/{tokens.SUMMARY}": (summary["tokenizer"], summary["vocab_size"]),
        "the run folder's tokenizer": (tokenizer.name, tokenizer.vocab_size),
    }
    wrong = [
        f"{where} has {name} of {size} tokens"
        for where, (name, size) in found.items()
        if (name, size) != expected
    ]
    if wrong:
        raise ValueError(
            f"run folder {str(folder)!r} is for tokenizer {expected[0]} of vocab_size "
            f"{expected[1]}, but " + " and ".join(wrong) + "; start the run again (--overwrite)"
        )


def _unfinished(folder: Path) -> bool:
    """Whether ``folder`` is a start of octlm's that never reached its first step: marked when
    it was made (empty) and holding nothing but what that start writes."""
    if not (folder / PREPARING).is_file():
        return False
    own = {PREPARING, CONFIG_FILE, TOKENIZER_FILE, DATA_FOLDER, lock.LOCK_FILE, *TEMPORARIES}
    return not _foreign_entries(folder, own)


def _foreign_entries(folder: Path, own: set[str], checkpoints: bool = False) -> list[str]:
    """What in ``folder`` octlm did not write: entries not named in ``own`` (nor checkpoints,
    with ``checkpoints``), files of the data folder that are not token files, and a data
    "folder" that is a file."""
    found = []
    for entry in folder.iterdir():
        if entry.name == DATA_FOLDER:
            if not entry.is_dir():  # a file where the token files go
                found.append(entry.name)
                continue
            inside = (e.name for e in entry.iterdir() if e.name not in tokens.OWN_FILES)
            found += [f"{DATA_FOLDER}/{name}" for name in inside]
        elif entry.name not in own and not (checkpoints and checkpoint.is_own(entry.name)):
            found.append(entry.name)
    return sorted(found)


def _check_overwritable(folder: Path) -> None:
    """Raise ValueError unless ``folder`` is a run of octlm's holding nothing else, so that
    ``--overwrite`` may delete it whole."""
    try:
        stored = read_file(folder / CONFIG_FILE)
    except ValueError:
        stored = {}
    if set(stored) != {"model", "run"}:
        raise ValueError(
            f"--overwrite clears only run folders, and {str(folder)!r} has no octlm {CONFIG_FILE}"
        )
    foreign = _foreign_entries(folder, RUN_ENTRIES, checkpoints=True)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise ValueError(
            f"--overwrite clears only what octlm wrote, and {str(folder)!r} also holds "
            f"{', '.join(foreign[:5])}{more}: "
            "move them out or choose another --out"
        )


# --- read back ---------------------------------------------------------------------------------

BEST, LAST = "best", "last"


class Chosen(NamedTuple):
    """The checkpoint a ``step`` choice picks in a run folder: its file, its step, and how it
    was chosen, in words (``"the best (lowest validation loss)"``, ``"the last"``, ...)."""

    path: Path
    step: int
    how: str


class Run(NamedTuple):
    """A run's model (in eval mode), its tokenizer and the step of the checkpoint loaded."""

    model: OctLM
    tokenizer: ByteTokenizer | BPETokenizer
    step: int


def load_run(folder: str | os.PathLike, device: str = "cpu", *, step: int | str = BEST) -> Run:
    """The model of the run in ``folder`` at its best checkpoint (lowest validation loss), with
    the run's tokenizer; ``step`` takes ``"last"`` or a checkpoint's step instead::

        model, tokenizer, step = octlm.load_run("runs/train")

    A run whose metrics name no best (no evaluation yet, or records without ``best_step``)
    gives its last checkpoint (:func:`choose`)."""
    model, chosen = load_model(folder, device, step=step)
    return Run(model, load_tokenizer(folder), chosen.step)


def choose(folder: str | os.PathLike, step: int | str = BEST) -> Chosen:
    """The checkpoint of ``folder`` that ``step`` names: ``"best"`` (the lowest validation
    loss the run recorded; the last where it recorded none), ``"last"``, or a step it kept;
    ValueError otherwise."""
    folder = Path(folder)
    stored_model(folder)  # a folder that is no run is said as such
    kept = checkpoint.listed(folder)
    if not kept:
        raise ValueError(f"run folder {str(folder)!r} has no checkpoint yet")
    if step == BEST:
        best = recorded_best(folder)
        if best is not None and checkpoint.path_for(folder, best).is_file():
            return Chosen(
                checkpoint.path_for(folder, best), best, "the best (lowest validation loss)"
            )
        return Chosen(kept[-1], checkpoint.step_of(kept[-1]), "the last: the run records no best")
    if step == LAST:
        return Chosen(kept[-1], checkpoint.step_of(kept[-1]), "the last")
    path = checkpoint.path_for(folder, step) if is_int_at_least(step, 0) else None
    if path is None or not path.is_file():
        steps = [checkpoint.step_of(p) for p in kept]
        raise ValueError(
            f"step must be {BEST!r}, {LAST!r} or one of the run's checkpoints {steps}, got {step!r}"
        )
    return Chosen(path, step, "the one asked for")


def load_model(
    folder: str | os.PathLike, device: str = "cpu", *, step: int | str = BEST
) -> tuple[OctLM, Chosen]:
    """The model of a run folder at the checkpoint ``step`` names (:func:`choose`), and that
    choice. A run trained with the Triton kernel runs its PyTorch twin off CUDA (the same
    function); a ring-attention run runs tiled, its one-process twin."""
    chosen = choose(folder, step)
    model_config = stored_model(folder)
    state = checkpoint.load(chosen.path, model_config)
    device = local_device(device)
    config = single_process(model_config)
    if device.type != "cuda" and config.kernel == "triton":  # a GPU run sampled on a CPU
        config = replace(config, kernel="pytorch")  # the same function, in PyTorch
    model = OctLM(config)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), chosen
