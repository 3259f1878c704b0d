"""Equivalence experiments: every attention implementation against the float64 reference.

Each experiment is a generator of verification records (docs/design.md, 'Records'). :func:`run`
appends every record to ``<out>/<date>-<experiment>.jsonl`` the moment it is computed, so a run that
is killed keeps every finished line; each record carries the run's id. Outputs are judged by the
equality rule of docs/design.md, 'When are two results equal' (against naive attention in float64,
relative to naive attention in the tested dtype); pairwise differences (tiled vs sdpa, the model's
logits) go in ``max_abs_diff``, which the report sets beside the baseline's figures. Token counts
and loss curves are not judged by that rule: their records say what they counted instead.

=================  ==========================================================================
tiled-sdpa         tiled vs sdpa, and sdpa vs naive, over the reference lengths and blocks
model-equivalence  the whole model's logits and parameter gradients at 8, 4, 2, 1 KV heads
block-invariance   tiled's output is the same for every block size, pairs included
partial-outputs    after each key block, the partial result is attention over the keys so far
gradients          tiled's backward: causal, non-causal, GQA, window, q_len < k_len, strided
structure          documents, left padding, softcap, ALiBi, sinks, a block mask: forward and
                   backward of every implementation that takes them
decoding           KV-cache decoding gives full-forward logits; greedy tokens agree everywhere
training           20 training steps from one RNG seed give one loss curve for every attention
=================  ==========================================================================

Modules: :mod:`~octlm.lab.verify.plan` (sizes), :mod:`~octlm.lab.verify.cases` (shapes, inputs,
records), :mod:`~octlm.lab.verify.attention`, :mod:`~octlm.lab.verify.structure` and
:mod:`~octlm.lab.verify.model` (the experiments), :mod:`~octlm.lab.verify.runner` (files and the
summary).
"""

from octlm.lab.verify.plan import FULL, QUICK, TESTED_DTYPES, Plan, default_dtypes
from octlm.lab.verify.runner import EXPERIMENTS, check_options, run, summary

__all__ = [
    "EXPERIMENTS",
    "FULL",
    "QUICK",
    "TESTED_DTYPES",
    "Plan",
    "check_options",
    "default_dtypes",
    "run",
    "summary",
]
