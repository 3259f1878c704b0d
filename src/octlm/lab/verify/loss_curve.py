"""The loss curve verify compares: a tiny, deterministic training loop on shipped prose.

Byte-level next-token prediction. ``octlm verify`` and the tests use it to show that every
attention implementation trains the model the same way: same seed, same weights, same
batches, so the same loss curve. It stays this bare (plain AdamW, no schedule, any dtype
including float64) so that curves compare in float64; training a model for real is
:mod:`octlm.training` (``octlm train``).
"""

from __future__ import annotations

from importlib import resources

import torch
import torch.nn.functional as F

from octlm.model import ModelConfig, OctLM, is_int_at_least

BYTES = 256


def load_text() -> bytes:
    """The packaged training text (public-domain prose, see ``octlm/data/README.md``)."""
    return (resources.files("octlm") / "data" / "prose.txt").read_bytes()


def loss_curve(
    config: ModelConfig,
    *,
    steps: int = 20,
    batch: int = 4,
    length: int = 64,
    seed: int = 0,
    lr: float = 3e-3,
    text: bytes | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """Train a fresh ``OctLM(config)`` on CPU for ``steps`` AdamW steps; return each step's loss.

    Tokens are the bytes of ``text`` (the packaged prose by default), so ``config.vocab_size``
    must be at least 256. Each step draws ``batch`` windows of ``length + 1`` bytes at random
    offsets from a generator seeded with ``seed``; the weights and dropout come from ``seed``
    too, inside a forked RNG, so the caller's random state is left alone.
    """
    data = torch.frombuffer(bytearray(load_text() if text is None else text), dtype=torch.uint8)
    for name, value in (("steps", steps), ("batch", batch), ("length", length)):
        if not is_int_at_least(value, 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if config.vocab_size < BYTES:
        raise ValueError(f"byte tokens need vocab_size >= {BYTES}, got {config.vocab_size}")
    if length > config.max_length:
        raise ValueError(f"length ({length}) exceeds config.max_length ({config.max_length})")
    if len(data) <= length:
        raise ValueError(f"text of {len(data)} bytes is too short for length {length} + 1")
    data = data.long()
    offsets = torch.arange(length + 1)  # (length + 1,)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = OctLM(config).to(dtype).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for _ in range(steps):
            starts = torch.randint(len(data) - length, (batch, 1), generator=generator)
            windows = data[starts + offsets]  # (batch, length + 1)
            inputs, targets = windows[:, :-1], windows[:, 1:]  # (batch, length) each
            logits = model(inputs)  # (batch, length, vocab)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses
