"""How much one ``octlm verify`` run covers: :data:`FULL`, or :data:`QUICK` (``--quick``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

TESTED_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Plan:
    """The sizes one run covers: :data:`FULL`, :data:`QUICK` (``--quick``), or smaller."""

    lengths: tuple[int, ...]  # tiled vs sdpa, the reference grid's lengths
    blocks: tuple[int, ...]
    invariance_length: int
    invariance_blocks: tuple[int | tuple[int, int], ...]
    partial_length: int
    partial_blocks: tuple[int, ...]
    gradient_length: int
    gradient_blocks: tuple[int | tuple[int, int], ...]
    structure_length: int  # documents, left padding, modifiers, sinks, block mask
    structure_block: tuple[int, int]
    model: dict  # ModelConfig fields shared by the model-level experiments
    model_batch: int
    model_length: int
    kv_heads: tuple[int, ...]
    prompt_length: int
    new_tokens: int
    train_steps: int
    train_batch: int
    train_length: int


FULL = Plan(
    lengths=(128, 512, 1024),
    blocks=(64, 128, 256),
    invariance_length=1024,
    invariance_blocks=(16, 32, 64, 128, 256, 512, 1024, (64, 256), (256, 64), (32, 512)),
    partial_length=1024,
    partial_blocks=(64, 256),
    gradient_length=512,
    gradient_blocks=(64, (128, 32)),
    structure_length=512,
    structure_block=(64, 32),
    model=dict(vocab_size=256, width=256, n_layers=4, n_heads=8, max_length=512, block=64),
    model_batch=2,
    model_length=256,
    kv_heads=(8, 4, 2, 1),
    prompt_length=32,
    new_tokens=64,
    train_steps=20,
    train_batch=4,
    train_length=64,
)
QUICK = replace(
    FULL,
    invariance_length=512,
    invariance_blocks=(32, 64, 128, 512, (64, 128), (128, 32)),
    partial_length=256,
    partial_blocks=(64,),
    gradient_length=256,
    gradient_blocks=(64,),
    structure_length=128,
    structure_block=(32, 16),
    model=dict(vocab_size=256, width=128, n_layers=2, n_heads=8, max_length=256, block=32),
    model_length=128,
    prompt_length=16,
    new_tokens=24,
)


def default_dtypes(device: str) -> tuple[str, ...]:
    """float32 and bfloat16 on CPU; on CUDA also float16, the GPU's other half precision."""
    if device.startswith("cuda"):
        return ("float32", "float16", "bfloat16")
    return ("float32", "bfloat16")
