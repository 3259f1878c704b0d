"""The recipe that fits the corpus: --tokenizer auto follows how many times a BPE run would
read its training text, a token folder keeps its own, and a tokenizer given stays."""

from __future__ import annotations

import pytest

from octlm.training import recipe, resolve
from octlm.training.prepare import prepare_folder


@pytest.fixture
def small(tmp_path):
    """A 49 kB text: a default run of 1,000 steps of 16 x 128 tokens reads it many times."""
    path = tmp_path / "small.txt"
    path.write_text("A small corpus, read many times over. " * 1300)
    return path


def one_pass_steps(path) -> int:
    """Steps of 16 x 128 tokens (the defaults) in which a BPE run reads ``path``'s training
    split once."""
    size = len(path.read_bytes()) * 0.9  # the training split: --val-share 0.1 of one document
    return int(size / recipe.BPE_BYTES_PER_TOKEN // (16 * 128))


def test_a_small_corpus_read_many_times_gets_bytes_and_says_why(small):
    said = []
    model, run = resolve(run={"data": str(small)}, said=said)
    assert (run.tokenizer, model.vocab_size) == ("bytes", 256)
    assert (run.batch, run.length, model.max_length) == (8, 256, 256)  # as many tokens a step
    # 1,000 steps x 16 x 128 tokens x 3.3 bytes / 44,460 bytes
    said_rows = "; rows of 8 x 256 bytes"
    assert said == [f"--tokenizer bytes (auto: BPE would read 44.5kB 152 times{said_rows})"]


def test_rows_given_stay_as_given(small):
    _model, run = resolve(run={"data": str(small), "length": 64})
    assert (run.tokenizer, run.batch, run.length) == ("bytes", 16, 64)
    _model, run = resolve(run={"data": str(small), "batch": 4})
    assert (run.tokenizer, run.batch, run.length) == ("bytes", 4, 128)
    _model, run = resolve(run={"data": str(small), "tokenizer": "bytes"})
    assert (run.batch, run.length) == (16, 128)  # bytes asked for: the defaults' rows


def test_a_corpus_read_a_few_times_keeps_bpe(small):
    for times, expected in ((1, "bpe"), (4, "bpe"), (5, "bytes")):
        steps = one_pass_steps(small) * times
        model, run = resolve(run={"data": str(small), "steps": steps})
        assert run.tokenizer == expected, times
    assert model.vocab_size == 256
    model, run = resolve(run={"data": str(small), "steps": one_pass_steps(small)})
    assert (run.tokenizer, model.vocab_size) == ("bpe", 4096)


def test_a_given_tokenizer_stays_and_says_nothing(small):
    said = []
    model, run = resolve(run={"data": str(small), "tokenizer": "bpe"}, said=said)
    assert (run.tokenizer, model.vocab_size, said) == ("bpe", 4096, [])


def test_a_time_budget_counts_at_the_stated_rate_and_steps_bound_it(small):
    size = len(small.read_bytes()) * 0.9
    seconds = 2 * size / recipe.TOKENS_PER_SECOND  # 2 passes of bytes, 6.6 of a BPE
    _model, run = resolve(run={"data": str(small), "time_budget": f"{seconds:.0f}s"})
    assert run.tokenizer == "bytes"
    _model, run = resolve(run={"data": str(small), "time_budget": "1h", "steps": 1})
    assert run.tokenizer == "bpe"  # one step, whatever the budget


def test_a_token_folder_keeps_its_tokenizer(small, tmp_path):
    _model, given = resolve(run={"data": str(small), "tokenizer": "bpe"})
    prepare_folder(given, 280, tmp_path / "tokens", progress=False)
    said = []
    _model, run = resolve(
        model={"vocab_size": 280}, run={"data": str(tmp_path / "tokens")}, said=said
    )
    assert run.tokenizer == "bpe" and said[0].startswith("--tokenizer bpe (auto: the tokens of")
