"""The recipe that fits the corpus: what ``--tokenizer auto`` becomes for a new run.

It follows from how many times the run would read its training text with a BPE, its passes:

    passes = tokens the run trains on x BPE_BYTES_PER_TOKEN / bytes of the training split

A run trains on ``steps x batch x length`` tokens, or with a ``--time-budget`` on
:data:`TOKENS_PER_SECOND` times its seconds where that is fewer (the tiny preset's eager rate on
two cores of an AVX-512 CPU, docs/training.md 'A recipe that fits the corpus'). ``auto`` is
``bpe`` where a BPE run reads its text at most :data:`BPE_PASSES` times and ``bytes`` beyond:
a small corpus read over and over is overfitted first through the BPE's rare tokens, and a
byte model sees a third as much text per step. Where ``auto`` takes bytes and neither
``--length`` nor ``--batch`` is given, the rows are :data:`BYTE_ROWS`: as many tokens a step,
twice the context. A token folder of ``octlm prepare`` keeps its own tokenizer.
"""

from __future__ import annotations

from octlm.progress import scaled
from octlm.training import data, prepare

TOKENS_PER_SECOND = 30_000
BPE_BYTES_PER_TOKEN = 3.3
BPE_PASSES = 4.0
# The rows of a byte run that sets neither --length nor --batch: the default tokens a step,
# in rows long enough to hold about as much text as a BPE row of 128 tokens.
BYTE_ROWS = {"length": 256, "batch": 8}


def training_bytes(run) -> tuple[int, str | None]:
    """The bytes of the training split of ``run``'s corpus (estimated from file sizes), and
    the tokenizer of a token folder (None for a corpus)."""
    if prepare.is_prepared(run.data):
        summary = data.read_summary(run.data)
        return summary["train_bytes"], summary["tokenizer"]
    root, glob = prepare.corpus_of(run)
    found = data.Corpus.open(root, glob, run.val_share, prepare.formats_of(run))
    return round(data.estimated_bytes(found) * (1 - run.val_share)), None


def passes(run, bytes_per_token: float, size: int) -> float:
    """How many times ``run`` reads a training split of ``size`` bytes."""
    tokens = run.batch * run.length * run.accumulate * (run.steps or float("inf"))
    if run.time_budget is not None:
        tokens = min(tokens, TOKENS_PER_SECOND * run.budget_seconds)
    return tokens * bytes_per_token / max(size, 1)


def tokenizer_for(run) -> tuple[str, str]:
    """The tokenizer ``--tokenizer auto`` stands for in ``run``, and why, in a few words."""
    size, prepared = training_bytes(run)
    if prepared is not None:
        return prepared, f"the tokens of {run.data}"
    over = passes(run, BPE_BYTES_PER_TOKEN, size)
    if over > BPE_PASSES:
        return "bytes", f"BPE would read {scaled(size)}B {over:,.0f} times"
    return "bpe", f"BPE reads {scaled(size)}B {over:,.1f} times"
