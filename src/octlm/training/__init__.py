"""Training octlm models: data (bytes or BPE), the loop, checkpoints, processes, sampling.

The data path, each stage handed the previous stage's output:

- :mod:`~octlm.training.formats`: how files hold documents (the options and their defaults)
- :mod:`~octlm.training.readers`: one corpus file -> its documents, one reader per format
- :mod:`~octlm.training.corpus`: ``Corpus``, opened once: its files, sizes and split
- :mod:`~octlm.training.recipe`: what ``--tokenizer auto`` becomes for a corpus
- :mod:`~octlm.training.prepare`: the corpus tokenised (a BPE learned) into a token folder
- :mod:`~octlm.training.tokens`: a token folder's files, written and memory-mapped
- :mod:`~octlm.training.batches`: random windows or packed rows of a split

The run:

- :mod:`~octlm.training.config`: ``RunConfig``, presets, resolving files and presets
- :mod:`~octlm.training.flags`: the run's command-line flags, shared by every verb
- :mod:`~octlm.training.folder`: a run folder's life: lock, checks, overwrite, read back
- :mod:`~octlm.training.lock`: one writer at a time, for run folders and token folders
- :mod:`~octlm.training.loop`: :func:`train`: the steps over one ``Training`` state, signals
- :mod:`~octlm.training.optim`: Muon for the blocks' matrices and AdamW for the rest (or AdamW
  alone), and the warm-up + cosine schedule
- :mod:`~octlm.training.precision`: float32, or bfloat16 autocast where the hardware has it
- :mod:`~octlm.training.compiled`: the step's forward and loss under ``torch.compile``
- :mod:`~octlm.training.budget`: a ``--time-budget`` and the stopwatch that spends it
- :mod:`~octlm.training.allocator`: glibc set to keep large freed blocks for the next step
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
