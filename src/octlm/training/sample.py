"""Text from a trained model, decoded with the KV cache (``octlm.load_run`` reads a run folder)."""

from __future__ import annotations

import torch

from octlm.model import OctLM
from octlm.tokenizer import END_OF_TEXT, BPETokenizer, ByteTokenizer
from octlm.training.config import prompt_bytes


def generate_text(
    model: OctLM,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    tokenizer: ByteTokenizer | BPETokenizer | None = None,
    stop: bool = True,
) -> str:
    """``prompt`` continued by ``max_new_tokens`` tokens, encoded and decoded by the model's
    ``tokenizer`` (default: bytes), as UTF-8 text (bad bytes replaced).

    Generation stops at the tokenizer's end-of-text token (not in the text); with ``stop``
    False it goes on past it, written as ``<|endoftext|>``. A tokenizer without one (bytes, a
    BPE tokenizer that has none) runs the ``max_new_tokens``.

    The model knows ``max_length`` positions: up to there the text is decoded with one KV
    cache; past them each token is drawn from the last ``max_length - 1`` tokens, a forward
    pass each, as nanoGPT crops its context at every step (docs/llama_cpp.md says what
    llama.cpp and transformers do there).
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} tokens and the model "
            f"{model.config.vocab_size}: use the tokenizer of the model's run (load_tokenizer)"
        )
    encoded = tokenizer.encode(prompt_bytes(prompt))
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens and model.config.max_length < 2:
        raise ValueError(
            "generating text needs max_length >= 2 (a token of context and the next one), got "
            f"{model.config.max_length}"
        )
    device = next(model.parameters()).device
    limit = model.config.max_length
    tokens = torch.tensor([encoded], device=device)  # (1, P)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        new, end = 0, tokenizer.end_token if stop else None
        while new < max_new_tokens:
            context = tokens[:, -(limit - 1) :]  # (1, C): what the next position can see
            count = min(limit - context.shape[1], max_new_tokens - new)  # 1 once it is full
            drawn = model.generate(context, count, temperature, top_k, generator, end)
            tokens = torch.cat([tokens, drawn[:, context.shape[1] :]], dim=1)  # (1, P + new)
            new += count
            if end is not None and tokens[0, -1] == end:  # the text has ended
                tokens = tokens[:, :-1]
                break
    finally:
        model.train(was_training)
    ids = tokens[0].tolist()
    if tokenizer.end_token is not None:  # split at each end of text, marked in the text
        pieces, begin = [], 0
        for index in [i for i, token in enumerate(ids) if token == tokenizer.end_token]:
            pieces.append(tokenizer.decode(ids[begin:index]))
            begin = index + 1
        text = END_OF_TEXT.encode().join([*pieces, tokenizer.decode(ids[begin:])])
    else:
        text = tokenizer.decode(ids)
    return text.decode("utf-8", errors="replace")
