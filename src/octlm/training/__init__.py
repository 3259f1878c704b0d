"""Training octlm models: byte-level data, the loop, checkpoints, several processes, sampling.

- :mod:`~octlm.training.config`: ``RunConfig``, presets, resolving flags, files and presets
- :mod:`~octlm.training.data`: corpus -> memory-mapped uint8 token files; batches
- :mod:`~octlm.training.optim`: AdamW (decay on matrices) and warm-up + cosine schedule
- :mod:`~octlm.training.loop`: :func:`train`, evaluation, signals
- :mod:`~octlm.training.checkpoint`: atomic checkpoints, checked on load
- :mod:`~octlm.training.distributed`: DDP, FSDP2 and context parallelism under torchrun
- :mod:`~octlm.training.metrics`: ``metrics.jsonl`` and the loss-curve picture
- :mod:`~octlm.training.sample`: text from a trained model (``octlm.load_run`` reads a run)
"""

from octlm.training.config import PRESETS, RunConfig, resolve
from octlm.training.loop import Outcome, train
from octlm.training.sample import generate_text

__all__ = ["PRESETS", "Outcome", "RunConfig", "generate_text", "resolve", "train"]
