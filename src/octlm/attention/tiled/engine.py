"""The door to the tiled engines: each call's path chosen once, and its backward following it.

Three engines compute a call (docs/design.md, 'The numerics of the tiled core'):

- one row: a decoded token that sees every key is one softmax, issued here back to back;
- the whole tile: a call whose scores fit in one tile per head (:mod:`~.whole`);
- the block walk: FlashAttention's online softmax over the tiles (:mod:`~.walk`), and its
  recomputing backward (:mod:`~.walk_backward`).

:func:`forward_rows` picks one from the call and leaves the choice in the row statistics it
returns (:attr:`RowStats.whole`); :func:`attend_backward` follows that record, never the
shapes, so it forms again only tiles the forward formed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octlm.attention.masks import fully_visible
from octlm.attention.tiled.core import (
    NEG_INF,
    RowStats,
    Rules,
    Units,
    accumulation_dtype,
    as_3d,
    block_steps,
    blockwise,
    fold_keys,
)
from octlm.attention.tiled.walk import walk_forward
from octlm.attention.tiled.walk_backward import walk_backward
from octlm.attention.tiled.whole import fits_whole, whole_backward, whole_forward


@block_steps
def forward_rows(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules
) -> tuple[Tensor, RowStats]:
    """``out (B, H, Q, D)`` in the accumulation dtype and the exact row statistics, by the
    engine the call picks. See :func:`attend_forward`."""
    if 0 in query.shape or 0 in key.shape:
        return _nothing_to_see(query, rules)
    if _sees_every_key(query, key, rules):
        out, rows = _one_row_each(query, key, value, rules)
        if not bool(out.isnan().any()):
            return out, rows
    elif fits_whole(query, key, rules):
        return whole_forward(query, key, value, rules)
    return walk_forward(query, key, value, rules)  # and a NaN from one row: the careful walk


def attend_forward(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules
) -> tuple[Tensor, Tensor]:
    """Attention of ``query`` over one chunk of keys, as a function.

    ``query (B, H, Q, D)``, ``key``/``value (B, Hkv, K, D)``, under ``rules``. Inputs are not
    validated here (the public functions do that). Returns ``out (B, H, Q, D)`` normalised,
    and ``lse (B, H, Q)``, both in the accumulation dtype; rows that see no key get
    ``out = 0`` and ``lse = -inf``. Two such partial results over disjoint key chunks combine
    exactly with :func:`~octlm.attention.tiled.core.merge`.
    """
    out, rows = forward_rows(query, key, value, rules)
    return out, rows.lse()


@block_steps
def attend_backward(
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
    """Gradients of one query chunk against one key chunk, by the engine the forward's
    ``rows`` record: FlashAttention-2's backward, each tile's probabilities recomputed.

    ``rows`` (the forward's exact statistics, or :meth:`RowStats.of_lse` of rows that see
    keys beyond this chunk) and ``delta = rowsum(grad_out * out)`` are ``(B, H, Q)`` over
    *all* keys the queries attend to, so each chunk's probabilities ``exp(score - shift) /
    total`` are exact. Returns ``dq (B, H, Q, D)`` and ``dk``/``dv (B, Hkv, K, D)`` in the
    accumulation dtype, summed over each GQA group. When ``grad_mask`` (folded like the mask,
    full size) is given, the scores' gradient is written into it. Sinks change nothing here
    (they live in the row statistics); their gradient is
    :func:`~octlm.attention.tiled.core.sink_gradient`.

    ``delta`` comes from the rounded output, so each row's ``ds`` sums to a little more or less
    than it should, and the sinks' gradient multiplies that residue over every row:
    ``residue`` (``(B, Hkv, Q, G)`` float64, when given) receives what each row's ``ds`` sums
    to over these keys, from which :func:`~octlm.attention.tiled.core.delta_error` corrects
    it. ``moments`` (``(B, H, Q, 4)`` float64, with learned ALiBi slopes) receives each row's
    :func:`~octlm.attention.tiled.core.slope_moments` over these keys, formed in float64.
    """
    if 0 in query.shape or 0 in key.shape:
        dtype = accumulation_dtype(query.dtype)
        return tuple(torch.zeros_like(x, dtype=dtype) for x in (query, key, value))
    backward = whole_backward if rows.whole else walk_backward
    return backward(
        query, key, value, grad_out, rows, delta, rules,
        grad_mask=grad_mask, residue=residue, moments=moments,
    )  # fmt: skip


def _nothing_to_see(query: Tensor, rules: Rules) -> tuple[Tensor, RowStats]:
    """No rows, or no keys to see: zeros, as naive gives; each row's lse is its sink's logit."""
    dtype = accumulation_dtype(query.dtype)
    units = Units.choose(rules)
    out = query.new_zeros(query.shape, dtype=dtype)  # (B, H, Q, D)
    nothing = query.new_zeros(query.shape[:-1], dtype=dtype)  # (B, H, Q)
    if rules.sinks is None:
        return out, RowStats(nothing, nothing, units)
    logits = (rules.sinks.to(dtype) * units.unit).view(1, -1, 1).expand_as(nothing)  # (B, H, Q)
    shift = logits.masked_fill(logits == NEG_INF, 0.0)
    return out, RowStats(shift, units.exp_(logits - shift), units)


def _sees_every_key(query: Tensor, key: Tensor, rules: Rules) -> bool:
    """Whether each head has one query row (a decoded token) that sees every key, unmodified."""
    keys = range(key.shape[2])
    if query.shape[2] != 1 or not fully_visible(
        range(1), keys, rules.past, rules.causal, rules.window
    ):
        return False
    structure = (rules.mask, rules.key_lengths, rules.key_starts, rules.documents)
    modifiers = (rules.softcap, rules.alibi_slopes, rules.sinks, rules.block_mask)
    return all(x is None for x in (*structure, *modifiers))


def _one_row_each(query, key, value, rules: Rules) -> tuple[Tensor, RowStats]:
    """Decoding one token against every key: one softmax over the keys, its operations issued
    back to back. The block walk would give the same numbers (its first block sets the shift
    to the maximum just as here), but on CPU each large operation that follows a pause in
    Python starts slower, and the walk's bookkeeping is such a pause between every two. The
    record is the walk's, so the walk's backward forms this tile again."""
    batch, heads, _, head_size = query.shape
    dtype = accumulation_dtype(query.dtype)
    units = Units.choose(rules)
    scaled = query.to(dtype) * (rules.scale * units.unit)  # (B, H, 1, D)
    rows = scaled.reshape(-1, heads // key.shape[1], head_size)  # (B*Hkv, G, D)
    keys = as_3d(fold_keys(key, dtype, None))  # (B*Hkv, K, D)
    weights = torch.bmm(rows, keys.transpose(1, 2))  # (B*Hkv, G, K)
    shift = weights.amax(dim=-1, keepdim=True)  # (B*Hkv, G, 1)
    units.exp_(weights.sub_(shift))
    total = weights.sum(dim=-1, keepdim=True)  # (B*Hkv, G, 1)
    out = torch.bmm(weights, as_3d(blockwise(value.to(dtype)))).div_(total)  # (B*Hkv, G, D)
    # Formed unshifted, then shifted, as the walk's first (and widest) block, from plain operands.
    shift, total = shift.view(batch, heads, 1), total.view(batch, heads, 1)
    stats = RowStats(shift, total, units, rebased=frozenset({(0, 0)}), shift_column=False)
    return out.view(batch, heads, 1, head_size), stats
