"""One process at a time in a run folder (or a token folder): an OS lock on a file, held for
the writer's life.

``fcntl.flock`` on ``RUN/.octlm-lock``. The kernel releases it when the holder ends, however it
ends (kill -9 included), so a lock is never stale. The holder writes its pid into the file, so a
refused start can name the process that holds the folder. The file stays in a run folder (it is
octlm's own); a start that gets no further than the lock leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

LOCK_FILE = ".octlm-lock"


class FolderLock:
    """The held lock of one run folder; :meth:`release` gives it back."""

    def __init__(self, folder: Path, descriptor: int, made_file: bool, made_folder: bool):
        self.folder, self.descriptor = folder, descriptor
        self.made_file, self.made_folder = made_file, made_folder

    def release(self, *, keep: bool) -> None:
        """Unlock. Unless ``keep`` (the folder became a run, or a start of one), a lock file and
        folder that this lock made are removed, so a refused start leaves the folder as it was.
        The file goes while still locked: a start that opened it meanwhile finds it unlinked
        and tries afresh (:func:`acquire`)."""
        try:
            if not keep and self.made_file:
                (self.folder / LOCK_FILE).unlink(missing_ok=True)
                if self.made_folder and not any(self.folder.iterdir()):
                    self.folder.rmdir()
        finally:
            os.close(self.descriptor)  # closing the last descriptor releases the lock


def acquire(folder: str | os.PathLike) -> FolderLock:
    """Take the lock of ``folder`` (made if missing), or raise ``ValueError`` naming the holder.

    A refusal touches nothing: the lock file of a held folder exists already.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"run folder {str(folder)!r} is a file, not a folder")
    made_folder = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    made_file = not path.exists()

    def refused(holder: str) -> ValueError:
        return ValueError(
            f"run folder {str(folder)!r} is in use by process {holder} (another octlm "
            "train holds it): wait for it to end, or choose another --out"
        )

    descriptor = locked(path, fcntl.LOCK_EX, refused)
    return FolderLock(folder, descriptor, made_file, made_folder)


def locked(path: Path, mode: int, refused: Callable[[str], Exception] | None) -> int:
    """A descriptor of ``path`` (made if missing) that holds ``fcntl.flock`` ``mode``
    (``LOCK_EX``: the holder's pid is written into the file; ``LOCK_SH``). Where another
    process holds it, ``refused(its pid)`` is raised, or with None this waits for it."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, mode | (fcntl.LOCK_NB if refused else 0))
        except BlockingIOError:
            holder = os.read(descriptor, 32).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise refused(holder) from None
        except BaseException:
            os.close(descriptor)
            raise
        try:
            same = os.fstat(descriptor).st_ino == path.stat().st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(descriptor)  # the file was removed by its last holder: lock the new one
    if mode == fcntl.LOCK_EX:
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
    return descriptor


def holder(path: Path) -> str:
    """The pid written into the lock file ``path`` ("unknown" where it says none)."""
    try:
        return path.read_text(errors="replace").strip() or "unknown"
    except FileNotFoundError:
        return "unknown"
