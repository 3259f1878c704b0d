"""Small calls computed whole: every score of a head in one tile, forward and backward.

When a call's scores fit in one tile (:func:`fits_whole`), the block walk has nothing to skip
that pays for its bookkeeping: its per-tile masks, edge biases and query blocks cost more than
the scores they save. Here each head's scores are one tile instead. The rules (causal, window,
padding, documents, a bool mask) become a bias of ``0`` and ``-inf``, built by each piece from
small parts, so no ``(B, Q, K)`` tensor is formed on one thread; each row's
shift is its exact maximum (the sink's logit included), so the online softmax degenerates to
one ``(shift, total)`` per row; and the backward forms the scores again with the very
operations of the forward, so its probabilities are the forward's bit for bit.

The heads are cut into pieces of a batch element and a few key/value heads, about ``PIECE_SCORES``
scores each, fixed by the shapes alone (so the forward and the backward cut alike): a piece's tile
stays in cache, and on CPU the pieces go to threads that run their ops on one core each
(threads.py). A query head group is a view, never a copy: the group's query rows ``(G*Q, D)`` meet
their key/value head in one matmul, so the tile ``(G*Q, K)`` is the group's ``(G, Q, K)`` scores as
it stands and ``probsᵀ @ grad`` sums the group's key gradients in the matmul. The numerics are the
engine's (docs/design.md, 'The numerics of the tiled core'): the same :class:`Units`, the score
modifiers in the same order and units, rows that see nothing give zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from octlm.attention.masks import allowed, as_4d, distance, padding_mask
from octlm.attention.tiled.core import (
    NEG_INF,
    RowStats,
    Rules,
    Units,
    accumulation_dtype,
    all_finite,
    slope_moments,
)
from octlm.attention.tiled.threads import parallel_map

# Scores per head, in tiles of the call's block, up to which a call is computed whole.
WHOLE_TILES = 1
# The most scores of one head over the batch, B * Q * K, a call computed whole may have; a
# larger batch of such calls takes the block walk.
WHOLE_BATCH_SCORES = 2**22
# Scores per piece: a piece's tile (1 MiB in float32) stays in a core's cache.
PIECE_SCORES = 2**18


def fits_whole(query: Tensor, key: Tensor, rules: Rules) -> bool:
    """Whether the call is computed whole: rows and keys to see, at most one tile's scores
    per head, a bounded batch of them, and no block mask (whose grid is the tiling)."""
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    if rules.block_mask is not None or 0 in query.shape or 0 in key.shape:
        return False
    per_head = q_len * k_len
    return (
        per_head <= WHOLE_TILES * rules.block[0] * rules.block[1]
        and batch * per_head <= WHOLE_BATCH_SCORES
    )


@dataclass
class _Call:
    """One call's operands in the accumulation dtype and its rules made dense, once."""

    queries: Tensor  # (B, Hkv, G*Q, D), scale * unit * query
    keys: Tensor  # (B, Hkv, K, D)
    values: Tensor  # (B, Hkv, K, D)
    visibility: _Visibility  # what each row may see, built per piece
    bias: Tensor | None  # (b, h, q, k) in units: the float mask
    mask: Tensor | None  # the float mask (b, h, q, k) as given, for the careful fills
    slopes: Tensor | None  # (B|1, H) in units, times -1: ALiBi's bias is slopes * distance
    sinks: Tensor | None  # (H,) in units
    far: Tensor | None  # (Q, K) distances, with ALiBi
    group: int
    units: Units
    careful: bool

    def pieces(self) -> list[tuple[int, slice]]:
        """``(batch element, key/value heads)`` of about ``PIECE_SCORES`` scores each."""
        batch, kv_heads, rows, _ = self.queries.shape
        per_head = rows * self.keys.shape[2]
        count = -(-kv_heads // max(1, PIECE_SCORES // per_head))  # pieces per element
        size = -(-kv_heads // count)
        starts = range(0, kv_heads, size)
        return [(b, slice(h, min(h + size, kv_heads))) for b in range(batch) for h in starts]

    def heads(self, kv: slice) -> slice:
        """The query heads of key/value heads ``kv``."""
        return slice(kv.start * self.group, kv.stop * self.group)

    def part(self, dense: Tensor | None, b: int, kv: slice) -> Tensor | None:
        """A ``(B|1, H|1, ...)`` tensor's part for one piece, ``(n*G|1, ...)``."""
        if dense is None:
            return None
        dense = dense[b if dense.shape[0] > 1 else 0]
        return dense[self.heads(kv)] if dense.shape[0] > 1 else dense

    def visible(self, b: int, kv: slice) -> Tensor | None:
        """Bool ``(n*G|1, Q, K)``: where the piece's rows may see a key; None if everywhere."""
        rules, visible = self.visibility, self.visibility.shared  # (Q, K)
        if rules.present is not None:
            visible = _both(visible, rules.present[b])  # (1, K)
        if rules.documents is not None:
            query_documents, key_documents = rules.documents
            visible = _both(visible, query_documents[b, :, None] == key_documents[b])  # (Q, K)
        if rules.allowed is not None:
            visible = _both(visible, self.part(rules.allowed, b, kv))  # (n*G|1, Q, K)
        return visible

    def bias_of(self, b: int, kv: slice, visible: Tensor | None) -> Tensor | None:
        """The piece's ``(n*G|1, Q, K)`` term in units: the float mask, ``-inf`` where hidden.
        Adding ``0`` leaves a score as it is and adding ``-inf`` hides it, at a fraction of a
        masked fill's cost; scores that are not finite are hidden by fills (``careful``)."""
        bias = self.part(self.bias, b, kv)
        if visible is None:
            return bias
        kept = self.queries.new_zeros(()) if bias is None else bias
        return torch.where(visible, kept, NEG_INF)


@dataclass
class _Visibility:
    """The rules as the parts a piece's visibility is built from, none of them ``(B, Q, K)``:
    one dense bias for the whole call costs more to build than the scores it hides."""

    shared: Tensor | None  # bool (Q, K): what causal and the window let every row see
    present: Tensor | None  # bool (B, 1, K): the keys within each element's padding bounds
    documents: tuple[Tensor, Tensor] | None  # query ids (B, Q), key ids (B, K)
    allowed: Tensor | None  # a bool mask as (b, h, q, k)


def _both(visible: Tensor | None, part: Tensor) -> Tensor:
    return part if visible is None else visible & part


def _call(query, key, value, rules: Rules, units: Units, careful: bool, dtype=None) -> _Call:
    batch, heads, q_len, head_size = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    dtype = dtype or accumulation_dtype(query.dtype)
    scale = rules.scale * units.unit
    queries = query.new_empty(query.shape, dtype=dtype)  # (B, H, Q, D), a group is a view
    if scale == 1.0:
        queries.copy_(query)
    else:
        torch.mul(query.to(dtype), scale, out=queries)
    mask = rules.mask if rules.mask is not None and rules.mask.is_floating_point() else None
    bias = None
    if mask is not None:
        mask = as_4d(mask)  # (b, h, q, k)
        bias = mask.to(dtype) if units.unit == 1.0 else mask.to(dtype) * units.unit
    slopes = far = None
    if rules.alibi_slopes is not None:
        slopes = (rules.alibi_slopes.to(dtype) * -units.unit).view(-1, heads)  # (B|1, H)
        far = distance(range(q_len), range(k_len), rules.past, dtype, query.device)  # (Q, K)
    sinks = None if rules.sinks is None else rules.sinks.to(dtype) * units.unit  # (H,)
    return _Call(
        queries.view(batch, kv_heads, -1, head_size),
        key.to(dtype),  # any strides: a KV cache's view of its buffer is not copied
        value.to(dtype),
        _visibility(rules, q_len, k_len, query.device), bias, mask, slopes, sinks, far,
        heads // kv_heads, units, careful,
    )  # fmt: skip


def _visibility(rules: Rules, q_len: int, k_len: int, device) -> _Visibility:
    shared = present = allowed_by_mask = None
    if rules.causal or rules.window:
        shared = allowed(range(q_len), range(k_len), rules.past, rules.causal, rules.window, device)
    if rules.key_lengths is not None or rules.key_starts is not None:
        present = padding_mask(rules.key_lengths, range(k_len), rules.key_starts)[:, 0]
    if rules.mask is not None and rules.mask.dtype == torch.bool:
        allowed_by_mask = as_4d(rules.mask)  # (b, h, q, k)
    return _Visibility(shared, present, rules.documents, allowed_by_mask)


def _scores(call: _Call, b: int, kv: slice, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """One piece's scores ``(n*G, Q, K)`` in units, hidden places ``-inf``, and the softcap's
    ``tanh`` (None without one). The forward and the backward both form them here, so they
    are the same to the last bit."""
    queries, keys = call.queries[b, kv], call.keys[b, kv]  # (n, G*Q, D), (n, K, D)
    scores = torch.bmm(queries, keys.transpose(1, 2))  # (n, G*Q, K)
    scores = scores.view(-1, scores.shape[1] // call.group, scores.shape[2])  # (n*G, Q, K)
    tanh = None
    if softcap is not None:  # natural units (Units.choose): the cap as given
        cap = softcap * call.units.unit
        tanh = scores.div_(cap).tanh_().clone()
        scores.mul_(cap)
    if call.slopes is not None:  # -slope * distance, added in units
        slopes = call.part(call.slopes, b, kv)  # (n*G,)
        scores.addcmul_(slopes[:, None, None], call.far)
    visible = call.visible(b, kv)  # (n*G|1, Q, K)
    bias = call.bias_of(b, kv, visible)  # (n*G|1, Q, K)
    if bias is not None:
        scores.add_(bias)  # the float mask, then the hidden places
    if call.careful:  # NaN + -inf is NaN: hide what the mask and the rules hide
        if call.mask is not None:
            scores.masked_fill_(call.part(call.mask, b, kv) == NEG_INF, NEG_INF)
        if visible is not None:
            scores.masked_fill_(~visible, NEG_INF)
    return scores, tanh


def whole_forward(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules
) -> tuple[Tensor, RowStats]:
    """The call's output ``(B, H, Q, D)`` in the accumulation dtype and its row statistics.

    Each row's shift is the largest of its visible scores and its sink's logit (0 where it
    sees nothing and has no sink), so every weight is at most 1 and the sum cannot overflow.
    As in the block steps, inputs are assumed finite and the output checked afterwards: only
    where a NaN shows is the call run again with the care that keeps a hidden NaN or infinity
    out of the rows that cannot see it.
    """
    out, rows, broken = _forward(query, key, value, rules, careful=False)
    if broken:
        out, rows, _ = _forward(query, key, value, rules, careful=True)
    return out, rows


def _forward(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules, *, careful: bool
) -> tuple[Tensor, RowStats, bool]:
    """Output, row statistics, and whether a NaN shows in the output (each piece looks at
    its own part while it is in cache)."""
    units = Units.choose(rules)
    call = _call(query, key, value, rules, units, careful)
    values = call.values  # (B, Hkv, K, D)
    if careful:
        values = values.masked_fill(~values.isfinite(), 0.0)
    out = call.queries.new_empty(query.shape)  # (B, H, Q, D)
    shift = call.queries.new_empty(query.shape[:-1])  # (B, H, Q)
    total = torch.empty_like(shift)  # (B, H, Q)

    def attend(piece: tuple[int, slice]) -> Tensor:
        b, kv = piece
        heads = call.heads(kv)
        scores, _ = _scores(call, b, kv, rules.softcap)  # (n*G, Q, K)
        visible = scores != NEG_INF if careful else None  # (n*G, Q, K)
        top = scores.amax(dim=-1, keepdim=True)  # (n*G, Q, 1)
        sinks = None if call.sinks is None else call.sinks[heads, None, None]  # (n*G, 1, 1)
        if sinks is not None:
            top = torch.maximum(top, sinks)
        top.masked_fill_(top == NEG_INF, 0.0)  # rows that see nothing (and a -inf sink)
        weights = call.units.exp_(scores.sub_(top))  # (n*G, Q, K), in place of the scores
        summed = weights.sum(dim=-1, keepdim=True)  # (n*G, Q, 1)
        if sinks is not None:  # one more term that carries no value
            summed += call.units.exp_(sinks - top)
        size = (kv.stop - kv.start, -1, weights.shape[2])
        part = out.view(call.queries.shape)[b, kv]  # (n, G*Q, D), written in place
        torch.bmm(weights.view(size), values[b, kv], out=part)
        part = part.view(-1, weights.shape[1], part.shape[2])  # (n*G, Q, D)
        # A row that saw a key sums to at least 1 (its maximum's own weight); one that saw
        # none has part = 0, and 0 / tiny = 0.
        part.div_(summed.clamp_min(torch.finfo(part.dtype).tiny))
        if careful:
            _poisoned(part, visible, call.values[b, kv])  # in place
        shift[b, heads], total[b, heads] = top[..., 0], summed[..., 0]
        return part.isnan().any()

    broken = parallel_map(attend, call.pieces(), query.device)
    return out, RowStats(shift, total, units, careful, whole=True), bool(torch.stack(broken).any())


def _poisoned(out: Tensor, visible: Tensor, values: Tensor) -> Tensor:
    """A piece's ``out (n*G, Q, D)`` with what each row sees of the non-finite ``values (n, K,
    D)`` put back, per dimension: NaN where it sees a NaN or infinities of both signs, else the
    infinity it sees (as the definition gives); a row already NaN stays NaN."""
    heads, q_len, head_size = out.shape
    kinds = (values.isnan(), values == float("inf"), values == float("-inf"))
    broken = torch.cat(kinds, dim=-1).to(out.dtype)  # (n, K, 3 * D)
    seen = visible.to(out.dtype).view(values.shape[0], -1, values.shape[1])  # (n, G*Q, K)
    poison = torch.bmm(seen, broken).view(heads, q_len, 3 * head_size) > 0
    nan, high, low = poison.split(head_size, dim=-1)  # (n*G, Q, D) each
    nan = nan | (high & low) | out.isnan()
    out.masked_fill_(high, float("inf")).masked_fill_(low, float("-inf"))
    return out.masked_fill_(nan, float("nan"))


def whole_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor,
    rows: RowStats,
    delta: Tensor,
    rules: Rules,
    *,
    grad_mask: Tensor | None = None,
    residue: Tensor | None = None,
    moments: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of a call :func:`whole_forward` computed, as
    :func:`~octlm.attention.tiled.engine.attend_backward` returns them (and fills its
    ``grad_mask``, ``residue`` and ``moments``, laid out as there).

    The probabilities are formed again as the forward formed them, ``exp(score - shift)``,
    and ``1 / total`` rides on ``grad_out`` and ``delta``, so no pass over the tile divides.
    The given ``delta`` (``rowsum(grad_out * out)``) serves where ``residue`` is asked for
    (learned sinks, whose gradient corrects for its rounding) and where the rows see keys beyond
    this tile (``rows.complete`` false: a ring's chunk); otherwise each row's delta is summed
    from its own tile, ``sum(p * dp)``, as naive's backward sums it.
    """
    call = _call(query, key, value, rules, rows.units, rows.careful)
    dtype = call.queries.dtype
    group = call.group
    inverse = torch.where(rows.total > 0, 1.0 / rows.total, 0.0).to(dtype)  # (B, H, Q)
    grad_out = grad_out.to(dtype)  # (B, H, Q, D)
    delta = delta.to(dtype) * inverse  # (B, H, Q)
    shift = rows.shift.to(dtype)  # (B, H, Q)
    keys, values = call.keys, call.values
    if not all_finite(keys, values):
        # 0 x NaN is NaN: a key or value no row sees must not reach a gradient through a zero
        # probability. One that a row sees still does, through that row's delta.
        keys = keys.masked_fill(~keys.isfinite(), 0.0)
        values = values.masked_fill(~values.isfinite(), 0.0)
    grad_query = torch.empty_like(call.queries)  # (B, Hkv, G*Q, D)
    grad_key, grad_value = (call.keys.new_empty(call.keys.shape) for _ in range(2))
    exact = None  # the call in float64, for the slopes' moments
    if moments is not None:
        exact = _call(query, key, value, rules, rows.units, rows.careful, torch.float64)
        exact.values = exact.values.masked_fill(~exact.values.isfinite(), 0.0)

    def attend(piece: tuple[int, slice]) -> None:
        b, kv = piece
        heads, count = call.heads(kv), kv.stop - kv.start
        scores, tanh = _scores(call, b, kv, rules.softcap)  # (n*G, Q, K)
        q_len, k_len = scores.shape[1:]
        grad_rows = call.queries.new_empty(call.queries[b, kv].shape)  # (n, G*Q, D)
        torch.mul(
            grad_out[b, heads],
            inverse[b, heads, :, None],
            out=grad_rows.view(-1, q_len, grad_rows.shape[2]),
        )
        probs = call.units.exp_(scores.sub_(shift[b, heads, :, None]))  # times total
        flat = probs.view(count, -1, k_len)  # (n, G*Q, K)
        torch.bmm(flat.transpose(1, 2), grad_rows, out=grad_value[b, kv])  # (n, K, D)
        grad_scores = torch.bmm(grad_rows, values[b, kv].transpose(1, 2))  # (n, G*Q, K)
        grad_scores = grad_scores.view(probs.shape)  # (n*G, Q, K)
        if residue is None and rows.complete:  # each row's delta from its own tile, as naive
            row_delta = (grad_scores * probs).sum(dim=-1, keepdim=True)  # (n*G, Q, 1)
            row_delta.mul_(inverse[b, heads, :, None])
        else:  # the rounded delta, whose residue the slopes and sinks correct for
            row_delta = delta[b, heads, :, None]
        grad_scores.sub_(row_delta).mul_(probs)  # d loss / d scores
        by_group = (count, group, q_len)
        if grad_mask is not None:  # folded (B, Hkv, Q, G, K)
            grad_mask[b, kv] = grad_scores.view(*by_group, k_len).transpose(1, 2)
        if residue is not None:  # folded (B, Hkv, Q, G)
            summed = grad_scores.sum(dim=-1, dtype=torch.float64)  # (n*G, Q)
            residue[b, kv] += summed.view(by_group).transpose(1, 2)
        if moments is not None:
            moments[b, heads] += _slope_moments(exact, b, kv, grad_out, rows.shift, rules.softcap)
        if tanh is not None:  # through the cap: d tanh = 1 - tanh²
            grad_scores.mul_(tanh.square_().neg_().add_(1.0))
        flat = grad_scores.view(count, -1, k_len)  # (n, G*Q, K)
        torch.bmm(flat, keys[b, kv], out=grad_query[b, kv]).mul_(rules.scale)  # (n, G*Q, D)
        # Taken against scale * unit * q; dividing by the unit brings it to scale * q.
        torch.bmm(flat.transpose(1, 2), call.queries[b, kv], out=grad_key[b, kv])  # (n, K, D)

    parallel_map(attend, call.pieces(), query.device)
    return grad_query.view(query.shape), grad_key.div_(call.units.unit), grad_value


def _slope_moments(exact: _Call, b: int, kv: slice, grad_out, shift, softcap) -> Tensor:
    """One piece's :func:`~octlm.attention.tiled.core.slope_moments` ``(n*G, Q, 4)``, its scores
    and ``dp`` formed again in float64 (why: docs/design.md, 'The numerics of the tiled core')."""
    heads = exact.heads(kv)
    scores, _ = _scores(exact, b, kv, softcap)  # (n*G, Q, K), natural units
    weights = scores.sub_(shift[b, heads, :, None].double()).exp_()  # (n*G, Q, K)
    rows = grad_out[b, heads].double().reshape(kv.stop - kv.start, -1, grad_out.shape[-1])
    grad_probs = torch.bmm(rows, exact.values[b, kv].transpose(1, 2))  # (n, G*Q, K)
    return slope_moments(weights, grad_probs.view(weights.shape), exact.far)
