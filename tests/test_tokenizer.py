"""octlm.tokenizer: every byte string comes back from bytes and from BPE tokens, and a BPE's ids
are those the tokenizers library gives when it reads the saved tokenizer.json by itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from octlm.tokenizer import (
    END_OF_TEXT,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    byte_symbols,
    load_tokenizer,
)

WORDS = ["def", " return", " self", "héllo", " wörld", " 中文", " naïve", "\n    ", " = ", "😀"]
VOCAB = 300


def training_texts() -> list[bytes]:
    """Documents of corpus words, one of them with bytes that are not UTF-8."""
    generator = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(20):
        picks = torch.randint(len(WORDS), (80,), generator=generator).tolist()
        texts.append("".join(WORDS[i] for i in picks).encode())
    texts[3] += b"\xff\xfe\xc3(\xed\xa0\x80"
    return texts


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(training_texts(), VOCAB)


@pytest.fixture(scope="module")
def library(bpe, tmp_path_factory) -> Tokenizer:
    """The saved tokenizer.json as the tokenizers library reads it, octlm aside."""
    folder = tmp_path_factory.mktemp("bpe")
    bpe.save(folder)
    return Tokenizer.from_file(str(folder / TOKENIZER_FILE))


# Text that hits the merges: corpus words and anything else, in any order.
texts = st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=6)), max_size=12).map("".join)
# Bytes of every kind: corpus words, valid UTF-8, and bytes that are not.
mixed = st.lists(
    st.one_of(st.sampled_from(WORDS).map(str.encode), texts.map(str.encode), st.binary(max_size=5)),
    max_size=10,
).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(st.binary(max_size=64), mixed))
def test_bpe_gives_back_any_bytes(bpe, data):
    ids = bpe.encode(data)
    assert all(isinstance(i, int) and 0 <= i < VOCAB for i in ids)
    assert bpe.decode(ids) == data
    assert int(bpe.token_bytes[torch.tensor(ids, dtype=torch.int64)].sum()) == len(data)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_bpe_ids_are_those_of_the_library_reading_the_file(bpe, library, text):
    ids = library.encode(text).ids
    assert bpe.encode(text.encode("utf-8")) == ids
    assert library.decode(ids) == text
    assert bpe.decode(ids) == text.encode("utf-8")


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=64))
def test_bytes_are_their_own_tokens(data):
    tokenizer = ByteTokenizer()
    assert tokenizer.encode(data) == list(data)
    assert tokenizer.decode(list(data)) == data
    assert tokenizer.decode(torch.tensor(list(data), dtype=torch.int64)) == data


def test_bpe_learns_the_vocabulary_asked_for(bpe):
    assert bpe.vocab_size == VOCAB
    text = b"".join(training_texts())
    assert len(bpe.encode(text)) < len(text) / 2  # merges cover the corpus words
    assert any(bpe.decode([i]) == " wörld".encode() for i in range(VOCAB))


def test_byte_symbols_are_the_library_s(bpe):
    """Every byte UTF-8 uses is written as the library's ByteLevel pre-tokenizer writes it
    (the rest, C0, C1 and F5..FF, only in invalid data), and the symbols are its alphabet."""
    points = [*range(0x800), *range(0x800, 0xD800, 0x40), *range(0xE000, 0x110000, 0x1000)]
    text = "".join(map(chr, points))
    used = set(text.encode())
    assert used == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    written = "".join(piece for piece, _ in level.pre_tokenize_str(text))
    symbols = byte_symbols()
    assert written == "".join(symbols[byte] for byte in text.encode())
    assert sorted(symbols) == sorted(pre_tokenizers.ByteLevel.alphabet())


def test_a_folder_gives_its_tokenizer(bpe, tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # no tokenizer.json: bytes
    bpe.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert (loaded.name, loaded.vocab_size) == ("bpe", VOCAB)
    assert all(loaded.encode(text) == bpe.encode(text) for text in training_texts())
    assert sorted(p.name for p in tmp_path.iterdir()) == [TOKENIZER_FILE]  # no temporary file


def test_the_end_of_text_is_the_last_id_and_no_text(bpe, library):
    """The one special token: the last id, standing for no bytes; octlm reads its spelling in
    a text as text, the library's file as the token (as GPT-2's does)."""
    end = VOCAB - 1
    assert bpe.end_token == end and library.token_to_id(END_OF_TEXT) == end
    assert bpe.decode([end]) == b"" and int(bpe.token_bytes[end]) == 0
    text = f"x = '{END_OF_TEXT}'".encode()
    assert end not in bpe.encode(text) and bpe.decode(bpe.encode(text)) == text
    assert end in library.encode(text.decode()).ids
    assert ByteTokenizer().end_token is None


def test_a_bpe_from_before_the_end_token_still_loads(bpe, tmp_path):
    spec = json.loads(bpe._tokenizer.to_str())
    spec["added_tokens"] = []  # a vocabulary of byte symbols and merges only
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(spec))
    old = load_tokenizer(tmp_path)
    assert (old.end_token, old.vocab_size) == (None, VOCAB - 1)
    assert all(old.encode(text) == bpe.encode(text) for text in training_texts())


def test_special_tokens_stand_for_no_bytes_and_plain_added_tokens_are_refused(bpe, tmp_path):
    """A special token other than the end of text (a chat or padding token of a transformers
    folder) is read as such; an added token that is not special would be matched in the text,
    so the tokenizer is refused, naming the field."""
    spec = json.loads(bpe._tokenizer.to_str())
    spec["added_tokens"] = [{**spec["added_tokens"][0], "content": "<pad>"}]
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(spec))
    padded = load_tokenizer(tmp_path)
    assert padded.special_ids == {"<pad>": VOCAB - 1} and padded.end_token is None
    assert padded.decode([VOCAB - 1]) == b"" and padded.name == "bpe"
    assert all(padded.encode(text) == bpe.encode(text) for text in training_texts())
    spec["added_tokens"][0]["special"] = False
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"check added_tokens.*not special \(\['<pad>'\]\)"):
        load_tokenizer(tmp_path)
    spec["added_tokens"][0]["special"] = True
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<pad>", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<pad>": {"id": "<pad>", "ids": [VOCAB - 1], "tokens": ["<pad>"]}},
    }
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"check post_processor.*adds tokens"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("tokenizer", ["missing", "another"])
def test_a_run_whose_tokenizer_does_not_fit_its_model_is_refused(bpe, tmp_path, tokenizer):
    """A BPE run without its tokenizer.json would read as bytes: both sizes are named."""
    (tmp_path / "config.json").write_text(json.dumps({"model": {"vocab_size": VOCAB + 20}}))
    if tokenizer == "another":
        bpe.save(tmp_path)
    found = f"{TOKENIZER_FILE} has {VOCAB}" if tokenizer == "another" else "bytes \\(256\\)"
    with pytest.raises(ValueError, match=rf"vocabulary of {VOCAB + 20} tokens but .*{found}"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "texts, vocab_size, match",
    [
        ([b"abab"], VOCAB, r"yields only 259 tokens .* at most 259"),  # ab, abab, the end
        ([b"a", b"b"], VOCAB, r"no pair of symbols to merge.*--tokenizer bytes"),
        (training_texts(), 256, "above 256"),
        (training_texts(), 2**32 + 1, "at most 2"),
        (training_texts(), "300", "must be an int, got '300'"),
        (training_texts(), True, "must be an int, got True"),
    ],
)
def test_bpe_refuses_a_vocabulary_it_cannot_have(texts, vocab_size, match):
    with pytest.raises(ValueError, match=match):
        BPETokenizer.train(texts, vocab_size)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_bad_input_is_named(bpe, tokenizer):
    tokenizer = bpe if tokenizer == "bpe" else ByteTokenizer()
    size = tokenizer.vocab_size
    with pytest.raises(TypeError, match="data must be bytes, got str"):
        tokenizer.encode("text")
    with pytest.raises(ValueError, match=rf"ids must lie in \[0, {size}\), got 1..{size}"):
        tokenizer.decode([1, size])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, "):
        tokenizer.decode([-1])
    with pytest.raises(TypeError, match=r"ids must be ints, got 1\.5"):
        tokenizer.decode([1, 1.5])
    with pytest.raises(TypeError, match="1-D integer tensor, got 2-D"):
        tokenizer.decode(torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="ids must be a sequence of ints"):
        tokenizer.decode(b"ab")


def test_a_foreign_or_damaged_file_is_refused(bpe, tmp_path):
    (tmp_path / TOKENIZER_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizers file"):
        load_tokenizer(tmp_path)
    normalised = Tokenizer.from_str(bpe._tokenizer.to_str())
    normalised.normalizer = normalizers.Lowercase()  # would change the text it encodes
    normalised.save(str(tmp_path / TOKENIZER_FILE))
    with pytest.raises(ValueError, match=r"not a byte-level BPE .*check normalizer"):
        load_tokenizer(tmp_path)
    words = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    words.save(str(tmp_path / TOKENIZER_FILE))
    with pytest.raises(ValueError, match="check model, pre_tokenizer"):
        load_tokenizer(tmp_path)
    spec = json.loads(bpe._tokenizer.to_str())
    kept = sorted((v, k) for k, v in spec["model"]["vocab"].items() if k != "Ā")  # byte 0's
    spec["model"]["vocab"] = {token: index for index, (_, token) in enumerate(kept)}
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "Ā" not in "".join(m)]
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"1 of the 256 byte symbols .* \(byte 0 first\)"):
        load_tokenizer(tmp_path)


def test_importing_octlm_leaves_tokenizers_out():
    """A byte run, and everything but BPE, runs without the tokenizers library."""
    code = (
        "import sys, tempfile, octlm, octlm.cli, octlm.training, octlm.tokenizer;"
        "octlm.tokenizer.load_tokenizer(tempfile.mkdtemp());"
        "sys.exit('tokenizers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


HARD_CUTS = [
    "word   \t  \r\n\r\n   word\n\n\n  x",  # long whitespace runs and CRLF
    "caf\u00e9 \u00e9t\u00e9 \u4e2d\u6587 \U0001f600 \U0001f600\n\u00e0 b",  # multi-byte characters
    "a b\nc d " * 40 + "end\u3000\u3000 x\u00a0y",  # Unicode spaces, which are no place to cut
]


@pytest.mark.parametrize("text", HARD_CUTS)
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_a_long_text_encoded_in_pieces_equals_it_encoded_whole(bpe, monkeypatch, text, chunk):
    data = text.encode() * 3 + b"\xff\xfe tail \x80"  # and bytes that are not UTF-8
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    monkeypatch.setattr(bpe, "_piece", 5)  # pieces of a few characters: cuts everywhere
    pieces = list(bpe.encode_stream(iter(chunks)))
    assert len(pieces) > 1
    assert [i for piece in pieces for i in piece] == bpe.encode(data)
    assert b"".join(ByteTokenizer().encode_stream(iter(chunks))) == data


def test_a_batch_encodes_as_each_text_alone(bpe):
    texts = [t.encode() for t in HARD_CUTS] + [b"\xff not utf-8", b""]
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]
