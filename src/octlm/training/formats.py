"""How a corpus's files hold documents, as a run states it: the options and their defaults.

A leaf that both the run's configuration (:mod:`octlm.training.config`) and the data path
(:mod:`octlm.training.readers`, :mod:`octlm.training.corpus`) read, so that the configuration
checks and shows them without standing on the data path.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every format the readers know, plain or compressed (``--glob``'s default for a --data folder).
DEFAULT_GLOB = "**/*.{txt,md,jsonl,ndjson,json,parquet,arrow}{,.gz,.zst,.xz,.bz2}"
DEFAULT_TOKENIZER_SAMPLE = 200 * 10**6  # bytes of training text a BPE learns from at most


@dataclass(frozen=True)
class Formats:
    """How documents are found in files: the field of a record that holds its text, and the
    separator that cuts a text file into documents (None: each text file is one)."""

    text_field: str = "text"
    separator: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text_field, str) or not all(self.text_field.split(".")):
            raise ValueError(
                f"text_field must name a field (a.b for a nested one), got {self.text_field!r}"
            )
        if self.separator is not None and (
            not isinstance(self.separator, str) or not self.separator
        ):
            raise ValueError(f"separator must be a non-empty string, got {self.separator!r}")
