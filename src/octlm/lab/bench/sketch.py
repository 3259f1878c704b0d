"""The blocking sketch, kept as a benchmark baseline (forward only).

The first form of FlashAttention's blocking in this project, written to learn it: every query
at once against one key block at a time, causal (top-left), no GQA. ``octlm bench --backends
sketch`` times it beside :func:`octlm.attention.tiled_attention`, which grew from it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sketch_attention(query: Tensor, key: Tensor, value: Tensor, block: int = 128) -> Tensor:
    """FlashAttention's blocking. One key block at a time, rescaling by a running maximum."""
    length, head_size = query.shape[-2], query.shape[-1]
    rows = torch.arange(length, device=query.device).unsqueeze(1)
    output = torch.zeros_like(query)
    running_max = torch.full((*query.shape[:-1], 1), float("-inf"), device=query.device)
    running_sum = torch.zeros_like(running_max)
    for start in range(0, length, block):
        stop = min(start + block, length)
        scores = query @ key[..., start:stop, :].transpose(-2, -1) / math.sqrt(head_size)
        columns = torch.arange(start, stop, device=query.device).unsqueeze(0)
        scores = scores.masked_fill(columns > rows, float("-inf"))
        block_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        block_max = torch.where(block_max.isinf(), torch.zeros_like(block_max), block_max)
        correction = (running_max - block_max).exp()
        weights = (scores - block_max).exp()
        running_sum = correction * running_sum + weights.sum(dim=-1, keepdim=True)
        output = correction * output + weights @ value[..., start:stop, :]
        running_max = block_max
    return output / running_sum
