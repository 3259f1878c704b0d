"""The tokenizer side of a transformers folder, written for octlm's runs and read back.

A byte run's tokens are the UTF-8 bytes of its text (vocabulary 256). Its folder gets a
``tokenizer.json`` that says exactly that in the ``tokenizers`` format: a BPE with the 256
byte-level symbols as its whole vocabulary and no merges, so ``encode(text).ids`` are the
bytes of ``text`` and decoding turns ids back into bytes, then text (invalid UTF-8 becomes
U+FFFD, as in ``bytes.decode(errors="replace")``). A BPE run's ``tokenizer.json`` goes over as
it is. ``tokenizer_config.json`` makes ``AutoTokenizer`` read either as a fast tokenizer that
adds no token of its own (``add_bos_token`` and ``add_eos_token`` false, said outright: some
readers, Ollama's among them, default to adding one), and names the run's end-of-text token as
``eos_token`` where it has one.

A chat model's tokenizer (one with ``<|im_start|>`` and ``<|im_end|>``, which ``octlm finetune``
adds; a byte run's is then a ``tokenizer.json`` of its own, the 256 bytes and the chat tokens)
goes over as it is too, and its ``tokenizer_config.json`` adds what a chat front end reads:
``chat_template`` (ChatML, :data:`octlm.chatml.JINJA`), ``<|im_end|>`` as ``eos_token`` (it
ends a reply), and every special token marked special (``added_tokens_decoder``, and those
other than the ``eos_token`` as ``additional_special_tokens``, which transformers 4 reads and
5 reads as ``extra_special_tokens``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

try:
    from tokenizers import Tokenizer
except ImportError as error:
    raise ImportError(
        "writing and reading tokenizer files needs tokenizers: pip install tokenizers"
    ) from error

from octlm.chatml import CHAT_TOKENS, IM_END, JINJA
from octlm.tokenizer import BYTE_VOCAB as BYTES
from octlm.tokenizer import END_OF_TEXT, BPETokenizer, byte_level_tokenizer, probe_text
from octlm.tokenizer import TOKENIZER_FILE as TOKENIZER

TOKENIZER_CONFIG = "tokenizer_config.json"


def write(
    folder: str | os.PathLike,
    bpe: str | os.PathLike | None,
    max_length: int,
    special: dict[str, int] | None = None,
) -> None:
    """The tokenizer files of a run: a copy of its ``tokenizer.json``, or with ``bpe`` None
    the byte tokenizer; and the ``tokenizer_config.json`` that AutoTokenizer reads, with
    ``special`` the tokenizer's special tokens and their ids: :data:`END_OF_TEXT` as
    ``eos_token`` where it is one of them, and with the chat tokens the chat template and
    ``<|im_end|>`` as ``eos_token`` instead (the module docstring)."""
    folder = Path(folder)
    special = special or {}
    if bpe is None:
        # written by Python: a full disk is an OSError (tokenizers raises a bare Exception)
        (folder / TOKENIZER).write_text(byte_level_tokenizer().to_str())
    else:
        shutil.copyfile(bpe, folder / TOKENIZER)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,  # decoding gives back the text, spaces and all
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if END_OF_TEXT in special:
        config["eos_token"] = END_OF_TEXT
    if all(token in special for token in CHAT_TOKENS):
        config["eos_token"] = IM_END
        config["chat_template"] = JINJA
        ordered = sorted(special, key=special.get)
        config["additional_special_tokens"] = [t for t in ordered if t != IM_END]
        config["added_tokens_decoder"] = {
            str(special[token]): {
                "content": token, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True,
            }
            for token in ordered
        }  # fmt: skip
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def bpe_file(folder: str | os.PathLike, vocab_size: int) -> Path | None:
    """The ``tokenizer.json`` of a transformers folder as octlm takes it for a run of
    ``vocab_size`` tokens: None for byte tokens (no tokenizer and 256 tokens, or a tokenizer
    whose ids are the bytes), the file itself for a byte-level BPE; ``ValueError`` otherwise."""
    path = Path(folder) / TOKENIZER
    if not path.is_file():
        if vocab_size != BYTES:
            raise ValueError(
                f"{str(folder)!r} has no {TOKENIZER} and a vocabulary of {vocab_size}: without "
                f"a tokenizer octlm's tokens are bytes, {BYTES} of them"
            )
        return None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers reports a malformed file as a bare Exception
        raise ValueError(f"{str(path)!r} is not a tokenizers file: {error}") from None
    if _gives_bytes(tokenizer):
        return None
    try:
        BPETokenizer.from_file(path)  # the check a run folder's tokenizer.json passes
    except ValueError as error:
        raise ValueError(
            f"{str(path)!r} is neither a byte tokenizer nor a byte-level BPE that octlm can "
            f"train with: {error}"
        ) from None
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"{str(path)!r} has {tokenizer.get_vocab_size()} tokens but the model's vocab_size "
            f"is {vocab_size}"
        )
    return path


def _gives_bytes(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` maps text to its UTF-8 bytes and back, on text that holds every
    byte UTF-8 text can hold."""
    probe = probe_text()
    ids = tokenizer.encode(probe).ids
    return (
        tokenizer.get_vocab_size() == BYTES
        and ids == list(probe.encode())
        and tokenizer.decode(ids) == probe
    )
