"""The recipe that fits the corpus: ``--tokenizer auto`` as docs/training.md states it (the
passes a BPE run would read, a vocabulary given, a BPE the text cannot reach, rows that fit the
validation split), settled once from the opened corpus, said in one line, kept on resume."""

from __future__ import annotations

import json

import pytest

from octlm.cli import main
from octlm.model import ModelConfig
from octlm.training import flags, prepare, recipe, resolve
from octlm.training.config import RunConfig
from octlm.training.corpus import Corpus
from tests.training_helpers import write_corpus

SMALL_RUN = ["--width", "16", "--n-layers", "1", "--n-heads", "2", "--eval-batches", "1"]
SMALL_RUN += ["--sample-tokens", "4", "--eval-every", "1000", "--dtype", "float32"]


@pytest.fixture
def small(tmp_path):
    """A 49 kB text: a default run of 1,000 steps of 16 x 128 tokens reads it many times."""
    path = tmp_path / "small.txt"
    path.write_text("A small corpus, read many times over. " * 1300)
    return path


def settled(corpus, folder, model: dict | None = None, run: dict | None = None):
    """What ``octlm train --data corpus`` with these flags settles to (tokens made in
    ``folder``)."""
    model, run = model or {}, {"data": str(corpus), **(run or {})}
    model_config, run_config = resolve(model=model, run=run)
    given = flags.given_names(None, model, run)
    found = Corpus.of(run_config)
    folder.mkdir(exist_ok=True)
    return prepare.make_tokens(
        found, folder, folder, model_config, run_config, given, progress=False
    )


@pytest.mark.parametrize("steps", [10, 100, 400, 1000])
@pytest.mark.parametrize(("batch", "length", "accumulate"), [(16, 128, 1), (4, 16, 2), (8, 64, 4)])
@pytest.mark.parametrize("size", [18_000, 1_000_000])
def test_the_rule_is_docs_formula(steps, batch, length, accumulate, size):
    """docs/training.md: passes = steps x batch x length x 3.3 / training bytes, with --batch
    the global batch (--accumulate counts nothing more); BPE up to 4 passes, bytes beyond."""
    run = RunConfig(steps=steps, batch=batch, length=length, accumulate=accumulate)
    documented = steps * batch * length * 3.3 / size
    name, why = recipe.tokenizer_for(run, ModelConfig(), frozenset(), size)
    assert name == ("bpe" if documented <= 4 else "bytes")
    assert f"{documented:,.2f} times" in why


def test_a_time_budget_counts_at_the_host_rate_and_steps_bound_it(monkeypatch):
    size = 1_000_000
    monkeypatch.setenv(recipe.RATE_VARIABLE, "1000")
    budget = RunConfig(time_budget="10m")  # 600,000 tokens at 1,000 a second: 1.98 passes
    assert recipe.tokenizer_for(budget, ModelConfig(), frozenset(), size)[0] == "bpe"
    monkeypatch.setenv(recipe.RATE_VARIABLE, "10000")  # 6,000,000 tokens: 19.8 passes
    assert recipe.tokenizer_for(budget, ModelConfig(), frozenset(), size)[0] == "bytes"
    bounded = RunConfig(time_budget="10m", steps=1)
    assert recipe.tokenizer_for(bounded, ModelConfig(), frozenset(), size)[0] == "bpe"
    monkeypatch.setenv(recipe.RATE_VARIABLE, "fast")
    with pytest.raises(ValueError, match="OCTLM_TOKENS_PER_SECOND must be a positive number"):
        recipe.tokenizer_for(budget, ModelConfig(), frozenset(), size)


def test_without_a_pinned_rate_a_budget_counts_at_the_hosts_measured_rate(monkeypatch):
    """The rate follows the host's peak (here given by $OCTLM_PEAK_FLOPS) and the model's
    FLOPs per token: twice the peak trains twice the tokens, a model of twice the FLOPs
    half; no peak measured: 30,000 tokens a second. The line says the rate it used."""
    monkeypatch.delenv(recipe.RATE_VARIABLE, raising=False)
    budget = RunConfig(time_budget="100s", steps=10**9)
    small = ModelConfig(width=64, n_layers=2, n_heads=2, vocab_size=4096)
    # 6 x (2 layers x (64 x 192 + 64 x 64 + 3 x 64 x 176) + 64 x 4096) + 6 x 2 x 128 x 64
    flops = 6 * (2 * (64 * 192 + 64 * 64 + 3 * 64 * 176) + 64 * 4096) + 6 * 2 * 128 * 64
    assert small.mlp_width == 176
    tokens = {}
    for peak in (1e11, 2e11):
        monkeypatch.setenv("OCTLM_PEAK_FLOPS", str(peak))
        rate = recipe.tokens_per_second(small, budget)
        assert rate == pytest.approx(peak * recipe.STEP_SHARE / flops)
        # auto's model has the byte vocabulary until it settles: the rate is a BPE run's
        bytes_model = ModelConfig(width=64, n_layers=2, n_heads=2)
        _, why = recipe.tokenizer_for(budget, bytes_model, frozenset(), 10**9)
        tokens[peak] = rate * 100
        assert f"{tokens[peak]:,.0f} tokens" in why and f"{rate:,.0f} tokens a second" in why
    assert tokens[2e11] == pytest.approx(2 * tokens[1e11])
    monkeypatch.setenv("OCTLM_PEAK_FLOPS", "0")  # not measured
    assert recipe.tokens_per_second(small, budget) == recipe.TOKENS_PER_SECOND


def test_a_small_corpus_read_many_times_gets_bytes_and_byte_rows(small, tmp_path):
    made = settled(small, tmp_path / "t")
    assert (made.run.tokenizer, made.model.vocab_size) == ("bytes", 256)
    assert (made.run.batch, made.run.length, made.model.max_length) == (8, 256, 256)
    passes = 1000 * 16 * 128 * 3.3 / 44_460  # the training split: 0.9 of the one document
    assert made.said.startswith(f"--tokenizer bytes (auto: a BPE would read it {passes:.2f} ")
    assert made.said.endswith("; rows of 8 x 256 bytes")


def test_rows_given_stay_as_given(small, tmp_path):
    made = settled(small, tmp_path / "a", run={"length": 64})
    assert (made.run.tokenizer, made.run.batch, made.run.length) == ("bytes", 16, 64)
    made = settled(small, tmp_path / "b", run={"batch": 4})
    assert (made.run.tokenizer, made.run.batch, made.run.length) == ("bytes", 4, 128)
    made = settled(small, tmp_path / "c", run={"tokenizer": "bytes"})
    assert (made.run.batch, made.run.length, made.said) == (16, 128, None)


def test_a_vocabulary_given_means_bpe_and_is_kept(tmp_path):
    """--vocab-size 300 where the passes would choose bytes: a BPE of 300, never refused for
    a tokenizer the user did not ask for."""
    corpus = write_corpus(tmp_path / "corpus", documents=30, size=2000)
    assert settled(corpus, tmp_path / "s").run.tokenizer == "bytes"  # by the passes
    made = settled(corpus, tmp_path / "t", model={"vocab_size": 300})
    assert (made.run.tokenizer, made.model.vocab_size) == ("bpe", 300)
    assert made.summary["vocab_size"] == 300 and "--vocab-size 300" in made.said


def test_a_bpe_the_text_cannot_reach_is_not_chosen(tmp_path):
    """A 2 kB corpus and --length 64: the passes choose a BPE, whose 4,096 tokens the text
    cannot reach, so auto takes bytes and says why; a BPE asked for is refused instead."""
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(bytes(range(32, 127)) * 22)
    made = settled(corpus, tmp_path / "t", run={"length": 64, "steps": 2})
    assert (made.run.tokenizer, made.model.vocab_size, made.run.length) == ("bytes", 256, 64)
    assert "cannot reach a BPE of 4,096" in made.said
    with pytest.raises(ValueError, match="yields only"):
        settled(corpus, tmp_path / "u", run={"length": 64, "steps": 2, "tokenizer": "bpe"})


def test_the_defaults_on_two_kilobytes_train(tmp_path, capsys):
    """The defaults' byte rows of 256 do not fit a 200-byte validation split: rows shrink to
    fit it, and the run trains."""
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(bytes(range(32, 127)) * 22)
    out = tmp_path / "run"
    assert (
        main(["train", "--data", str(corpus), "--out", str(out), "--steps", "2", *SMALL_RUN]) == 0
    )
    said = capsys.readouterr().out
    stored = json.loads((out / "config.json").read_text())
    held = json.loads((out / "data" / "data.json").read_text())["val_tokens"]
    assert held < 256 and stored["run"]["tokenizer"] == "bytes"
    assert stored["run"]["length"] == stored["model"]["max_length"] == (held - 1) // 8 * 8
    assert f"rows of {(held - 1) // 8 * 8} tokens, as the validation split holds {held}" in said


def test_a_resume_keeps_what_auto_chose(tmp_path):
    """The same command line with --tokenizer auto written out resumes, with more steps."""
    corpus = write_corpus(tmp_path / "corpus", documents=30, size=2000)
    out = tmp_path / "run"
    command = ["train", "--data", str(corpus), "--out", str(out), "--tokenizer", "auto"]
    command += [*SMALL_RUN, "--vocab-size", "300", "--length", "16", "--batch", "4"]
    assert main([*command, "--steps", "2"]) == 0
    assert json.loads((out / "config.json").read_text())["run"]["tokenizer"] == "bpe"
    assert main([*command, "--steps", "4", "--resume"]) == 0


def test_a_token_folder_keeps_its_tokenizer(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", documents=30, size=2000)
    tokens = tmp_path / "tokens"
    prepared = ["prepare", "--data", str(corpus), "--out", str(tokens)]
    assert main([*prepared, "--tokenizer", "bpe", "--vocab-size", "280"]) == 0
    out = tmp_path / "run"
    command = ["train", "--data", str(tokens), "--out", str(out), "--steps", "1", *SMALL_RUN]
    assert main([*command, "--length", "16", "--batch", "4"]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert (stored["run"]["tokenizer"], stored["model"]["vocab_size"]) == ("bpe", 280)
    assert f"--tokenizer bpe (auto: the tokens of {tokens})" in capsys.readouterr().out


def test_prepare_chooses_as_train_s_defaults_would_and_says_so(small, tmp_path, capsys):
    assert main(["prepare", "--data", str(small), "--out", str(tmp_path / "tokens")]) == 0
    out = capsys.readouterr().out
    assert "--tokenizer bytes (auto: a BPE would read it" in out
    stored = json.loads((tmp_path / "tokens" / "data.json").read_text())
    assert stored["tokenizer"] == "bytes"
    assert main(["prepare", "--data", str(small), "--out", str(tmp_path / "tokens")]) == 0
    assert "up to date" in capsys.readouterr().err
