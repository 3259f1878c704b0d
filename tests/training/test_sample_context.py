"""``octlm sample`` past the model's context: each token is drawn from the last
``max_length - 1`` tokens (nanoGPT's crop at every step), and up to the context the text is the
model's own cached decoding."""

from __future__ import annotations

import torch

from octlm import ModelConfig, OctLM
from octlm.training.sample import generate_text
from tests.transformers_folders import peaked

CONFIG = ModelConfig(vocab_size=256, width=32, n_layers=2, n_heads=4, max_length=8)


def test_each_token_past_the_context_sees_the_last_max_length_minus_one():
    model = peaked(OctLM(CONFIG))
    tokens = list(b"def ")
    with torch.no_grad():
        while len(tokens) < 4 + 20:  # greedy, by hand: the last 7 tokens, a full pass each
            logits = model(torch.tensor([tokens[-(CONFIG.max_length - 1) :]]))  # (1, C, V)
            tokens.append(int(logits[0, -1].argmax()))
    assert generate_text(model, "def ", 20) == bytes(tokens).decode("utf-8", errors="replace")


def test_up_to_the_context_the_text_is_the_cached_decoding():
    model = peaked(OctLM(CONFIG))
    with torch.no_grad():
        cached = model.generate(torch.tensor([list(b"def ")]), CONFIG.max_length - 4)[0]
    text = generate_text(model, "def ", CONFIG.max_length - 4)
    assert text == bytes(cached.tolist()).decode("utf-8", errors="replace")


def test_a_prompt_longer_than_the_context_is_read_from_its_end():
    model = peaked(OctLM(CONFIG))
    text = generate_text(model, "0123456789abcdef", 3)
    assert text.startswith("0123456789abcdef")
    assert text == "012345678" + generate_text(model, "9abcdef", 3)  # the last 7 tokens
