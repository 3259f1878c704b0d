"""The model file: what :meth:`OctLM.save <octlm.model.OctLM.save>` writes and
:meth:`OctLM.load <octlm.model.OctLM.load>` reads, written atomically and checked by a checksum.

A model file is one ``torch.save`` of ``{"format", "sha256", "state_dict"}``; the state dict
carries the model's config as ``_extra_state``. :func:`checksum` also serves the training
checkpoints (:mod:`octlm.training.checkpoint`), whose state nests.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import torch
from torch import Tensor

FILE_FORMAT = "octlm.OctLM/1"


def write_model(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` (a model's state dict) and its checksum to ``path``, atomically
    (:func:`save_atomically`)."""
    save_atomically({"format": FILE_FORMAT, "sha256": checksum(state), "state_dict": state}, path)


def save_atomically(contents: object, path: str | os.PathLike) -> None:
    """``torch.save(contents)`` to ``path`` so that a crash leaves the old file or the new one.

    The file is written beside ``path`` as ``.NAME.XXXXXXXX.tmp`` (with the permissions the
    umask gives a new file), fsynced and renamed over it, and the rename is fsynced too. A
    write that fails (a full disk, say) removes the temporary file and raises ``OSError``
    naming ``path`` and the reason: torch's zip writer reports the failed write as a
    ``RuntimeError`` of its own, with the ``OSError`` as its context.
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as out:
            torch.save(contents, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a crash
        finally:
            os.close(directory)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        cause = error if isinstance(error, Exception) else None  # an interrupt stays one
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise OSError(cause.errno, f"cannot write {str(path)!r}: {cause.strerror}") from error


def read_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """The state dict :func:`write_model` wrote to ``path``; a ``ValueError`` for a file that
    is torn, corrupted or not an octlm model, the ``OSError`` for one that is missing."""
    try:
        contents = torch.load(path, map_location=map_location, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise  # the file is missing or unreadable, not damaged
    except Exception as error:  # torch reports a damaged file in many ways, OSError among them
        raise ValueError(
            f"cannot read an octlm model from {str(path)!r} (torn or corrupted file?): "
            f"{type(error).__name__}: {str(error)[:200]}"
        ) from error
    if not isinstance(contents, dict) or contents.get("format") != FILE_FORMAT:
        raise ValueError(f"{str(path)!r} is not an octlm model file written by OctLM.save")
    state = contents.get("state_dict")
    if not isinstance(state, dict) or checksum(state) != contents.get("sha256"):
        raise ValueError(f"{str(path)!r} is corrupted: its checksum does not match")
    return state


def checksum(state: dict, *, nested: bool = False) -> str:
    """SHA-256 over every entry of a state dict: names, dtypes, shapes and bytes; any other
    value by its ``repr``. With ``nested``, dicts, lists and tuples are walked into (a training
    checkpoint's optimizer state), since a ``repr`` shows a large tensor only in part. Model
    files use the flat digest they were always saved with."""
    digest = hashlib.sha256()
    _digest_entries(digest, state, nested)
    return digest.hexdigest()


def _digest_entries(digest, state: dict, nested: bool) -> None:
    for name in sorted(state, key=str):
        digest.update(str(name).encode())
        _digest_value(digest, state[name], nested)


def _digest_value(digest, value, nested: bool) -> None:
    if isinstance(value, Tensor):
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        flat = value.detach().cpu().contiguous().view(-1).view(torch.uint8)  # raw bytes
        digest.update(flat.numpy())
    elif nested and isinstance(value, dict):
        digest.update(f"{{{len(value)}".encode())
        _digest_entries(digest, value, nested)
    elif nested and isinstance(value, list | tuple):
        digest.update(f"[{len(value)}".encode())
        for item in value:
            _digest_value(digest, item, nested)
    else:
        digest.update(repr(value).encode())
