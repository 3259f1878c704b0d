"""A training run's folder read back: :mod:`octlm.training.folder`'s ``Run`` and ``load_run``."""

from octlm.training.folder import Run, load_run

__all__ = ["Run", "load_run"]
