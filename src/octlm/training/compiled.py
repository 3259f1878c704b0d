"""``--compile``: whether a run compiles its loss with ``torch.compile``, and the compiled loss
that goes on eagerly where compilation fails.

What is compiled is the model's forward with the loss after it (the float32 log-softmax of the
logits fused with their cast), one graph per step: the model reads no value back under
compilation (:meth:`octlm.model.OctLM._check_tokens`). Evaluations call the same function
eagerly, so a change of grad mode never recompiles it. ``auto`` compiles where
:func:`compiles_here` says it pays; docs/training.md ('Compiled steps') has the figures the
rule comes from.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable

import torch

MODES = ("auto", "on", "off")
# The shortest runs auto compiles on a CPU: steps, else seconds of --time-budget
# (docs/training.md, 'Compiled steps').
LONG_STEPS = 1000
LONG_BUDGET = 180.0


def check_mode(mode: object) -> str:
    """``mode`` as a ``--compile`` value; ``True``/``False`` (a config.json written when the
    flag was a switch) read as ``on``/``off``."""
    if isinstance(mode, bool):
        return "on" if mode else "off"
    if mode not in MODES:
        raise ValueError(f"compile must be one of {MODES}, got {mode!r}")
    return mode


def compiler_found() -> bool:
    """Whether the C++ compiler inductor calls on a CPU is on PATH (``$CXX``, else g++)."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def compiles_here(run, device: torch.device) -> tuple[bool, str]:
    """Whether ``run`` (a :class:`~octlm.training.config.RunConfig`) compiles its steps on
    ``device``, and why, in a few words.

    ``auto`` compiles on CUDA, and on a CPU where a C++ compiler is found for a run long enough
    to repay the compilation: at least :data:`LONG_STEPS` steps or :data:`LONG_BUDGET` seconds
    of budget. Never under context parallelism, whose ring runs its collectives in Python.
    """
    if run.context_parallel:
        return False, "context parallelism's ring runs eagerly"
    if run.compile != "auto":
        return run.compile == "on", f"--compile {run.compile}"
    if device.type != "cpu":
        return True, f"auto: {device.type}"
    if not compiler_found():
        return False, "auto: no C++ compiler for inductor on PATH"
    budget = run.budget_seconds
    if (budget is None and run.steps < LONG_STEPS) or (budget is not None and budget < LONG_BUDGET):
        return False, "auto: a short run, which compiling would not repay"
    return True, "auto: a long run on a CPU with a C++ compiler"


class CompiledLoss:
    """``loss(*args)``, compiled on first use where ``on``; :meth:`eager` is the same function
    uncompiled. A compilation that fails (no working compiler, an operation inductor lacks)
    is said in one line and the run goes on eagerly."""

    def __init__(self, loss: Callable, on: bool, device: torch.device):
        self.eager = loss
        self.compiled = torch.compile(loss) if on else None
        if on and device.type == "cpu":
            # Inductor's CPU kernels add a scatter's rows (the embedding's gradient) with
            # atomics unless deterministic algorithms are asked for: a run would not repeat
            # itself, nor resume bit for bit.
            torch.use_deterministic_algorithms(True, warn_only=True)

    def __call__(self, *args):
        if self.compiled is None:
            return self.eager(*args)
        try:
            return self.compiled(*args)
        except Exception as error:
            if not _compilation_failed(error):
                raise
            first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            print(
                f"octlm train: torch.compile failed ({first[:200]}); the run goes on eagerly",
                file=sys.stderr,
            )
            self.compiled = None
            torch._dynamo.reset()
            return self.eager(*args)


def _compilation_failed(error: Exception) -> bool:
    """Whether ``error`` came from compiling, not from the computation compiled."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    return isinstance(error, BackendCompilerFailed | InductorError)
