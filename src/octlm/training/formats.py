"""How a corpus's files hold documents (texts, or conversations), as a run states it: the
options and their defaults.

A leaf that both the run's configuration (:mod:`octlm.training.config`) and the data path
(:mod:`octlm.training.readers`, :mod:`octlm.training.corpus`) read, so that the configuration
checks and shows them without standing on the data path.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every format the readers know, plain or compressed (``--glob``'s default for a --data folder).
DEFAULT_GLOB = "**/*.{txt,md,jsonl,ndjson,json,parquet,arrow}{,.gz,.zst,.xz,.bz2}"
DEFAULT_TOKENIZER_SAMPLE = 200 * 10**6  # bytes of training text a BPE learns from at most
# The record shapes of conversations (octlm.training.conversations); auto: each record's own.
CHAT_FORMATS = ("auto", "messages", "sharegpt", "prompt", "alpaca")


@dataclass(frozen=True)
class Formats:
    """How documents are found in files: the field of a record that holds its text, and the
    separator that cuts a text file into documents (None: each text file is one); or, with a
    chat format, the shape of records that each hold a conversation, and whether a record that
    is not one stops the reading (``strict``) or is skipped."""

    text_field: str = "text"
    separator: str | None = None
    chat_format: str | None = None  # one of CHAT_FORMATS; None: plain text documents
    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.text_field, str) or not all(self.text_field.split(".")):
            raise ValueError(
                f"text_field must name a field (a.b for a nested one), got {self.text_field!r}"
            )
        if self.separator is not None and (
            not isinstance(self.separator, str) or not self.separator
        ):
            raise ValueError(f"separator must be a non-empty string, got {self.separator!r}")
        if self.chat_format is not None and self.chat_format not in CHAT_FORMATS:
            raise ValueError(
                f"chat_format must be one of {', '.join(CHAT_FORMATS)} (or None for plain text), "
                f"got {self.chat_format!r}"
            )
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be True or False, got {self.strict!r}")
