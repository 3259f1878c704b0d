"""Process lifetimes: a child dies with its driver, however the driver ends.

- :func:`die_with_parent`: a worker (or a benchmark's competing process) ends when the process
  that started it ends, however it ends. On Linux the kernel sees to it
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)``); elsewhere a thread watches ``os.getppid()``.
- :func:`bind_to_parent`: the same guard set by the parent for a child it spawns, between fork
  and exec, so it holds while the child still imports torch.
- ``python guard.py --compete PARENT``: one CPU-bound process, for ``octlm bench --busy``.

This file imports nothing from octlm or torch, so the competing process starts at once.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """End this process with SIGKILL once ``parent`` (the driver's pid) is gone."""
    if not _pdeathsig():
        threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    # The parent may have died before the guard was set: then this process is already an orphan.
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
    """Ask the kernel to SIGKILL this process when its parent exits; False where that fails."""
    libc = _libc()
    return libc is not None and libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def compete(parent: int) -> None:
    """Keep one core busy until killed, or until ``parent`` is gone."""
    die_with_parent(parent)
    while True:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one CPU-bound competing process")
    parser.add_argument("--compete", type=int, required=True, metavar="PARENT_PID")
    compete(parser.parse_args().compete)
