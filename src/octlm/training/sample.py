"""Text from a trained model, decoded with the KV cache (``octlm.load_run`` reads a run folder)."""

from __future__ import annotations

from dataclasses import replace

import torch

from octlm.model import ModelConfig, OctLM
from octlm.tokenizer import BPETokenizer, ByteTokenizer
from octlm.training.config import prompt_bytes


def single_process(config: ModelConfig) -> ModelConfig:
    """The config to run a model in one process: ring attention's local twin is tiled, run by
    auto where sdpa is faster (decoding a token)."""
    return replace(config, attention="auto") if config.attention == "ring" else config


def generate_text(
    model: OctLM,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    tokenizer: ByteTokenizer | BPETokenizer | None = None,
) -> str:
    """``prompt`` continued by ``max_new_tokens`` tokens, encoded and decoded by the model's
    ``tokenizer`` (default: bytes), as UTF-8 text (bad bytes replaced).

    The model knows positions up to ``max_length`` only, so a longer text is decoded in
    windows: when one is full, decoding starts again (a new KV cache) from the last
    ``max_length // 2`` tokens, as nanoGPT crops its context.
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
        new = 0
        while new < max_new_tokens:
            fits = new == 0 and tokens.shape[1] < limit
            context = tokens if fits else tokens[:, -(limit // 2) :]  # (1, C)
            count = min(limit - context.shape[1], max_new_tokens - new)
            drawn = model.generate(context, count, temperature, top_k, generator)  # (1, C + n)
            tokens = torch.cat([tokens, drawn[:, context.shape[1] :]], dim=1)  # (1, P + new)
            new += count
    finally:
        model.train(was_training)
    return tokenizer.decode(tokens[0].tolist()).decode("utf-8", errors="replace")
