"""Checkpoints: written atomically, the last few and the best kept, checked when read back.

A checkpoint is one ``torch.save`` file, ``checkpoint-STEP.pt`` in the run folder, holding the
full (unsharded) model and optimizer state keyed by parameter name, so a checkpoint of one
process, of DDP or of FSDP loads the same way, in one process or many. It carries a SHA-256 of
everything in it, checked when it is read: a flipped bit is refused, not trained on. It is
written by :func:`octlm.files.save_atomically`: a crash leaves either the old set of checkpoints
or the new one, never a torn file under a checkpoint's name, and a failed write (a full disk)
leaves no temporary file and raises ``OSError`` naming the checkpoint.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from pathlib import Path

import torch

from octlm.files import checksum, save_atomically
from octlm.model import INTERCHANGEABLE, ModelConfig, saved_config

FORMAT = "octlm-train-1"
PATTERN = re.compile(r"checkpoint-(\d+)\.pt")
TEMPORARY = re.compile(r"\.checkpoint-(\d+)\.pt\.(\w+\.)?tmp")  # save_atomically's


def path_for(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"checkpoint-{step:07d}.pt"


def listed(folder: str | os.PathLike) -> list[Path]:
    """The run folder's checkpoints, oldest first."""
    found = [p for p in Path(folder).glob("checkpoint-*.pt") if PATTERN.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(PATTERN.fullmatch(p.name).group(1)))


def is_own(name: str) -> bool:
    """Whether a file name is one :func:`save` writes: a checkpoint or its temporary file."""
    return bool(PATTERN.fullmatch(name) or TEMPORARY.fullmatch(name))


def step_of(path: Path) -> int:
    """The step of a checkpoint's file."""
    return int(PATTERN.fullmatch(path.name)[1])


def latest(folder: str | os.PathLike) -> Path | None:
    found = listed(folder)
    return found[-1] if found else None


def save(
    folder: str | os.PathLike, step: int, state: dict, keep: int, best: int | None = None
) -> Path:
    """Write the checkpoint of ``step`` atomically, then :func:`prune` the folder."""
    final = path_for(folder, step)
    contents = {"format": FORMAT, "step": step, **state}
    save_atomically({**contents, "sha256": checksum(contents, nested=True)}, final)
    prune(folder, keep, best)
    return final


def prune(folder: str | os.PathLike, keep: int, best: int | None = None) -> None:
    """Delete every checkpoint but the last ``keep`` and the one of step ``best`` (the run's
    lowest validation loss)."""
    kept = None if best is None else path_for(folder, best)
    for old in listed(folder)[:-keep]:
        if old != kept:
            old.unlink()


def load(path: str | os.PathLike, model_config: ModelConfig) -> dict:
    """Read a checkpoint and check it was written for ``model_config``; ValueError otherwise."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch reports a torn or foreign file in many ways
        raise ValueError(
            f"checkpoint {str(path)!r} is corrupted or not an octlm checkpoint "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "an earlier checkpoint in the folder may still load"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(path)!r} is not an {FORMAT} checkpoint")
    digest = state.pop("sha256", None)  # None: written before checkpoints carried one
    if digest is not None and checksum(state, nested=True) != digest:
        raise ValueError(
            f"checkpoint {str(path)!r} is corrupted: its checksum does not match; an earlier "
            "checkpoint in the folder may still load"
        )
    expected = asdict(model_config)
    # Resolved like the config it is checked against: a field the checkpoint predates has its
    # default, derived from the stored sizes where the default is derived (mlp_width).
    stored = asdict(saved_config({"config": state["model_config"]}))
    differences = [
        f"{name} {stored.get(name)!r} (expected {value!r})"
        for name, value in expected.items()
        if name not in INTERCHANGEABLE and _normal(stored.get(name)) != _normal(value)
    ]
    if differences:
        raise ValueError(
            f"checkpoint {str(path)!r} was written for another model: " + ", ".join(differences)
        )
    return state


def _normal(value):
    """Tuples and lists compare equal (a block pair may come back from JSON as a list)."""
    return list(value) if isinstance(value, tuple | list) else value
