"""Progress of long work: a tqdm bar in a terminal, a plain line now and then outside one.

A log redirected to a file keeps a few readable lines instead of thousands of bar frames::

    with Progress("tokenising corpus", total=size, unit="B") as progress:
        for piece in pieces:
            progress.update(len(piece))

Outside a terminal each line says how far, how fast and how long is left, at most once every
``every`` seconds, and once more at the end of work that took a line before.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts work done of ``total`` (None: unknown) in ``unit`` s, shown on ``file``."""

    def __init__(
        self,
        description: str,
        total: float | None = None,
        unit: str = "it",
        *,
        file: TextIO | None = None,
        every: float = 30.0,
        enabled: bool = True,
        initial: float = 0,
    ):
        self.description, self.total, self.unit, self.every = description, total, unit, every
        self.file = sys.stderr if file is None else file
        self.initial = self.done = initial
        self.start = self.shown = time.monotonic()
        self.bar = None
        self.enabled = enabled
        self.details: dict[str, str] = {}
        if enabled and self.file.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(
                desc=description,
                total=total,
                initial=initial,
                unit=unit,
                unit_scale=True,
                file=self.file,
            )

    def update(self, amount: float = 1) -> None:
        """Count ``amount`` more done."""
        self.done += amount
        if self.bar is not None:
            self.bar.update(amount)
        elif self.enabled and time.monotonic() - self.shown >= self.every:
            self._line()

    def show(self, **details: str) -> None:
        """Show ``details`` (name: value) beside the count from now on."""
        self.details = details
        if self.bar is not None:
            self.bar.set_postfix(details)

    def write(self, line: str) -> None:
        """Print ``line`` on stdout (above the bar in a terminal), shown or not."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        """End the bar, or say the last line where a line was said before."""
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.shown > self.start:
            self._line()
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *error) -> None:
        self.close()

    def line(self) -> str:
        """Where the work stands, in words: done (of total), rate, and time left."""
        elapsed = time.monotonic() - self.start
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else 0.0
        done = scaled(self.done)
        if self.total:
            done += f" of {scaled(self.total)}{self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            done += self.unit
        text = f"{self.description}: {done}, {scaled(rate)}{self.unit}/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f", {duration((self.total - self.done) / rate)} left"
        text += f", {duration(elapsed)} so far"
        return "; ".join([text, *(f"{name} {value}" for name, value in self.details.items())])

    def _line(self) -> None:
        self.shown = time.monotonic()
        print(self.line(), file=self.file, flush=True)


def scaled(value: float) -> str:
    """``value`` with a metric prefix: 1234567 -> '1.23M'."""
    prefix = 0
    while abs(value) >= 1000 and prefix < 4:
        value /= 1000
        prefix += 1
    return f"{value:.3g}{' kMGT'[prefix]}" if prefix else f"{value:.3g}"


def duration(seconds: float) -> str:
    """``seconds`` as '1h02m', '3m05s' or '12s'."""
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
