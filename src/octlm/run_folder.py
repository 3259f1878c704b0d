"""A training run's folder read back: its model at a checkpoint, and its tokenizer.

The reading lives with the rest of the run folder's life (:mod:`octlm.training.folder`); these
entry points load it on first use, so that ``import octlm`` stays light.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from octlm.model import OctLM
from octlm.tokenizer import ByteTokenizer, load_tokenizer


class Run(NamedTuple):
    """A run's model (in eval mode), its tokenizer and the step of the checkpoint loaded."""

    model: OctLM
    tokenizer: ByteTokenizer
    step: int


def load_run(folder: str | os.PathLike, device: str = "cpu", *, step: int | None = None) -> Run:
    """The model of the run in ``folder`` at its latest checkpoint (or the one of ``step``), with
    the run's tokenizer::

        model, tokenizer, step = octlm.load_run("runs/train")
    """
    model, step = load_model(folder, device, step=step)
    return Run(model, load_tokenizer(folder), step)


def load_model(
    folder: str | os.PathLike, device: str = "cpu", *, step: int | None = None
) -> tuple[OctLM, int]:
    """:func:`octlm.training.folder.load_model`: the run's model and its checkpoint's step."""
    from octlm.training import folder as run_folder  # loaded by the first run read

    return run_folder.load_model(folder, device, step=step)
