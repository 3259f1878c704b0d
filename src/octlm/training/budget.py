"""A run's time budget: the duration ``--time-budget`` takes, and the training time it spends.

Training time is wall-clock time from the first step, summed over a run's launches (it travels
in each checkpoint); evaluations do not count, so the learning rate laid over it (and the point
where the budget is spent) do not depend on how often a run is evaluated.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable, Iterator

# 90s, 10m, 1h, 1h30m, 1.5h; a bare number is seconds.
_NUMBER = r"(\d+(?:\.\d+)?)"
_DURATION = re.compile(f"(?:{_NUMBER}h)?(?:{_NUMBER}m)?(?:{_NUMBER}s)?|{_NUMBER}")
_UNITS = (3600.0, 60.0, 1.0, 1.0)


def parse_duration(text: object) -> float:
    """Seconds in a duration such as ``90s``, ``10m``, ``1h`` or ``1h30m``; ValueError unless
    it is a positive, finite duration written so."""
    match = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or not any(match.groups()):
        seconds = None
    else:
        parts = zip(match.groups(), _UNITS, strict=True)
        seconds = sum(float(part) * unit for part, unit in parts if part)
    if seconds is None or not (0 < seconds < math.inf):
        raise ValueError(
            f"time_budget must be a positive duration such as 90s, 10m, 1h or 1h30m, got {text!r}"
        )
    return seconds


class Stopwatch:
    """Training seconds: ``elapsed`` is the reading of the last :meth:`lap`.

    ``clock`` gives seconds (``time.monotonic``; a test passes its own). :meth:`resume_from`
    carries a checkpoint's seconds over to this launch.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.elapsed = 0.0
        self._before = 0.0  # seconds of earlier launches
        self._started: float | None = None

    def resume_from(self, seconds: float) -> None:
        self._before = self.elapsed = float(seconds)

    def start(self) -> None:
        self._started = self.clock()

    def lap(self, agree: Callable[[float], float] | None = None) -> float:
        """Read the clock into ``elapsed``; ``agree`` (rank 0's reading for every rank) makes
        all processes of a run take the same."""
        reading = self._before + self.clock() - self._started
        self.elapsed = reading if agree is None else agree(reading)
        return self.elapsed

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count."""
        stopped = self.clock()
        try:
            yield
        finally:
            self._started += self.clock() - stopped
