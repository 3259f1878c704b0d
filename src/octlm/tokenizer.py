"""A run's tokenizer: bytes when its folder holds no ``tokenizer.json``.

Byte tokens are the bytes themselves (vocabulary 256), so every byte of any file survives. A
folder with a ``tokenizer.json`` is a BPE run (the file is a standard ``tokenizers`` file).
"""

from __future__ import annotations

import os
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """Tokens are bytes: ``encode`` and ``decode`` are the identity on byte values."""

    name = "bytes"
    vocab_size = 256

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def decode(self, ids) -> bytes:
        return bytes(ids)


def load_tokenizer(folder: str | os.PathLike) -> ByteTokenizer:
    """The tokenizer of the run in ``folder``."""
    path = Path(folder) / TOKENIZER_FILE
    if path.exists():
        raise ValueError(f"{str(path)!r} is a BPE tokenizer, which this octlm does not read")
    return ByteTokenizer()
