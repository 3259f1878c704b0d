"""Helpers for the tests of octlm's transformers folders: models with peaked logits, run folders
written by hand, a byte-level BPE trained here, and the tolerance transformers' RoPE allows."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from octlm import ModelConfig, OctLM
from octlm.training import checkpoint
from octlm.training.config import CONFIG_FILE, RunConfig, to_dict

# Text of every kind a tokenizer must keep: accents, symbols outside the BMP, whitespace runs,
# tabs and line ends, markup-like strings.
TEXTS = [
    "def f(x):\n    return x  # done\n",
    "héllo wörld ☃ 𝄞 日本語\n\n\n",
    "  leading and   inner   spaces\t\ttabs\r\nend",
    "<0x41> <unk> </s> <|endoftext|>",
    "",
]


def peaked(model: OctLM, seed: int = 0) -> OctLM:
    """``model`` with matrices of standard deviation 0.2: logits far apart, so that greedy
    decoding is decided by margins much larger than rounding; and norm gains drawn from
    [0.5, 1.5], so that an export that swaps or drops one is seen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
            else:
                parameter.copy_(0.5 + torch.rand(parameter.shape, generator=generator))
    return model.eval()


def make_run(folder: Path, config: ModelConfig, steps=(2, 4), tokenizer: Path | None = None):
    """A run folder as ``octlm train`` leaves it (config.json, checkpoints), each checkpoint
    holding other peaked weights; a BPE ``tokenizer.json`` is copied in when given. Returns the
    model of each step."""
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text(json.dumps(to_dict(config, RunConfig())))
    if tokenizer is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    models = {}
    for step in steps:
        model = peaked(OctLM(config), seed=step)
        state = {"model_config": asdict(config), "model": model.state_dict()}
        checkpoint.save(folder, step, state, keep=len(steps))
        models[step] = model
    return models


def train_bpe(path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE (ByteLevel pre-tokenizer without prefix space and decoder, all 256
    byte symbols in the alphabet, no special tokens) trained on ``TEXTS``, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    tokenizer.save(str(path))
    return path


def rope_tolerance(reference: Tensor) -> float:
    """How far transformers' logits may lie from a float64 reference ``(B, T, V)``: it computes
    RoPE angles ``position x frequency`` in float32 (whatever the model's dtype), each off by
    up to an ulp of the position (frequencies are at most 1), so rotated queries and keys, and
    the logits, carry a relative error of about ``T x eps(float32)``; twice that is allowed."""
    length = reference.shape[1]
    return 2 * length * torch.finfo(torch.float32).eps * reference.abs().max().item()
