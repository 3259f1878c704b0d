"""Context parallelism's plumbing: how a sequence is cut among ranks, and the model over it.

Ring attention (:mod:`octlm.attention.ring`) is the algorithm; this module is everything
around it. Layouts (how the sequence is cut among ranks), pictured for ``W = 2``::

    plain   | rank 0 | rank 1 |            rank r holds chunk r of W
    zigzag  | 0 | 1 | 1 | 0 |             rank r holds chunks r and 2W - 1 - r of 2W

Under causal attention, ``plain`` leaves rank 0 idle for most steps (its queries see only its
own keys) while the last rank sees everything; ``zigzag`` pairs an early chunk with a late one,
so every rank does the same work at every step. :func:`shard_sequence`,
:func:`shard_positions` and :func:`gather_sequence` cut and join sequences by a layout;
:func:`process_group` and :func:`agree` are the process group and the ranks' agreement on a
collective call.

The whole model: every rank holds all the parameters and the same full ``(B, T)`` token batch,
keeps only its own positions, tells the rotary embedding where they sit (``positions``), and
runs the model as usual. Only attention needs other positions: with
``ModelConfig(attention="ring")`` it passes keys and values around the ring; embeddings,
norms, MLPs and the head work token by token and need no communication. Memory for
activations and attention then falls by the world size ``W``; the parameters are replicated.
The model's attention calls ``ring_attention`` with the default process group and the default
layout (zigzag), so the model's helpers here use the same two and take neither as an argument:
a different layout here than inside the model would put tokens at the wrong positions.

Loss and gradients: :func:`context_parallel_loss` divides this rank's summed token losses by
the token count of the *whole* batch, so the losses of all ranks add up to the single-process
mean. ``backward`` on every rank (together: ring attention's backward is a collective) gives
each rank its share of the parameter gradients; :func:`reduce_gradients` adds the shares, after
which every rank holds the single-process gradients and identical optimizer steps keep the
replicas equal. (training/distributed.py runs ``octlm train`` this way under torchrun.)

This module imports no other octlm module, so the attention package can build on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

LAYOUTS = ("zigzag", "plain")
DEFAULT_LAYOUT = "zigzag"


@dataclass(frozen=True)
class Piece:
    """A run of consecutive positions inside one rank's shard."""

    local: int  # where it starts in the shard
    start: int  # the global position of its first token
    length: int

    @property
    def span(self) -> slice:
        """Its place in the shard, for indexing the sequence dimension."""
        return slice(self.local, self.local + self.length)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunks(world: int, layout: str) -> int:
    """How many equal chunks the layout cuts the sequence into."""
    return 2 * world if layout == "zigzag" else world


def _check_split(length: int, world: int, layout: str) -> None:
    chunks = _chunks(world, layout)
    if length % chunks:
        raise ValueError(
            f"sequence length {length} cannot be split by layout {layout!r} over {world} ranks: "
            f"it must be a multiple of {chunks}"
        )


def check_shard(local_len: int, layout: str) -> None:
    if layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"a zigzag shard holds two equal chunks, so its length must be even, got {local_len}"
        )


def shard_pieces(rank: int, world: int, layout: str, local_len: int) -> list[Piece]:
    """The pieces of rank ``rank``'s shard of ``local_len`` positions, in shard order."""
    if layout == "plain":
        return [Piece(0, rank * local_len, local_len)]
    chunk = local_len // 2
    return [Piece(0, rank * chunk, chunk), Piece(chunk, (2 * world - 1 - rank) * chunk, chunk)]


def shard_positions(length: int, rank: int, world: int, layout: str = DEFAULT_LAYOUT) -> Tensor:
    """The global positions rank ``rank`` holds of a ``length``-token sequence, int64 (length/W,).

    Pass them to the model as ``positions`` so rotary embeddings see where each token really is.
    """
    check_layout(layout)
    _check_split(length, world, layout)
    held = shard_pieces(rank, world, layout, length // world)
    return torch.cat([torch.arange(p.start, p.start + p.length) for p in held])


def shard_sequence(
    x: Tensor, rank: int, world: int, layout: str = DEFAULT_LAYOUT, dim: int = 2
) -> Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (2 for (B, H, T, D))."""
    check_layout(layout)
    length = x.shape[dim]
    _check_split(length, world, layout)
    held = shard_pieces(rank, world, layout, length // world)
    return torch.cat([x.narrow(dim, p.start, p.length) for p in held], dim=dim)


def gather_sequence(
    local: Tensor,
    group: dist.ProcessGroup | None = None,
    layout: str = DEFAULT_LAYOUT,
    dim: int = 2,
) -> Tensor:
    """The full sequence from every rank's shard along ``dim``; the inverse of shard_sequence.

    A collective: every rank of ``group`` calls it and gets the whole tensor. Not
    differentiable (``dist.all_gather`` is not).
    """
    try:
        check_layout(layout)
        check_shard(local.shape[dim], layout)
        problem = None
    except ValueError as error:
        problem = error
    description = {"shape": tuple(local.shape), "dtype": local.dtype, "layout": layout, "dim": dim}
    group, _rank, world = agree(group, "gather_sequence", description, problem)
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local, group=group)
    local_len = local.shape[dim]
    full = local.new_empty(*local.shape[:dim], world * local_len, *local.shape[dim + 1 :])
    for owner, shard in enumerate(shards):
        for piece in shard_pieces(owner, world, layout, local_len):
            full.narrow(dim, piece.start, piece.length).copy_(
                shard.narrow(dim, piece.local, piece.length)
            )
    return full


def process_group(
    group: dist.ProcessGroup | None = None,
) -> tuple[dist.ProcessGroup, int, int]:
    """``(group, rank, world size)`` of ``group``, the default group when None.

    Raises RuntimeError when no process group has been initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring attention and context parallelism need an initialised torch.distributed "
            "process group: call torch.distributed.init_process_group first (under torchrun, "
            "init_process_group('gloo') on CPU or 'nccl' on CUDA)"
        )
    group = dist.group.WORLD if group is None else group
    return group, dist.get_rank(group), dist.get_world_size(group)


def agree(
    group: dist.ProcessGroup | None, call: str, description: dict, problem: Exception | None
) -> tuple[dist.ProcessGroup, int, int]:
    """``process_group(group)`` once every rank has made the same, valid ``call``.

    A collective, before the first exchange: the ranks swap ``description`` (what each was
    given) and the error, if any, that its own checks raised. Unless every rank's checks passed
    and every description matches, every rank raises the same ``ValueError`` naming what
    differs and where, so no rank returns garbage computed under other rules than its peers'
    and none waits on a send that never comes.
    """
    if problem is not None and not (dist.is_available() and dist.is_initialized()):
        raise problem  # no peers to tell
    group, rank, world = process_group(group)
    error = None if problem is None else f"{type(problem).__name__}: {problem}"
    every: list = [None] * world
    dist.all_gather_object(every, {"call": description, "error": error}, group=group)
    if any(other["error"] for other in every):
        raise ValueError(
            f"{call} refused on every rank because a rank's own checks failed: "
            + _by_rank([other["error"] or "passed its own checks" for other in every])
        ) from problem
    differing = [
        f"{name} ({_by_rank([other['call'][name] for other in every])})"
        for name in description
        if any(other["call"][name] != every[0]["call"][name] for other in every)
    ]
    if differing:
        raise ValueError(
            f"every rank must make the same {call} call, but they differ in " + ", ".join(differing)
        )
    return group, rank, world


def _by_rank(values: list) -> str:
    """``"rank 0: a; ranks 1, 2: b"``: each distinct value once, with the ranks that hold it."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(str(value), []).append(rank)
    return "; ".join(
        f"rank{'s' * (len(held) > 1)} {', '.join(map(str, held))}: {value}"
        for value, held in ranks.items()
    )


def _check_ring(model: nn.Module) -> None:
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


def context_parallel_forward(model: nn.Module, tokens: Tensor) -> Tensor:
    """Logits ``(B, T/W, V)`` at this rank's positions of the full ``tokens (B, T)``.

    A collective: every rank calls it with the same tokens. ``T`` must be a multiple of
    ``2 * W`` (the zigzag layout cuts the sequence into ``2W`` chunks).
    """
    _check_ring(model)
    local, positions = shard_tokens(tokens)  # (B, T/W), (T/W,)
    return model(local, positions=positions)  # (B, T/W, V)


def context_parallel_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """This rank's part of the mean next-token cross-entropy of ``inputs``/``targets (B, T)``.

    Summed over ranks it equals ``F.cross_entropy(model(inputs), targets)`` in one process,
    with low-precision logits upcast to float32 as the lab's loss curve does
    (:func:`octlm.lab.verify.loss_curve.loss_curve`).
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


def reduce_gradients(model: nn.Module) -> None:
    """Sum the parameter gradients over ranks in place (one all-reduce of a flat buffer)."""
    process_group()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])  # (sum of numels,)
    dist.all_reduce(flat)
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(reduced.view_as(grad))
