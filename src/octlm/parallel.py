"""Context parallelism for the whole model: each rank runs OctLM on its shard of the sequence.

Every rank holds all the parameters and the same full ``(B, T)`` token batch, keeps only its
own positions, tells the rotary embedding where they sit (``positions``), and runs the model
as usual. Only attention needs other positions: with ``ModelConfig(attention="ring")`` it
passes keys and values around the ring (:mod:`octlm.attention.ring`); embeddings, norms, MLPs
and the head work token by token and need no communication. Memory for activations and
attention then falls by the world size ``W``; the parameters are replicated.

The model's attention calls ``ring_attention`` with the default process group and the default
layout (zigzag), so these helpers use the same two and take neither as an argument: a
different layout here than inside the model would put tokens at the wrong positions.

Loss and gradients: :func:`context_parallel_loss` divides this rank's summed token losses by
the token count of the *whole* batch, so the losses of all ranks add up to the single-process
mean. ``backward`` on every rank (together: ring attention's backward is a collective) gives
each rank its share of the parameter gradients; :func:`reduce_gradients` adds the shares, after
which every rank holds the single-process gradients and identical optimizer steps keep the
replicas equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from octlm.attention.ring import (
    DEFAULT_LAYOUT,
    gather_sequence,
    process_group,
    shard_positions,
    shard_sequence,
)
from octlm.model import OctLM


def _check_ring(model: OctLM) -> None:
    if model.config.attention != "ring":
        raise ValueError(
            "context parallelism needs ModelConfig(attention='ring'), got "
            f"attention={model.config.attention!r}"
        )


def shard_tokens(tokens: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's tokens ``(B, T/W)`` of the full ``(B, T)`` and their positions ``(T/W,)``."""
    _group, rank, world = process_group()
    local = shard_sequence(tokens, rank, world, DEFAULT_LAYOUT, dim=1)  # (B, T/W)
    positions = shard_positions(tokens.shape[1], rank, world, DEFAULT_LAYOUT)  # (T/W,)
    return local, positions.to(tokens.device)


def context_parallel_forward(model: OctLM, tokens: Tensor) -> Tensor:
    """Logits ``(B, T/W, V)`` at this rank's positions of the full ``tokens (B, T)``.

    A collective: every rank calls it with the same tokens. ``T`` must be a multiple of
    ``2 * W`` (the zigzag layout cuts the sequence into ``2W`` chunks).
    """
    _check_ring(model)
    local, positions = shard_tokens(tokens)  # (B, T/W), (T/W,)
    return model(local, positions=positions)  # (B, T/W, V)


def context_parallel_loss(model: OctLM, inputs: Tensor, targets: Tensor) -> Tensor:
    """This rank's part of the mean next-token cross-entropy of ``inputs``/``targets (B, T)``.

    Summed over ranks it equals ``F.cross_entropy(model(inputs), targets)`` in one process,
    with low-precision logits upcast to float32 as :func:`octlm.train.train` does.
    """
    if targets.shape != inputs.shape:
        raise ValueError(
            f"targets must have the shape of inputs {tuple(inputs.shape)}, "
            f"got {tuple(targets.shape)}"
        )
    logits = context_parallel_forward(model, inputs)  # (B, T/W, V)
    local_targets, _ = shard_tokens(targets)  # (B, T/W)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(logits.flatten(0, 1), local_targets.flatten(), reduction="sum")
    return total / targets.numel()


def gather_logits(local_logits: Tensor) -> Tensor:
    """The full ``(B, T, V)`` logits from every rank's ``(B, T/W, V)``; a collective."""
    return gather_sequence(local_logits, None, DEFAULT_LAYOUT, dim=1)


def reduce_gradients(model: OctLM) -> None:
    """Sum the parameter gradients over ranks in place (one all-reduce of a flat buffer)."""
    process_group()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])  # (sum of numels,)
    dist.all_reduce(flat)
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(reduced.view_as(grad))
