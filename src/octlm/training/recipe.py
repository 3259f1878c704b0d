"""The recipe that fits the corpus: what ``--tokenizer auto`` becomes for a new run.

It is settled once the run is resolved, on rank 0, from the opened corpus, and stored in
``config.json`` (so every rank and every resume agree). The rule, in order:

1. A ``--vocab-size`` above 256 asks for a BPE, and 256 for bytes: auto takes what it names.
2. Otherwise it follows how many times the run would read its training text with a BPE:

       passes = tokens the run trains on x BPE_BYTES_PER_TOKEN / bytes of the training split

   A run trains on ``steps x batch x length`` tokens (``--batch`` is the global batch, over
   all ranks and ``--accumulate``), or with a ``--time-budget`` on its seconds times the
   host's rate where that is fewer: the share of the host's measured peak that a step
   reaches, over the model's FLOPs per token (:func:`tokens_per_second`). ``auto`` is
   ``bpe`` where a BPE run reads its text at most :data:`BPE_PASSES` times and ``bytes``
   beyond: a small
   corpus read over and over is overfitted first through the BPE's rare tokens, and a byte
   model sees a third as much text per step.
3. A BPE the training text cannot reach (too few distinct pairs to merge into its
   vocabulary) is no choice: auto takes bytes instead (:func:`fallback`).

Where auto takes bytes and neither ``--length`` nor ``--batch`` is given, the rows are
:data:`BYTE_ROWS`: as many tokens a step, twice the context. Where no ``--length`` is given
and the validation split is too short for one row, the rows shrink to fit it
(:func:`fitted`). A token folder of ``octlm prepare`` keeps its own tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from octlm.chatml import CHAT_TOKENS
from octlm.model import ModelConfig
from octlm.tokenizer import BYTE_VOCAB, DEFAULT_BPE_VOCAB
from octlm.training.config import RunConfig, check_compatible
from octlm.training.precision import resolve_dtype
from octlm.training.utilisation import flops_per_token, peak

# The share of the host's peak FLOP/s a step reaches: eager float32 steps of the presets reach
# 42-47% on an AVX2-only CPU (docs/benchmarks.md, 'Share of peak').
STEP_SHARE = 0.4
TOKENS_PER_SECOND = 30_000  # the rate where no peak is measured ($OCTLM_PEAK_FLOPS=0)
RATE_VARIABLE = "OCTLM_TOKENS_PER_SECOND"  # pins the host's rate (tests, repeatable runs)
BPE_BYTES_PER_TOKEN = 3.3
BPE_PASSES = 4.0
# The rows of a byte run that sets neither --length nor --batch: the default tokens a step,
# in rows long enough to hold about as much text as a BPE row of 128 tokens.
BYTE_ROWS = {"length": 256, "batch": 8}
ROW_MULTIPLE = 8  # rows shrunk to fit a short validation split stay a multiple of this


def tokens_per_second(model: ModelConfig, run: RunConfig) -> float:
    """The rate a ``--time-budget`` run of a BPE ``model`` is expected to train at:
    ``$OCTLM_TOKENS_PER_SECOND`` where set; else the host's peak in the run's dtype
    (:func:`octlm.training.utilisation.peak`, measured once and cached) times
    :data:`STEP_SHARE` over the model's FLOPs per token; :data:`TOKENS_PER_SECOND` where no
    peak is measured."""
    text = os.environ.get(RATE_VARIABLE)
    if text is None:
        device = torch.device(run.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        flops = peak(device, resolve_dtype(run.dtype, device))
        if flops is None:
            return TOKENS_PER_SECOND
        return flops * STEP_SHARE / flops_per_token(model, run.length)
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"${RATE_VARIABLE} must be a positive number of tokens, got {text!r}")
    return rate


def trained_tokens(run: RunConfig, rate: float) -> float:
    """The tokens ``run`` trains on: its steps' rows, or its budget's worth at ``rate`` tokens
    a second where fewer."""
    tokens = run.batch * run.length * (run.steps or math.inf)
    if run.time_budget is not None:
        tokens = min(tokens, rate * run.budget_seconds)
    return tokens


def passes(run: RunConfig, size: int, rate: float) -> float:
    """How many times ``run`` would read a training split of ``size`` bytes with a BPE, at
    ``rate`` tokens a second."""
    return trained_tokens(run, rate) * BPE_BYTES_PER_TOKEN / max(size, 1)


def tokenizer_for(run: RunConfig, model: ModelConfig, given: frozenset, size: int):
    """The tokenizer ``--tokenizer auto`` stands for in ``run`` on a training split of about
    ``size`` bytes, and why, with the figures of the rule."""
    if "vocab_size" in given or model.vocab_size != BYTE_VOCAB:
        name = "bytes" if model.vocab_size == BYTE_VOCAB else "bpe"
        return name, f"--vocab-size {model.vocab_size} names it"
    bpe = dataclasses.replace(model, vocab_size=DEFAULT_BPE_VOCAB)
    rate = tokens_per_second(bpe, run) if run.time_budget is not None else math.nan
    over = passes(run, size, rate)
    tokens = trained_tokens(run, rate)
    figures = (
        f"{tokens:,.0f} tokens x {BPE_BYTES_PER_TOKEN} bytes / {size:,} bytes of training text"
    )
    if tokens < run.batch * run.length * (run.steps or math.inf):  # the budget bounds it
        figures += f"; {rate:,.0f} tokens a second for {run.budget_seconds:g} s"
    if over > BPE_PASSES:
        return (
            "bytes",
            f"a BPE would read it {over:,.2f} times, more than {BPE_PASSES:g}: {figures}",
        )
    return "bpe", f"a BPE reads it {over:,.2f} times, at most {BPE_PASSES:g}: {figures}"


def with_tokenizer(
    model: ModelConfig, run: RunConfig, given: frozenset, tokenizer: str, vocab_size: int | None
) -> tuple[ModelConfig, RunConfig, str]:
    """``model`` and ``run`` for ``tokenizer`` (of ``vocab_size`` tokens; None: the default
    for it): the vocabulary, and a byte run's rows where none were given; what changed."""
    said = ""
    follows = "max_length" not in given and model.max_length == run.length  # the default
    if vocab_size is None and tokenizer == "bytes":
        vocab_size = BYTE_VOCAB + len(CHAT_TOKENS) * run.chat  # a chat run's: chat tokens too
    elif vocab_size is None:  # a BPE of the vocabulary given, else of the default one
        vocab_size = DEFAULT_BPE_VOCAB if model.vocab_size == BYTE_VOCAB else model.vocab_size
    run = dataclasses.replace(run, tokenizer=tokenizer)
    if tokenizer == "bytes" and not {"length", "batch"} & given:
        run = dataclasses.replace(run, **BYTE_ROWS)
        said = f"; rows of {run.batch} x {run.length} bytes"
    model = dataclasses.replace(model, vocab_size=vocab_size)
    if follows:
        model = dataclasses.replace(model, max_length=run.length)
    check_compatible(model, run)
    return model, run, said


def fitted(
    model: ModelConfig, run: RunConfig, given: frozenset, val_tokens: int
) -> tuple[ModelConfig, RunConfig, str]:
    """Rows that fit a validation split of ``val_tokens`` (one row and its next-token target)
    where no ``--length`` was given; what changed."""
    if val_tokens > run.length or "length" in given:
        return model, run, ""
    length = val_tokens - 1
    length = length // ROW_MULTIPLE * ROW_MULTIPLE or length
    if length < 1:
        return model, run, ""
    if "max_length" not in given and model.max_length == run.length:
        model = dataclasses.replace(model, max_length=length)
    run = dataclasses.replace(run, length=length)
    check_compatible(model, run)
    return model, run, f"; rows of {length} tokens, as the validation split holds {val_tokens}"
