"""Stopping on a signal, the same way in every verb.

- :class:`Stopped`: SIGTERM or SIGHUP (a closed terminal or ssh session) received; a
  ``KeyboardInterrupt``, so every ``finally`` and ``except KeyboardInterrupt`` that cleans up
  after Ctrl-C cleans up after these too. ``signum`` says which signal it was.
- :func:`stop_on_signals`: within the block, those signals raise :class:`Stopped`; once the
  returned :class:`Stop` is deferring, they are only noted, for a loop that ends after its
  current step (training).
- :func:`run_stoppable`: a command's work under :func:`stop_on_signals`, ending as one line and
  an exit status on an expected error, Ctrl-C (130) or a stop signal (128 + its number).

This file imports nothing from octlm or torch.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Stopped(KeyboardInterrupt):
    """A signal asked the process to stop; ``signum`` is that signal (SIGINT for Ctrl-C)."""

    def __init__(self, signum: int, when: str = ""):
        super().__init__(f"stopped by {signal.Signals(signum).name}{when}")
        self.signum = signum


class Stop:
    """What the signals of a :func:`stop_on_signals` block asked for.

    Until :meth:`defer` is called a signal raises :class:`Stopped`; after it, the first
    signal's name is kept in :attr:`signal` and the code polls it.
    """

    def __init__(self) -> None:
        self.deferring = False
        self.signal: str | None = None

    def defer(self) -> None:
        self.deferring = True


def signal_number(error: BaseException) -> int:
    """The signal behind ``error``: its own for :class:`Stopped`, SIGINT for Ctrl-C."""
    return getattr(error, "signum", signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(signums: tuple[int, ...] = STOP_SIGNALS) -> Iterator[Stop]:
    """Within the block, ``signums`` raise :class:`Stopped` (or are noted once deferring).

    Signal handlers belong to the main thread: elsewhere the block changes nothing.
    """
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, _frame):
        if not stop.deferring:
            raise Stopped(signum)
        stop.signal = stop.signal or signal.Signals(signum).name

    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield stop
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


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
    except KeyboardInterrupt as stop:
        said = str(stop) if isinstance(stop, Stopped) else "interrupted"
        print(f"{name}: {said}" + (f"; {kept}" if kept else ""), file=sys.stderr)
        return 128 + signal_number(stop)
