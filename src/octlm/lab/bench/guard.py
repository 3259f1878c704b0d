"""Process lifetimes: a child dies with its driver, and the driver stops cleanly on a signal.

- :func:`die_with_parent`: a worker (or a benchmark's competing process) ends when the process
  that started it ends, however it ends. On Linux the kernel sees to it
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)``); elsewhere a thread watches ``os.getppid()``.
- :func:`bind_to_parent`: the same guard set by the parent for a child it spawns, between fork
  and exec, so it holds while the child still imports torch.
- :func:`stop_on_signals`: SIGTERM and SIGHUP raise :class:`Stopped` in the driver, so the code
  that kills the running worker (the same as for Ctrl-C) runs before the driver exits.
- :func:`run_stoppable`: a command's work under :func:`stop_on_signals`, ending as one line and
  an exit status on an expected error, Ctrl-C (130) or a stop signal (128 + its number).
- ``python guard.py --compete PARENT``: one CPU-bound process, for ``octlm bench --busy``.

This file imports nothing from octlm or torch, so the competing process starts at once.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Stopped(BaseException):
    """The driver received SIGTERM or SIGHUP; like ``KeyboardInterrupt``, not an error."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def die_with_parent(parent: int) -> None:
    """End this process with SIGKILL once ``parent`` (the driver's pid) is gone."""
    if not _pdeathsig():
        threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    # The parent may have died before the guard was set: then we are already an orphan.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def bind_to_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child is SIGKILLed when this process
    (more exactly, the thread calling ``Popen``) ends, from before its first instruction.

    ``None`` where the kernel offers no such guard (not Linux); the child's own
    :func:`die_with_parent` then watches instead.
    """
    libc = _libc()
    if libc is None:
        return None
    parent = os.getpid()

    def bind() -> None:  # runs in the child, after fork and before exec
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the guard was set
            os.kill(os.getpid(), signal.SIGKILL)

    return bind


def _libc() -> ctypes.CDLL | None:
    """The loaded C library, for ``prctl``; ``None`` off Linux or where it has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols, libc's among them
        libc.prctl  # noqa: B018  (raises AttributeError where there is none)
    except (OSError, AttributeError):
        return None
    return libc


def _pdeathsig() -> bool:
    """Ask the kernel to SIGKILL us when our parent exits; False where that fails."""
    libc = _libc()
    return libc is not None and libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Stopped` (main thread only)."""

    def stop(signum, frame):
        raise Stopped(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_stoppable(
    name: str,
    work: Callable[[], int | None],
    exits: dict[type[BaseException], int],
    kept: str | None = None,
) -> int:
    """``work()``'s exit status, with SIGTERM and SIGHUP raising :class:`Stopped` meanwhile.

    An error of a kind in ``exits`` is ``name: error`` on stderr and that kind's status; Ctrl-C
    is ``name: interrupted`` and 130, a stop signal ``name: stopped by SIGHUP`` and 128 + its
    number, followed by ``kept`` (what the run leaves, say where its finished records are). A
    ``finally`` or ``with`` inside ``work`` runs first, so children are killed and temporary
    files removed before the line is printed.
    """
    try:
        with stop_on_signals():
            return int(work() or 0)
    except tuple(exits) as error:
        print(f"{name}: {error}", file=sys.stderr)
        return next(code for kind, code in exits.items() if isinstance(error, kind))
    except (KeyboardInterrupt, Stopped) as stop:
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        said = str(stop) if isinstance(stop, Stopped) else "interrupted"
        print(f"{name}: {said}" + (f"; {kept}" if kept else ""), file=sys.stderr)
        return 128 + signum


def compete(parent: int) -> None:
    """Keep one core busy until killed, or until ``parent`` is gone."""
    die_with_parent(parent)
    while True:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one CPU-bound competing process")
    parser.add_argument("--compete", type=int, required=True, metavar="PARENT_PID")
    compete(parser.parse_args().compete)
