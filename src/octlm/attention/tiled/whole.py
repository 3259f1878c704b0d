"""Small calls computed whole: every score of the call in one tile, forward and backward.

When a call's scores fit in one tile (:func:`fits_whole`), the block walk has nothing to
skip that pays for its bookkeeping: its per-tile masks, edge biases and thread split cost more
than the scores they save. Here the call is one batched tile instead. The rules (causal,
window, padding, documents, a bool mask) become one bool mask of hidden places, built once;
each row's shift is its exact maximum (the sink's logit included), so the online softmax
degenerates to one ``(shift, total)`` per row; and the backward forms the scores again with the
very operations of the forward, so its probabilities are the forward's bit for bit.

Layout: a query head group is a view, never a copy. Query heads ``(B, H, Q, D)`` read as
``(B*Hkv, G*Q, D)`` against keys ``(B*Hkv, K, D)``, so the score tile ``(B*Hkv, G*Q, K)`` is
``(B, H, Q, K)`` as it stands, and ``probsᵀ @ grad`` sums each group's key gradients in the
matmul. The numerics are the engine's (docs/design.md §7): the same :class:`Units`, the score
modifiers in the same order and units, hidden places at ``-inf`` by masked fills (so a NaN a
row cannot see stays out of it), rows that see nothing give zeros.
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
)

# Scores per head, in tiles of the call's block, up to which a call is computed whole.
WHOLE_TILES = 1
# The most scores (over batch and heads) one whole tile may hold; above, the block walk's
# O(T) memory wins.
WHOLE_SCORES = 2**24


def fits_whole(query: Tensor, key: Tensor, rules: Rules) -> bool:
    """Whether the call is computed whole: one query row or more against at least one key,
    one tile' scores per head, a bounded tile over all heads, and no block mask (whose
    own grid is the tiling)."""
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if rules.block_mask is not None or 0 in query.shape or 0 in key.shape:
        return False
    per_head = q_len * k_len
    return (
        per_head <= WHOLE_TILES * rules.block[0] * rules.block[1]
        and batch * heads * per_head <= WHOLE_SCORES
    )


@dataclass
class _Operands:
    """One call's operands in the accumulation dtype, laid out for the whole tile."""

    queries: Tensor  # (B*Hkv, G*Q, D), scale * unit * query
    keys: Tensor  # (B*Hkv, K, D)
    values: Tensor  # (B*Hkv, K, D)
    hidden: Tensor | None  # bool (B|1, H|1, Q, K): places no row may see
    bias: Tensor | None  # (B|1, H|1, Q, K) in units: the float mask, -inf where hidden
    shape: tuple[int, int, int, int]  # (B, H, Q, K)


def _operands(query: Tensor, key: Tensor, value: Tensor, rules: Rules, units: Units) -> _Operands:
    batch, heads, q_len, head_size = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    dtype = accumulation_dtype(query.dtype)
    scale = rules.scale * units.unit
    queries = query.to(dtype)
    queries = (queries if scale == 1.0 else queries * scale).contiguous()  # (B, H, Q, D)
    keys = key.to(dtype).contiguous()  # (B, Hkv, K, D)
    values = value.to(dtype).contiguous()  # (B, Hkv, K, D)
    hidden = _hidden(rules, q_len, k_len, query.device)  # (B|1, H|1, Q, K)
    bias = None
    mask = rules.mask
    if mask is not None and mask.is_floating_point():
        bias = as_4d(mask).to(dtype)  # (b, h, q, k)
        bias = bias if units.unit == 1.0 else bias * units.unit
    if hidden is not None:
        # Adding 0 leaves a score as it is and adding -inf hides it, at a fraction of a
        # masked fill's cost; a score that is not finite is hidden by fills (``careful``).
        bias = torch.zeros((), dtype=dtype, device=query.device) if bias is None else bias
        bias = bias.masked_fill(hidden, NEG_INF)
    return _Operands(
        queries.view(batch * kv_heads, -1, head_size),
        keys.view(batch * kv_heads, k_len, head_size),
        values.view(batch * kv_heads, k_len, head_size),
        hidden,
        bias,
        (batch, heads, q_len, k_len),
    )


def _hidden(rules: Rules, q_len: int, k_len: int, device) -> Tensor | None:
    """Bool ``(B|1, H|1, Q, K)``, True where the rules hide a key from a row; None if none."""
    visible = None
    if rules.causal or rules.window:
        visible = allowed(
            range(q_len), range(k_len), rules.past, rules.causal, rules.window, device
        )
    if rules.key_lengths is not None or rules.key_starts is not None:
        present = padding_mask(rules.key_lengths, range(k_len), rules.key_starts)  # (B, 1, 1, K)
        visible = present if visible is None else visible & present
    if rules.documents is not None:
        query_documents, key_documents = rules.documents
        same = query_documents[:, None, :, None] == key_documents[:, None, None, :]  # (B,1,Q,K)
        visible = same if visible is None else visible & same
    if rules.mask is not None and rules.mask.dtype == torch.bool:
        mask = as_4d(rules.mask)  # (b, h, q, k)
        visible = mask if visible is None else visible & mask
    return None if visible is None else ~visible


def _scores(
    ops: _Operands, rules: Rules, units: Units, careful: bool
) -> tuple[Tensor, Tensor | None]:
    """The call's scores ``(B, H, Q, K)`` in units, hidden places ``-inf``, and the softcap's
    ``tanh`` (None without one). The forward and the backward both form them here, so they
    are the same to the last bit."""
    batch, heads, q_len, k_len = ops.shape
    scores = torch.bmm(ops.queries, ops.keys.transpose(1, 2))  # (B*Hkv, G*Q, K)
    scores = scores.view(batch, heads, q_len, k_len)
    tanh = None
    if rules.softcap is not None:  # natural units (Units.choose): the cap as given
        cap = rules.softcap * units.unit
        tanh = scores.div_(cap).tanh_().clone()
        scores.mul_(cap)
    if rules.alibi_slopes is not None:  # -slope * distance, added in units
        slopes = rules.alibi_slopes.to(scores.dtype) * -units.unit  # (H,) or (B, H)
        slopes = slopes.view(-1, heads, 1, 1)  # (B|1, H, 1, 1)
        far = distance(range(q_len), range(k_len), rules.past, scores.dtype, scores.device)
        scores.addcmul_(slopes, far)  # far: (Q, K)
    if ops.bias is not None:
        scores.add_(ops.bias)  # the float mask, then the hidden places
    if careful:  # NaN + -inf is NaN: hide what the mask and the rules hide
        if rules.mask is not None and rules.mask.is_floating_point():
            scores.masked_fill_(as_4d(rules.mask) == NEG_INF, NEG_INF)
        if ops.hidden is not None:
            scores.masked_fill_(ops.hidden, NEG_INF)
    return scores, tanh


def _sink_logits(rules: Rules, units: Units, heads: int, dtype) -> Tensor | None:
    """The sinks in units as ``(1, H, 1, 1)``, or None."""
    if rules.sinks is None:
        return None
    return (rules.sinks.to(dtype) * units.unit).view(1, heads, 1, 1)


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
    out, rows = _forward(query, key, value, rules, careful=False)
    if bool(out.isnan().any()):
        out, rows = _forward(query, key, value, rules, careful=True)
    return out, rows


def _forward(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules, *, careful: bool
) -> tuple[Tensor, RowStats]:
    units = Units.choose(rules)
    ops = _operands(query, key, value, rules, units)
    batch, heads, q_len, k_len = ops.shape
    head_size = query.shape[-1]
    scores, _ = _scores(ops, rules, units, careful)  # (B, H, Q, K)
    visible = scores != NEG_INF if careful else None  # (B, H, Q, K)
    shift = scores.amax(dim=-1, keepdim=True)  # (B, H, Q, 1)
    sinks = _sink_logits(rules, units, heads, scores.dtype)  # (1, H, 1, 1)
    if sinks is not None:
        shift = torch.maximum(shift, sinks)
    shift.masked_fill_(shift == NEG_INF, 0.0)  # rows that see nothing (and a -inf sink)
    weights = units.exp_(scores.sub_(shift))  # (B, H, Q, K), in place of the scores
    total = weights.sum(dim=-1, keepdim=True)  # (B, H, Q, 1)
    if sinks is not None:  # one more term that carries no value
        total += units.exp_(sinks - shift)
    values = ops.values
    if careful:
        values = values.masked_fill(~values.isfinite(), 0.0)
    out = torch.bmm(weights.view(batch * key.shape[1], -1, k_len), values)  # (B*Hkv, G*Q, D)
    out = out.view(batch, heads, q_len, head_size)
    # A row that saw a key sums to at least 1 (its maximum's own weight); one that saw none
    # has out = 0, and 0 / tiny = 0.
    out.div_(total.clamp_min(torch.finfo(out.dtype).tiny))
    if careful:
        out = _poisoned(out, visible, ops.values, key.shape[1])
    rows = RowStats(shift.squeeze(-1), total.squeeze(-1), units, careful, whole=True)
    return out, rows


def _poisoned(out: Tensor, visible: Tensor, values: Tensor, kv_heads: int) -> Tensor:
    """``out`` with what each row sees of the non-finite values put back, per dimension: NaN
    where it sees a NaN or infinities of both signs, else the infinity it sees (as the
    definition gives); a row already NaN stays NaN."""
    batch, heads, q_len, k_len = visible.shape
    head_size = values.shape[-1]
    kinds = (values.isnan(), values == float("inf"), values == float("-inf"))
    broken = torch.cat(kinds, dim=-1).to(out.dtype)  # (B*Hkv, K, 3 * D)
    seen = visible.to(out.dtype).view(batch * kv_heads, -1, k_len)  # (B*Hkv, G*Q, K)
    poison = torch.bmm(seen, broken).view(batch, heads, q_len, 3 * head_size) > 0
    nan, high, low = poison.split(head_size, dim=-1)  # (B, H, Q, D) each
    nan = nan | (high & low) | out.isnan()
    return (
        out.masked_fill_(high, float("inf"))
        .masked_fill_(low, float("-inf"))
        .masked_fill_(nan, float("nan"))
    )


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
    grad_alibi: Tensor | None = None,
    residue: Tensor | None = None,
    spread: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of a call :func:`whole_forward` computed, as
    :func:`~octlm.attention.tiled.backward.attend_backward` returns them (and fills its
    ``grad_mask``, ``grad_alibi``, ``residue`` and ``spread``, laid out as there).

    The probabilities are formed again as the forward formed them, ``exp(score - shift)``,
    and ``1 / total`` rides on ``grad_out`` and ``delta``, so no pass over the tile divides.
    """
    units = rows.units
    ops = _operands(query, key, value, rules, units)
    batch, heads, q_len, k_len = ops.shape
    kv_heads, head_size = key.shape[1], query.shape[-1]
    group = heads // kv_heads
    scores, tanh = _scores(ops, rules, units, rows.careful)  # (B, H, Q, K)
    shift = rows.shift.to(scores.dtype).unsqueeze(-1)  # (B, H, Q, 1)
    probs = units.exp_(scores.sub_(shift))  # (B, H, Q, K): probabilities times total
    total = rows.total.to(scores.dtype).unsqueeze(-1)  # (B, H, Q, 1)
    inverse = torch.where(total > 0, 1.0 / total, 0.0)  # rows that see nothing: 0
    grad_rows = (grad_out.to(scores.dtype) * inverse).contiguous()  # (B, H, Q, D)
    grad_rows = grad_rows.view(batch * kv_heads, -1, head_size)  # (B*Hkv, G*Q, D)
    delta = delta.to(scores.dtype).unsqueeze(-1) * inverse  # (B, H, Q, 1)
    keys, values = ops.keys, ops.values
    if not all_finite(keys, values):
        # 0 x NaN is NaN: a key or value no row sees must not reach a gradient through a zero
        # probability. One that a row sees still does, through that row's delta.
        keys = keys.masked_fill(~keys.isfinite(), 0.0)
        values = values.masked_fill(~values.isfinite(), 0.0)
    flat = probs.view(batch * kv_heads, -1, k_len)  # (B*Hkv, G*Q, K)
    grad_value = torch.bmm(flat.transpose(1, 2), grad_rows)  # (B*Hkv, K, D), over the group
    grad_scores = torch.bmm(grad_rows, values.transpose(1, 2))  # (B*Hkv, G*Q, K)
    grad_scores = grad_scores.view(batch, heads, q_len, k_len)
    grad_scores.sub_(delta).mul_(probs)  # d loss / d scores
    if grad_mask is not None:  # folded (B, Hkv, Q, G, K)
        grad_mask.copy_(grad_scores.view(batch, kv_heads, group, q_len, k_len).transpose(2, 3))
    if residue is not None:  # folded (B, Hkv, Q, G)
        summed = grad_scores.sum(dim=-1, dtype=torch.float64)  # (B, H, Q)
        residue += summed.view(batch, kv_heads, group, q_len).transpose(2, 3)
    if grad_alibi is not None or spread is not None:
        far = distance(range(q_len), range(k_len), rules.past, scores.dtype, scores.device)
    if grad_alibi is not None:  # the bias is -slope * distance; (B, Hkv, G)
        moved = (grad_scores * far).sum(dim=(-2, -1), dtype=torch.float64)  # (B, H)
        grad_alibi -= moved.view(batch, kv_heads, group)
    if spread is not None:  # sum of p * distance, per row
        weighted = (probs * far).sum(dim=-1, dtype=torch.float64) * inverse.squeeze(-1)
        spread += weighted.view(batch, kv_heads, group, q_len).transpose(2, 3)
    if rules.softcap is not None:  # through the cap: d tanh = 1 - tanh²
        grad_scores.mul_(tanh.square_().neg_().add_(1.0))
    flat = grad_scores.view(batch * kv_heads, -1, k_len)  # (B*Hkv, G*Q, K)
    grad_query = torch.bmm(flat, keys).mul_(rules.scale)  # (B*Hkv, G*Q, D)
    # Taken against scale * unit * q; dividing by the unit brings it to scale * q.
    grad_key = torch.bmm(flat.transpose(1, 2), ops.queries).div_(units.unit)  # (B*Hkv, K, D)
    kv_shape = (batch, kv_heads, k_len, head_size)
    return (
        grad_query.view(batch, heads, q_len, head_size),
        grad_key.view(kv_shape),
        grad_value.view(kv_shape),
    )
