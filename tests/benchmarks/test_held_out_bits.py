"""``benchmarks/held_out_bits.py``: every byte of the validation split counted once, whatever the
tokenizer, and the figure is the model's mean loss over them."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch.nn.functional as F

from octlm import load_run
from octlm.training import train
from octlm.training.tokens import load_tokens, read_summary
from tests.training.test_bpe import configs, write_corpus

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "held_out_bits.py"
spec = importlib.util.spec_from_file_location("held_out_bits", SCRIPT)
held_out_bits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(held_out_bits)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_every_validation_byte_counts_once(tokenizer, tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    model = None if tokenizer == "bpe" else {"vocab_size": 256}
    model_config, run = configs(corpus, model, tokenizer=tokenizer)
    train(model_config, run, tmp_path / "run", progress=False)
    monkeypatch.setattr(held_out_bits, "BATCH", 3)  # several batches and a short last window
    record = held_out_bits.held_out(tmp_path / "run")
    assert record["checkpoint"] == "the best (lowest validation loss)"
    last = held_out_bits.held_out(tmp_path / "run", "last")
    assert last["checkpoint"] == "the last" and last["step"] >= record["step"]

    model, tokens_of, _ = load_run(tmp_path / "run")
    tokens = load_tokens(tmp_path / "run" / "data", "val", run.length).long()  # (N,)
    first = int(tokens_of.token_bytes[tokens[0]])
    val_bytes = read_summary(tmp_path / "run" / "data")["val_bytes"]
    assert record["bytes"] == val_bytes - first  # every target's bytes, the first token's not
    assert record["targets"] == len(tokens) - 1
    # consecutive windows overlapping by one token, each scored on its own
    losses = []
    for start in range(0, len(tokens) - 1, run.length):
        window = tokens[start : start + run.length + 1]  # (T + 1,) or shorter at the end
        logits = model(window[None, :-1])[0]  # (T, V)
        losses.append(F.cross_entropy(logits, window[1:], reduction="sum").item())
    assert record["bits_per_byte"] == pytest.approx(sum(losses) / math.log(2) / record["bytes"])
