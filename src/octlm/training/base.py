"""What a fine-tune starts from (``--init-from``, ``octlm finetune BASE``): an octlm run folder
(at its best checkpoint, or another) or a transformers folder of the Llama family, with the
tokenizer its weights were trained with, given the chat tokens a conversation run needs.

A transformers folder's embedding may hold more rows than its tokenizer has tokens (padded to
a round size): no text encodes to those ids, so the run keeps only the tokenizer's rows.
Chat tokens the tokenizer lacks are added after its last id (:func:`octlm.tokenizer.
with_chat_tokens`), and each new row of the embedding (and of an untied head) starts as the
mean of the rows there: a token the model has never seen, placed where the others are on
average, so that its first logits are neither large nor random.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

from octlm.tokenizer import (
    RUN_CONFIG,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    with_chat_tokens,
)

ROWS = ("embedding.weight", "head.weight")  # the tensors with one row per token


def is_run(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is an octlm run folder: a ``config.json`` of model and run tables."""
    try:
        content = json.loads((Path(folder) / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and {"model", "run"} <= set(content)


def step_of(init_step: str) -> int | str:
    """A run's ``init_step`` as a checkpoint choice: ``best``, ``last`` or a step."""
    return int(init_step) if init_step.isdigit() else init_step


def tokenizer_of(folder: str | os.PathLike, chat: bool = False) -> ByteTokenizer | BPETokenizer:
    """The tokenizer of the base in ``folder`` (with ``chat``, the chat tokens added where it
    lacks them); ValueError for a tokenizer octlm cannot train with, naming the field, or one
    larger than the model's vocabulary."""
    if is_run(folder):
        tokenizer = load_tokenizer(folder)
    else:
        from octlm.integrations.llama_format import read_config
        from octlm.integrations.tokenizer_files import bpe_file

        vocab_size = read_config(folder)["vocab_size"]
        path = Path(folder) / TOKENIZER_FILE
        size = _tokens_in(path) if path.is_file() else vocab_size
        if size > vocab_size:
            raise ValueError(
                f"{str(path)!r} has {size} tokens but the model's vocab_size is {vocab_size}"
            )
        bpe = bpe_file(folder, size)
        tokenizer = ByteTokenizer() if bpe is None else BPETokenizer.from_file(bpe)
    return with_chat_tokens(tokenizer) if chat else tokenizer


def _tokens_in(path: Path) -> int:
    """How many tokens a ``tokenizers`` file holds; ValueError for a damaged one."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size()
    except Exception as error:  # the library reports a bad file as a bare Exception
        raise ValueError(f"{str(path)!r} is not a tokenizers file ({error})") from None


def grown(state: dict[str, Tensor], rows: int, vocab_size: int) -> dict[str, Tensor]:
    """``state`` with each per-token matrix (:data:`ROWS`) cut to its first ``rows`` rows (the
    base tokenizer's) and grown to ``vocab_size`` by rows of their mean (the module docstring
    says why)."""
    state = dict(state)
    for name in ROWS:
        if name not in state:
            continue
        kept = state[name][:rows]  # (rows, C)
        new = kept.float().mean(0, keepdim=True).to(kept.dtype)  # (1, C)
        state[name] = torch.cat([kept, new.expand(vocab_size - rows, -1)])  # (vocab_size, C)
    return state
