"""Training octlm models: data (bytes or BPE), the loop, checkpoints, processes, sampling.

- :mod:`~octlm.training.config`: ``RunConfig``, presets, resolving flags, files and presets
- :mod:`~octlm.training.data`: corpus -> memory-mapped token files; batches
- :mod:`~octlm.training.optim`: AdamW (decay on matrices) and warm-up + cosine schedule
- :mod:`~octlm.training.allocator`: glibc set to keep large freed blocks for the next step
- :mod:`~octlm.training.loop`: :func:`train`: the steps over one ``Training`` state, signals
- :mod:`~octlm.training.folder`: a run folder's life: lock, checks, overwrite, read back
- :mod:`~octlm.training.checkpoint`: atomic checkpoints, checked on load
- :mod:`~octlm.training.distributed`: DDP, FSDP2 and context parallelism under torchrun
- :mod:`~octlm.training.metrics`: ``metrics.jsonl`` and the loss-curve picture
- :mod:`~octlm.training.sample`: text from a trained model (``octlm.load_run`` reads a run)
"""

import importlib

from octlm.training.config import PRESETS, RunConfig, resolve

__all__ = ["PRESETS", "Outcome", "RunConfig", "generate_text", "resolve", "train"]
# Names whose modules import torch's distributed checkpointing and FSDP, loaded on first use so
# that reading the configuration (``octlm train --help``) does not pay for them.
_LAZY = {"Outcome": "loop", "train": "loop", "generate_text": "sample"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'octlm.training' has no attribute {name!r}")
    module = importlib.import_module(f"octlm.training.{_LAZY[name]}")
    return getattr(module, name)
