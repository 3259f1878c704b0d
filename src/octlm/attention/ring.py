"""Context-parallel ("ring") attention over a torch.distributed process group.

Each of the ``W`` ranks holds the query, key and value of its own positions of one long
sequence. Key/value shards travel once around the ring, rank ``r`` sending to ``r + 1`` and
receiving from ``r - 1``; while the next shard is in flight, each rank attends its queries to
the shard it holds with the tiled block functions, and folds the partial ``(out, lse)`` into
its running result with :func:`~octlm.attention.tiled.core.merge`, which is exact. After ``W``
steps every query has seen every key, and no rank ever held more than two key/value shards.

The sequence is cut among ranks by a layout (:mod:`octlm.context_parallel`: ``zigzag`` keeps
every rank equally busy under causal attention). Chunk pairs that causality (or the window)
hides entirely are skipped; the ring pass happens regardless, so no rank waits on a peer.

Backward (FlashAttention-2 style, as :mod:`octlm.attention.tiled`): each rank keeps its own
``dq``; the key/value shards go round again, each carrying a ``dk``/``dv`` accumulator in the
accumulation dtype that every rank adds its contribution to, and one last pass hands the
finished gradients to their owner. Each block uses the global ``lse`` and
``delta = rowsum(dO * O)``, both local to the query's owner.

Packed documents: each rank holds the document ids of its own positions, and they travel
round with the key/value shard they describe (a few integers per token beside ``2 * heads *
head_size`` numbers). A pair of pieces whose id ranges do not meet shares no document and is
skipped whole; inside a pair, the block walk skips and unmasks blocks as in ``tiled``. The score
modifiers act per tile in global positions (ALiBi's distance is the pieces' offset plus the
in-piece one); sinks join each row once, after the last step, by one more :func:`merge`.

Before the first exchange the ranks agree: one ``all_gather_object`` swaps each rank's dtype,
device type, shapes and options (causal, window, layout, scale, block, ...) and the error its
own checks raised, if any. Any difference, or any rank's error, raises one ``ValueError`` on
every rank, so none computes under other rules than its peers or waits on one that gave up.

Communication is point-to-point (``dist.batch_isend_irecv``), device-agnostic: ``gloo`` with CPU
tensors, ``nccl`` with CUDA tensors. ``gloo`` carries bfloat16 and float16 as they are (checked
with torch 2.13), so no reinterpretation is needed; gradients travel in float32 for those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from octlm.attention.inputs import Call, call_of, check, keyword_only
from octlm.attention.masks import key_range
from octlm.attention.tiled.core import (
    RowStats,
    Rules,
    accumulation_dtype,
    merge,
    slope_gradient,
)
from octlm.attention.tiled.engine import attend_backward, forward_rows
from octlm.attention.tiled.options import DEFAULT_BLOCK, parse_block
from octlm.context_parallel import (
    DEFAULT_LAYOUT,
    Piece,
    agree,
    check_layout,
    check_shard,
    shard_pieces,
    shard_sequence,
)

__all__ = ["ring_attention", "shard_sequence"]  # shard_sequence: the sharding the ring reads


def _check_call(call: Call, layout: str) -> Call:
    """This rank's own checks of a ring_attention call; the call, checked."""
    check_layout(layout)
    for name in ("mask", "key_lengths"):
        if getattr(call, name) is not None:
            raise ValueError(f"ring_attention takes no {name}; shard only causal/window rules")
    call = check(call, dropout=False)
    if call.q_len != call.k_len:
        raise ValueError(
            "each rank must hold query, key and value for the same positions, got q_len "
            f"{call.q_len} and k_len {call.k_len}"
        )
    check_shard(call.q_len, layout)
    return call


def _shape(x: object) -> tuple[int, ...] | str:
    """A tensor's shape, or what was passed instead of a tensor."""
    return tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__


class _Ring:
    """This rank's place on the ring: sends go to the next rank, receives come from the last."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, layout: str):
        self.group, self.rank, self.world, self.layout = group, rank, world, layout
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.previous = dist.get_global_rank(group, (rank - 1) % world)

    def pieces(self, owner: int, local_len: int) -> list[Piece]:
        return shard_pieces(owner, self.world, self.layout, local_len)

    def send_on(self, *tensors: Tensor) -> Callable[[], tuple[Tensor, ...]]:
        """Start passing contiguous ``tensors`` one step round; call the result to wait for them.

        A ring of one passes to itself, so it hands back the same tensors.
        """
        if self.world == 1:
            return lambda: tensors
        received = tuple(torch.empty_like(t) for t in tensors)
        operations = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors] + [
            dist.P2POp(dist.irecv, r, self.previous, self.group) for r in received
        ]
        works = dist.batch_isend_irecv(operations)

        def wait() -> tuple[Tensor, ...]:
            for work in works:
                work.wait()
            return received

        return wait


def _visible_pairs(
    queries: list[Piece],
    keys: list[Piece],
    options: dict,
    query_ids: Tensor | None,
    key_ids: Tensor | None,
) -> Iterator[tuple[Piece, Piece, int, tuple[Tensor, Tensor] | None]]:
    """``(query piece, key piece, past, documents)`` for every pair that the rules do not hide
    entirely. ``documents`` is ``(query ids (B, q.length), key ids (B, k.length))``, or None
    without document ids; pairs whose id ranges do not meet in any batch element share no
    document and are skipped (the block walk then skips inside the pairs it gets)."""
    for q in queries:
        for k in keys:
            past = q.start - k.start  # query row i sits at key position past + i of this piece
            rows = range(q.length)
            if not len(key_range(rows, k.length, past, options["causal"], options["window"])):
                continue
            documents = None
            if query_ids is not None:
                documents = query_ids[:, q.span], key_ids[:, k.span]  # (B, q), (B, k) lengths
                q_low, q_high = documents[0].amin(dim=1), documents[0].amax(dim=1)  # (B,)
                k_low, k_high = documents[1].amin(dim=1), documents[1].amax(dim=1)  # (B,)
                if not bool(((q_low <= k_high) & (k_low <= q_high)).any()):
                    continue
            yield q, k, past, documents


def _ring_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    ids: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    ring: _Ring,
    options: dict,
) -> tuple[Tensor, Tensor, list[tuple[bool, bool]]]:
    """Normalised ``out (B, H, L, D)`` and ``lse (B, H, L)`` over all keys, accumulation dtype,
    and each chunk pair's record (``RowStats.careful``, ``RowStats.whole``), in the order the
    backward meets the pairs.

    ``ids (B, L)``, this rank's document ids, travel round with the key/value shard they
    describe. A sink is no key: it joins each row once, after the ring, as one more logit
    with no value.
    """
    local_len = query.shape[2]
    queries = ring.pieces(ring.rank, local_len)
    dtype = accumulation_dtype(query.dtype)
    out = query.new_zeros(query.shape, dtype=dtype)  # (B, H, L, D)
    lse = query.new_full(query.shape[:-1], float("-inf"), dtype=dtype)  # (B, H, L)
    records = []
    shard = (key, value) if ids is None else (key, value, ids)
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world  # whose keys this rank holds now
        arriving = ring.send_on(*shard) if step + 1 < ring.world else None
        key, value, key_ids = shard if ids is not None else (*shard, None)
        keys = ring.pieces(owner, local_len)
        for q, k, past, documents in _visible_pairs(queries, keys, options, ids, key_ids):
            part_out, rows = forward_rows(
                query[:, :, q.span],
                key[:, :, k.span],
                value[:, :, k.span],
                Rules(past=past, documents=documents, alibi_slopes=alibi_slopes, **options),
            )  # (B, H, q.length, D), (B, H, q.length) each
            out[:, :, q.span], lse[:, :, q.span] = merge(
                out[:, :, q.span], lse[:, :, q.span], part_out, rows.lse()
            )
            records.append((rows.careful, rows.whole))
        if arriving is not None:
            shard = arriving()
    if sinks is not None:  # (1, H, 1): the sink's logit, with an output of zero
        sink = sinks.detach().to(dtype).view(1, -1, 1)
        out, lse = merge(out, lse, out.new_zeros(()), sink)
    return out, lse, records


def _ring_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    ids: Tensor | None,
    lse: Tensor,
    delta: Tensor,
    grad_out: Tensor,
    ring: _Ring,
    options: dict,
    records: list[tuple[bool, bool]],
    alibi_slopes: Tensor | None = None,
    moments: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq`` for this rank's queries and ``dk``/``dv`` for its own keys, accumulation dtype;
    each row's ALiBi moments over every key (:func:`~octlm.attention.tiled.core.slope_moments`)
    are added to ``moments`` when given. Each chunk pair takes the engine its forward took
    (``records``), with the rows' global statistics.

    Each step's key/value gradients are handed on with the shard they belong to; the pass of
    one step's gradients overlaps the next step's compute.
    """
    local_len = query.shape[2]
    queries = ring.pieces(ring.rank, local_len)
    dtype = lse.dtype
    grad_query = torch.zeros_like(query, dtype=dtype)  # (B, H, L, D)
    grads_arriving = None
    records = iter(records)
    shard = (key, value) if ids is None else (key, value, ids)
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        arriving = ring.send_on(*shard) if step + 1 < ring.world else None
        key, value, key_ids = shard if ids is not None else (*shard, None)
        grad_key = torch.zeros_like(key, dtype=dtype)  # (B, Hkv, L, D), for the owner's keys
        grad_value = torch.zeros_like(value, dtype=dtype)  # (B, Hkv, L, D)
        keys = ring.pieces(owner, local_len)
        for q, k, past, documents in _visible_pairs(queries, keys, options, ids, key_ids):
            rules = Rules(past=past, documents=documents, alibi_slopes=alibi_slopes, **options)
            chunk = query[:, :, q.span], key[:, :, k.span], value[:, :, k.span]
            rows = RowStats.of_lse(lse[:, :, q.span], rules, *next(records))
            dq, dk, dv = attend_backward(
                *chunk,
                grad_out[:, :, q.span],
                rows,
                delta[:, :, q.span],
                rules,
                moments=None if moments is None else moments[:, :, q.span],
            )
            grad_query[:, :, q.span] += dq
            grad_key[:, :, k.span] += dk
            grad_value[:, :, k.span] += dv
        if grads_arriving is not None:
            # What the ranks before this one added for the same owner's keys.
            earlier_key, earlier_value = grads_arriving()
            grad_key += earlier_key
            grad_value += earlier_value
        grads_arriving = ring.send_on(grad_key, grad_value)
        if arriving is not None:
            shard = arriving()
    grad_key, grad_value = grads_arriving()  # the last pass brings this rank's own, complete
    return grad_query, grad_key, grad_value


class _RingAttention(torch.autograd.Function):
    """Autograd through the ring; saves query, key, value, output and lse (and the document
    ids, slopes and sinks it was given).

    The slopes' and sinks' gradients are this rank's rows' share: like every parameter's
    gradient under context parallelism, the sum over ranks is the whole.
    """

    @staticmethod
    def forward(ctx, query, key, value, ids, alibi_slopes, sinks, ring, options):
        out, lse, records = _ring_forward(
            query, key, value, ids, alibi_slopes, sinks, ring, options
        )
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, ids, alibi_slopes, sinks, out, lse)
        ctx.ring, ctx.options, ctx.records = ring, options, records
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, ids, alibi_slopes, sinks, out, lse = ctx.saved_tensors
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)  # (B, H, L)
        moments = None  # (B, H, L, 4)
        if alibi_slopes is not None and ctx.needs_input_grad[4]:
            moments = lse.new_zeros(*lse.shape, 4, dtype=torch.float64)
        grad_query, grad_key, grad_value = _ring_backward(
            query,
            key,
            value,
            ids,
            lse,
            delta,
            grad_out,
            ctx.ring,
            ctx.options,
            ctx.records,
            alibi_slopes,
            moments,
        )
        grad_alibi = None
        if moments is not None:  # weights exp(score - lse): the sink's is its probability
            shift = lse.masked_fill(lse == float("-inf"), 0.0).double()  # (B, H, L)
            sink = None if sinks is None else (sinks.double().view(1, -1, 1) - shift).exp()
            grad_alibi = slope_gradient(moments, alibi_slopes, sink)
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            # A sink takes p = exp(sink - lse) of its row and gives no value: -sum p * delta.
            taken = (sinks.to(lse.dtype).view(1, -1, 1) - lse).exp()  # (B, H, L)
            grad_sinks = -(taken * delta).sum(dim=(0, 2)).to(sinks.dtype)
        grads = grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)
        return *grads, None, grad_alibi, grad_sinks, None, None


@keyword_only
def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    window: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_lengths: Tensor | None = None,
    document_ids: Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = DEFAULT_LAYOUT,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    A collective: every rank calls it with its own shard, in the same order.

    Args:
        query: ``(batch, heads, L, head_size)``, this rank's ``L`` positions of the sequence
            in ``layout`` (see :func:`~octlm.context_parallel.shard_sequence`); the whole
            sequence is ``W * L`` long.
        key, value: ``(batch, kv_heads, L, head_size)`` for the same positions; GQA as in
            :func:`~octlm.attention.tiled_attention`.
        group: the process group; the default group when None.
        causal: a token sees the tokens at and before its global position.
        window: if > 0, a token also sees only the ``window`` most recent tokens (itself
            included), counted in global positions.
        mask, key_lengths: not supported across ranks; must be None (they are in the shared
            signature so that the registry can call every implementation alike).
        scale: score scale, ``1 / sqrt(head_size)`` by default.
        dropout_p: must be 0; ring attention has no attention dropout.
        document_ids: int ``(batch, L)``, the document of each of this rank's positions
            (``shard_sequence(ids, rank, world, layout, dim=1)`` of the whole sequence's ids):
            a token sees only tokens of its own document. The ids travel round with the
            key/value shard they describe; shard pairs that share no document are skipped.
        softcap, alibi_slopes, sinks: the score modifiers of ``tiled_attention``, in global
            positions. The gradients of slopes and sinks that require grad are this rank's
            rows' share; summed over the ranks (as every parameter's gradient is under
            context parallelism) they are the whole.
        layout: ``"zigzag"`` (rank r holds chunks r and 2W - 1 - r of 2W; balanced under
            causal) or ``"plain"`` (rank r holds chunk r of W).
        block: tile sizes for the local block computation, as in ``tiled_attention``.

    Returns:
        ``(batch, heads, L, head_size)`` in the input dtype: this rank's rows of the output.
    """
    call = call_of(locals())
    try:  # checked here, not before: every rank must reach agree, even one whose call is bad
        call, block, problem = _check_call(call, layout), parse_block(block), None
    except (TypeError, ValueError) as error:
        problem = error
    query, key, value = call.query, call.key, call.value
    description = {
        "dtype": getattr(query, "dtype", None),
        "device": query.device.type if isinstance(query, Tensor) else None,
        "query shape": _shape(query),
        "key shape": _shape(key),
        "value shape": _shape(value),
        "causal": call.causal,
        "window": call.window,
        "layout": layout,
        "scale": call.scale,
        "block": block,
        "dropout_p": call.dropout_p,
        "mask": call.mask is not None,
        "key_lengths": call.key_lengths is not None,
        "document_ids": _shape(call.document_ids),
        "softcap": call.softcap,
        "alibi_slopes": _shape(call.alibi_slopes),
        "sinks": _shape(call.sinks),
    }
    group, rank, world = agree(group, "ring_attention", description, problem)
    options = dict(
        causal=call.causal,
        window=call.window,
        scale=call.scale,
        block=block,
        softcap=call.softcap,
    )
    ring = _Ring(group, rank, world, layout)
    # Point-to-point sends need contiguous tensors (the model's values are a transposed view).
    ids = None if call.document_ids is None else call.document_ids.contiguous()
    return _RingAttention.apply(
        query,
        key.contiguous(),
        value.contiguous(),
        ids,
        call.alibi_slopes,
        call.sinks,
        ring,
        options,
    )
