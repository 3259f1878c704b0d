"""A training run's tokenizer: bytes (the default), or a byte-level BPE trained on its data.

Both map any bytes to token ids and back without loss: ``decode(encode(data)) == data``.

``ByteTokenizer``: each byte is one token, its id the byte's value (vocabulary 256).

``BPETokenizer``: GPT-2's byte-level BPE, trained with the ``tokenizers`` library and kept in
the run folder as ``tokenizer.json``, a standard file of that library. Its ByteLevel
pre-tokenizer (no prefix space) writes each UTF-8 byte as one of 256 printable symbols, all
256 of which are in the vocabulary, so every byte is a token; merges join frequent pairs of
symbols; the ByteLevel decoder reads the symbols back. There is no normaliser. One special
token, ``<|endoftext|>`` (:data:`END_OF_TEXT`, the last id), ends each document in the token
files, so a model learns where text ends and generation stops there; it stands for no bytes.
For any text that does not spell ``<|endoftext|>`` the file's own ``Tokenizer.encode(text).ids``
equals ``encode(text.encode("utf-8"))`` and its ``decode`` of those ids gives the text back;
octlm's ``encode`` reads those 13 characters as text wherever they occur (a corpus of Python or
of web pages may hold them), where the ``tokenizers`` file (and so transformers and llama.cpp)
reads them as the special token, as GPT-2's does. A BPE run folder whose tokenizer
has no end token reads with ``end_token`` None and works without one.

``ByteTokenizer`` has no end token: a byte run's token is its byte, so its token files are the
corpus bytes as uint8 and a byte run folder holds no tokenizer file at all. A 257th id would
make byte token files uint16 (twice the size), and a folder without a tokenizer file could not
tell a 257-token byte run from the 256-token ones already trained, checkpointed and exported;
those keep working unchanged instead. Packing (``octlm train --pack``) keeps a byte run's
documents apart.

Chat tokens (``<|im_start|>``, ``<|im_end|>``: :mod:`octlm.chatml`) are special tokens added
after a tokenizer's last id (:func:`with_chat_tokens`), standing for no bytes, as the end of
text does. A byte run fine-tuned on conversations keeps a ``tokenizer.json`` of its own: the
256 bytes as a BPE without merges (each byte's id its value) and the chat tokens at 256 and
257. It reads as a :class:`BPETokenizer` named ``bytes`` (vocabulary 258, uint16 token files);
byte runs without chat tokens stay as they are. Other special tokens a transformers folder's
tokenizer holds (padding, a start of text) load too, each standing for no bytes.

Bytes that are not UTF-8: ``tokenizers`` takes text only, so ``encode`` cuts the data into
its maximal valid UTF-8 runs and the single bytes between them (the bytes Python's
``surrogateescape`` escapes). The runs go through the BPE; each other byte becomes the token
of its own symbol. ``decode`` writes every token's symbols back as bytes, whatever they
spell, so the bytes come back exactly, valid UTF-8 or not.

Long documents are encoded a piece at a time (:func:`text_pieces`): pieces are cut only at a
single space or line break between two characters that are not whitespace, where GPT-2's
pre-tokenizer starts a new word whichever side of the cut the text lies (its pattern looks
ahead, never behind), so the tokens equal those of the whole text. A document of more than
:data:`LONGEST_WORD` characters with no such place is cut there anyway. Many short documents
are encoded together (``encode_batch``), on every core the ``tokenizers`` library uses.

``load_tokenizer(folder)`` gives a run folder's tokenizer: a folder with ``tokenizer.json`` is
a BPE run (or a byte run with chat tokens), one without is a byte run. ``tokenizers`` is
imported on the BPE paths only.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from octlm.chatml import CHAT_TOKENS

NAMES = ("bytes", "bpe")
BYTE_VOCAB = 256
DEFAULT_BPE_VOCAB = 4096
END_OF_TEXT = "<|endoftext|>"  # a BPE run's one special token: the end of a document
MAX_VOCAB = 2**32  # token files hold ids in at most 32 bits
TOKENIZER_FILE = "tokenizer.json"
RUN_CONFIG = "config.json"  # a run folder's configuration: its model's vocab_size
STORING = f".{TOKENIZER_FILE}.tmp"  # tokenizer.json while it is written (then renamed)
# One byte that is not UTF-8, as decoding with surrogateescape leaves it (U+DC80..U+DCFF).
ESCAPED = re.compile("([\udc80-\udcff])")
# Where a long text may be cut without changing its tokens (see the module docstring).
CUT = re.compile(r"(?<=\S)[ \n](?=\S)")
PIECE = 1 << 18  # characters of a long document encoded at a time
STREAM_BATCH = 16  # pieces of a long document encoded together, on every core
LONGEST_WORD = 64 * PIECE  # a text with no place to cut is cut here anyway


def byte_symbols() -> list[str]:
    """The symbol byte-level BPE writes for each byte (index: the byte's value).

    Bytes that are printable in Latin-1 stand for themselves; the others, in byte order, for
    the code points from 256 up, so that no symbol is a space or a control character.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    symbols, spare = [], 256
    for byte in range(BYTE_VOCAB):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(spare))
            spare += 1
    return symbols


def check_bpe_vocab_size(vocab_size: object) -> int:
    """``vocab_size`` if a BPE may have it: the 256 byte symbols and one more token (the end
    of text, or a merge in a run from before it), and ids that token files can hold;
    ``ValueError`` otherwise."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    if not BYTE_VOCAB < vocab_size <= MAX_VOCAB:
        raise ValueError(
            f"a BPE vocab_size must be above {BYTE_VOCAB} (the {BYTE_VOCAB} byte symbols and the "
            f"end-of-text token) and at most 2**32, got {vocab_size}"
        )
    return vocab_size


def _checked_data(data: object) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    return bytes(data)


def _checked_ids(ids: object, vocab_size: int) -> list[int]:
    """``ids`` (a sequence of ints or a 1-D integer tensor) as a list of ints below
    ``vocab_size``; ``TypeError`` or ``ValueError`` naming what is wrong."""
    if isinstance(ids, Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise TypeError(f"ids must be a 1-D integer tensor, got {ids.dim()}-D {ids.dtype}")
        ids = ids.tolist()
    elif isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise TypeError(f"ids must be a sequence of ints or a 1-D tensor, got {type(ids).__name__}")
    ids = list(ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        wrong = next(i for i in ids if not isinstance(i, int) or isinstance(i, bool))
        raise TypeError(f"ids must be ints, got {wrong!r}")
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise ValueError(f"ids must lie in [0, {vocab_size}), got {min(ids)}..{max(ids)}")
    return ids


class ByteTokenizer:
    """Bytes as tokens: the id of a byte is its value."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    end_token = None  # see the module docstring: a byte run has no end-of-text token
    special_ids: dict[str, int] = {}  # noqa: RUF012 (read only)

    def encode(self, data: bytes) -> list[int]:
        return list(_checked_data(data))

    def encode_batch(self, texts: list[bytes]) -> list[bytes]:
        """Each text's tokens: its bytes."""
        return texts

    def encode_stream(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The tokens of one text given in ``chunks``: the chunks themselves."""
        return iter(chunks)

    def decode(self, ids) -> bytes:
        return bytes(_checked_ids(ids, self.vocab_size))

    @property
    def token_bytes(self) -> Tensor:
        """How many bytes each token stands for ``(V,)`` int64: one."""
        return torch.ones(self.vocab_size, dtype=torch.int64)

    def save(self, folder: str | os.PathLike) -> None:
        """Nothing to write: a run folder without ``tokenizer.json`` is a byte run."""


class BPETokenizer:
    """Byte-level BPE over a ``tokenizers.Tokenizer`` (see the module docstring)."""

    def __init__(self, tokenizer, where: str = "the tokenizer"):
        spec = json.loads(tokenizer.to_str())
        _check_byte_level(spec, where)
        # Without GPT-2's pattern a text is one word: it is encoded whole, never cut.
        self._piece = PIECE if spec["pre_tokenizer"].get("use_regex", True) else None
        tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a text is text
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.end_token: int | None = tokenizer.token_to_id(END_OF_TEXT)  # id, or None
        # its special tokens (the end of text, chat tokens), which stand for no bytes
        self.special_ids = {
            token["content"]: token["id"] for token in spec.get("added_tokens") or []
        }
        vocabulary = tokenizer.get_vocab()  # symbols -> id
        if sorted(vocabulary.values()) != list(range(self.vocab_size)):
            raise ValueError(f"{where}: its ids are not 0..{self.vocab_size - 1}, one each")
        symbols = byte_symbols()
        missing = [byte for byte, symbol in enumerate(symbols) if symbol not in vocabulary]
        if missing:
            raise ValueError(
                f"{where}: {len(missing)} of the {BYTE_VOCAB} byte symbols are not in its "
                f"vocabulary (byte {missing[0]} first), so some bytes have no token"
            )
        probe = probe_text()
        if tokenizer.decode(tokenizer.encode(probe).ids) != probe:
            raise ValueError(
                f"{where} is not a byte-level BPE as octlm trains it (check decoding): decoding "
                "its tokens does not give the text back"
            )
        self._byte_ids = [vocabulary[symbol] for symbol in symbols]  # byte -> id
        value = {symbol: byte for byte, symbol in enumerate(symbols)}
        self._pieces = [b""] * self.vocab_size  # id -> the bytes it stands for
        for token, index in vocabulary.items():
            if token in self.special_ids:
                continue
            if not all(character in value for character in token):
                raise ValueError(f"{where}: token {token!r} is not made of byte symbols")
            self._pieces[index] = bytes(value[character] for character in token)
        # bytes: no merges, and each byte's id its value (a byte run given chat tokens)
        plain = self.vocab_size - len(self.special_ids) == BYTE_VOCAB
        plain = plain and set(self.special_ids) <= set(CHAT_TOKENS)  # bytes and chat tokens only
        self.name = "bytes" if plain and self._byte_ids == list(range(BYTE_VOCAB)) else "bpe"

    @classmethod
    def train(cls, texts: Iterable[bytes], vocab_size: int) -> BPETokenizer:
        """A BPE of ``vocab_size`` tokens learned from ``texts``: the byte symbols, merges, and
        :data:`END_OF_TEXT` as the last id; ``ValueError`` when they hold too few distinct
        pairs to merge that many."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        check_bpe_vocab_size(vocab_size)
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - 1,
            show_progress=False,
            special_tokens=[],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        runs = (run for data in texts for run in _valid_runs(_checked_data(data))[::2] if run)
        tokenizer.train_from_iterator(runs, trainer=trainer)
        learned = tokenizer.get_vocab_size() + 1  # with the end of text
        if learned < vocab_size and learned == BYTE_VOCAB + 1:
            raise ValueError(
                f"vocab_size {vocab_size}: the training text holds no pair of symbols to merge "
                "(no two characters side by side within a word), so a BPE learns nothing from "
                "it; use --tokenizer bytes, or more text"
            )
        if learned < vocab_size:
            raise ValueError(
                f"vocab_size {vocab_size}: the training text yields only {learned} tokens "
                f"({BYTE_VOCAB} bytes, {learned - BYTE_VOCAB - 1} merges and the end of text); "
                f"use a vocab_size of at most {learned}, or more text"
            )
        tokenizer.add_special_tokens([END_OF_TEXT])  # id vocab_size - 1
        return cls(tokenizer)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> BPETokenizer:
        """The BPE a ``tokenizer.json`` holds; ``ValueError`` for a damaged or foreign file."""
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the library reports a bad file as a bare Exception
            raise ValueError(f"{str(path)!r} is not a tokenizers file ({error})") from None
        return cls(tokenizer, repr(str(path)))

    def encode(self, data: bytes) -> list[int]:
        return self._encode_text(_checked_data(data).decode("utf-8", errors="surrogateescape"))

    def _encode_text(self, text: str) -> list[int]:
        """The ids of ``text``, whose bytes that are not UTF-8 are surrogate escapes."""
        ids: list[int] = []
        for index, piece in enumerate(ESCAPED.split(text)):
            if index % 2:  # a byte that is not UTF-8: the token of its symbol
                ids.append(self._byte_ids[ord(piece) - 0xDC00])
            elif piece:
                ids += self._tokenizer.encode(piece, add_special_tokens=False).ids
        return ids

    def encode_batch(self, texts: list[bytes]) -> list[list[int]]:
        """Each text's ids, as :meth:`encode` gives them, encoded together on every core."""
        return self._encode_texts([t.decode("utf-8", errors="surrogateescape") for t in texts])

    def encode_stream(self, chunks: Iterable[bytes]) -> Iterator[list[int]]:
        """The ids of one text given in ``chunks``, a piece at a time (:data:`STREAM_BATCH`
        pieces encoded together): together, those of :meth:`encode` of the whole text."""
        batch = []
        for text in text_pieces(chunks, self._piece):
            batch.append(text)
            if len(batch) == STREAM_BATCH:
                yield from self._encode_texts(batch)
                batch = []
        yield from self._encode_texts(batch)

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text (surrogate escapes for bytes that are not UTF-8): those without
        such bytes encoded together, the others on their own."""
        plain = [not ESCAPED.search(text) for text in texts]
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        together = [text for text, alone in zip(texts, plain, strict=True) if alone]
        found = iter(encode(together, add_special_tokens=False))
        return [
            next(found).ids if alone else self._encode_text(text)
            for text, alone in zip(texts, plain, strict=True)
        ]

    def decode(self, ids) -> bytes:
        return b"".join(self._pieces[i] for i in _checked_ids(ids, self.vocab_size))

    @property
    def token_bytes(self) -> Tensor:
        """How many bytes each token stands for ``(V,)`` int64."""
        return torch.tensor([len(piece) for piece in self._pieces], dtype=torch.int64)

    def save(self, folder: str | os.PathLike) -> None:
        """Write ``folder/tokenizer.json`` atomically: a temporary file, fsynced, renamed."""
        temporary = Path(folder) / STORING
        try:
            with temporary.open("w") as out:
                out.write(self._tokenizer.to_str())
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, Path(folder) / TOKENIZER_FILE)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids are the UTF-8 bytes of any text (a BPE of the 256
    byte symbols, id each byte's value, and no merges), which decodes them back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocabulary = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def with_chat_tokens(tokenizer: ByteTokenizer | BPETokenizer) -> BPETokenizer:
    """``tokenizer`` with the chat tokens it lacks (:data:`octlm.chatml.CHAT_TOKENS`) added as
    special tokens after its last id; itself when it has them all.

    A byte tokenizer becomes the 256 bytes (each id its byte's value) and the chat tokens, ids
    256 and up, kept in a ``tokenizer.json`` of its own and still named ``bytes``.
    """
    from tokenizers import Tokenizer

    missing = [token for token in CHAT_TOKENS if token not in tokenizer.special_ids]
    if not missing:
        return tokenizer
    if isinstance(tokenizer, ByteTokenizer):
        inner = byte_level_tokenizer()
    else:
        inner = Tokenizer.from_str(tokenizer._tokenizer.to_str())
    inner.add_special_tokens(missing)  # ids from the vocabulary's size up
    return BPETokenizer(inner)


def text_pieces(chunks: Iterable[bytes], size: int | None = PIECE) -> Iterator[str]:
    """The text of the bytes in ``chunks`` (bytes that are not UTF-8 as surrogate escapes), in
    pieces of about ``size`` characters cut where :data:`CUT` allows (None: whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    text = ""
    for chunk in chunks:
        text += decoder.decode(chunk)
        while size is not None and len(text) >= size:
            cut = _last_cut(text) or (LONGEST_WORD if len(text) >= LONGEST_WORD else 0)
            if not cut:
                break
            yield text[:cut]
            text = text[cut:]
    text += decoder.decode(b"", final=True)
    if text:
        yield text


def _last_cut(text: str) -> int:
    """The last place :data:`CUT` allows in ``text`` (past its first character), or 0."""
    window = 4096
    while True:
        start = max(len(text) - window, 1)
        found = [match.start() for match in CUT.finditer(text, start)]
        if found or start == 1:
            return found[-1] if found else 0
        window *= 16


def _valid_runs(data: bytes) -> list[str]:
    """``data`` cut into its maximal valid UTF-8 runs (even places, maybe empty) and, between
    them, each byte that is not UTF-8 as its escape (odd places, one character each)."""
    return ESCAPED.split(data.decode("utf-8", errors="surrogateescape"))


def _check_byte_level(spec: dict, where: str) -> None:
    """Raise ValueError unless ``spec`` (a tokenizer.json) is a byte-level BPE whose ids are
    those of its own ``encode``, naming each field that keeps it from being one: a BPE model,
    no normaliser, no added tokens but special ones, a ByteLevel pre-tokenizer without prefix space
    and a ByteLevel decoder. Added tokens must be special (the end of text, chat tokens), and a
    post-processor may only be ByteLevel's, which adds none."""
    pre = spec.get("pre_tokenizer") or {}
    plain_added = [t.get("content") for t in spec.get("added_tokens") or [] if not t.get("special")]
    processor = spec.get("post_processor") or {}
    adds = processor.get("type") not in (None, "ByteLevel")
    model = (spec.get("model") or {}).get("type")
    checks = {
        "model": (model != "BPE", f"its model is {model!r}, not 'BPE'"),
        "normalizer": (
            spec.get("normalizer") is not None,
            "it has a normalizer, which changes the text before it is split",
        ),
        "added_tokens": (
            bool(plain_added),
            f"it has added tokens that are not special ({plain_added[:3]}), which would be "
            "read out of the text",
        ),
        "post_processor": (adds, "its post-processor adds tokens to the text"),
        "pre_tokenizer": (
            pre.get("type") != "ByteLevel" or bool(pre.get("add_prefix_space")),
            "its pre-tokenizer has no ByteLevel step, so bytes are not all tokens"
            if pre.get("type") != "ByteLevel"
            else "its ByteLevel pre-tokenizer adds a prefix space, so decoding its tokens does "
            "not give the text back",
        ),
        "decoder": (
            (spec.get("decoder") or {}).get("type") != "ByteLevel",
            "its decoder is not ByteLevel",
        ),
    }
    wrong = {name: reason for name, (bad, reason) in checks.items() if bad}
    if wrong:
        raise ValueError(
            f"{where} is not a byte-level BPE as octlm trains it (check {', '.join(wrong)}): "
            f"{'; '.join(dict.fromkeys(wrong.values()))}"
        )


def probe_text() -> str:
    """Text whose UTF-8 bytes include every byte that UTF-8 text can hold: ASCII, and each
    lead byte with continuation bytes, plus runs of spaces and line ends."""
    encoded = bytearray(range(0x80)) + b"  \n\n\t\r\n"
    for lead in range(0xC2, 0xF5):
        length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        second = {0xE0: 0xA0, 0xF0: 0x90}.get(lead, 0x80)  # the smallest a lead byte allows
        encoded += bytes([lead, second + (lead % 16), *[0x80 + lead % 32] * (length - 2)])
    text = encoded.decode()
    return text + "".join(map(chr, range(0x80, 0x100)))


def load_tokenizer(folder: str | os.PathLike) -> ByteTokenizer | BPETokenizer:
    """A run folder's tokenizer: its ``tokenizer.json``, or bytes if it has none.

    ``ValueError`` when the folder's ``config.json`` gives its model another vocabulary (a BPE
    run whose ``tokenizer.json`` was lost would otherwise read as bytes), naming both sizes.
    """
    path = Path(folder) / TOKENIZER_FILE
    tokenizer = BPETokenizer.from_file(path) if path.is_file() else ByteTokenizer()
    model = _run_vocab_size(Path(folder) / RUN_CONFIG)
    if model is not None and model != tokenizer.vocab_size:
        found = (
            f"its {TOKENIZER_FILE} has {tokenizer.vocab_size} tokens"
            if path.is_file()
            else f"it has no {TOKENIZER_FILE}, so its tokens would be bytes ({BYTE_VOCAB})"
        )
        raise ValueError(
            f"run folder {str(folder)!r}: its model has a vocabulary of {model} tokens but "
            f"{found}; put the run's own {TOKENIZER_FILE} back"
        )
    return tokenizer


def _run_vocab_size(config: Path) -> int | None:
    """The model's vocab_size a run's ``config.json`` names; None without a readable one (the
    run's own loading reports that)."""
    try:
        size = json.loads(config.read_text())["model"]["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None
