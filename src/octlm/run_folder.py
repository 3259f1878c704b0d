"""A training run's folder read back: its model at a checkpoint, and its tokenizer."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from octlm.model import OctLM, is_int_at_least
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
    """The model of a run folder at its latest checkpoint (or the one of ``step``), and that
    checkpoint's step. A run trained with the Triton kernel runs its PyTorch twin off CUDA (the
    same function); a ring-attention run runs tiled, its one-process twin."""
    # The training package is imported here, not with octlm: loading a run is its only use.
    from octlm.training import checkpoint
    from octlm.training.config import stored_model
    from octlm.training.distributed import local_device
    from octlm.training.sample import single_process

    folder = Path(folder)
    model_config = stored_model(folder)
    if step is None:
        path = checkpoint.latest(folder)
        if path is None:
            raise ValueError(f"run folder {str(folder)!r} has no checkpoint yet")
    else:
        path = checkpoint.path_for(folder, step) if is_int_at_least(step, 0) else None
        if path is None or not path.is_file():
            kept = [int(checkpoint.PATTERN.fullmatch(p.name)[1]) for p in checkpoint.listed(folder)]
            raise ValueError(f"step must be one of the run's checkpoints {kept}, got {step!r}")
    state = checkpoint.load(path, model_config)
    device = local_device(device)
    config = single_process(model_config)
    if device.type != "cuda" and config.kernel == "triton":  # a GPU run sampled on a CPU
        config = replace(config, kernel="pytorch")  # the same function, in PyTorch
    model = OctLM(config)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state["step"]
