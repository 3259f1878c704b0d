"""The forward block steps: FlashAttention's online softmax over the tiles of a :class:`BlockWalk`.

For each query block a per-row shift, the running sum and the unnormalised output are carried
across key blocks (:class:`OnlineSoftmax`), and the output is normalised once at the end.
:func:`attend_forward` is the steps as a function over one chunk of queries against one chunk
of keys; :func:`~octlm.attention.tiled.core.merge` combines such results exactly.
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
    fold,
    fold_keys,
    unfold_heads,
)
from octlm.attention.tiled.threads import parallel_map
from octlm.attention.tiled.walk import BlockWalk
from octlm.attention.tiled.whole import fits_whole, whole_forward

# The most one block's weights may sum to (relative to the row's shift) before the shift
# moves up to that block's maximum and the block is recomputed.
CEILING = 2.0**16
# Query rows per block (heads of a group included) from which the shift rides in the matmul.
FUSED_SHIFT_ROWS = 64


class OnlineSoftmax:
    """The online softmax of one query block: per-row shift, running sum, unnormalised output.

    In the walk's units and relative to ``shift``: ``running_sum = sum exp(score - shift)`` and
    ``acc = sum exp(score - shift) * value`` over the keys read so far. With ``fused`` the
    shift lives in the query block's extra column (as ``-shift``), so the score matmul
    subtracts it; without, it is subtracted after the float mask is added, so a mask value far
    from the shift never cancels against it. Nothing is allocated before the first key block,
    whose sums simply become the state: decoding one token against one wide block costs a
    handful of operations.
    """

    def __init__(self, walk: BlockWalk, q_block: Tensor, rows: range, fused: bool):
        self.walk, self.q_block, self.rows, self.fused = walk, q_block, rows, fused
        self.shift = self.running_sum = self.acc = None  # (B*Hkv, R, 1), (…, 1), (…, D)
        self.unset = True  # some rows have not seen a key yet: their shift is a placeholder

    def needs_rebase(self) -> bool:
        """Whether the next block must set shifts: always first, then while a row saw nothing
        (asked only then, since asking waits for the tensors)."""
        if self.unset and self.running_sum is not None:
            self.unset = bool((self.running_sum == 0).any())
        return self.unset

    def scores(self, columns: range) -> Tensor:
        """``(B*Hkv, R, C)`` scores of one key block minus the shift, hidden places -inf."""
        scores = self.walk.scores(self.q_block, self.rows, columns)
        return scores if self.fused else scores.sub_(self.shift)

    def rebase(self, columns: range) -> Tensor:
        """Scores of one key block, with each row's shift moved up to the block's maximum.

        The scores are recomputed from nothing (not from scores relative to the old shift,
        which would round them to the old shift's precision), so the result is as exact as a
        first block. Rows that have seen no key take this block's maximum, up or down; the
        others only move up, and what they summed is rescaled by ``exp(old - new) <= 1``.
        Every weight of the block is then at most 1, so its sum cannot pass ``CEILING``.
        """
        plain = self.q_block[..., :-1] if self.fused else self.q_block  # no shift column
        scores = self.walk.scores(plain, self.rows, columns)  # (B*Hkv, R, C), absolute
        self.walk.rebased.add((self.rows.start, columns.start))
        shift = scores.amax(dim=-1, keepdim=True)  # (B*Hkv, R, 1)
        summed = self.running_sum is not None
        if summed:
            empty = self.running_sum == 0
            shift = torch.where(empty, shift, torch.maximum(self.shift, shift))
        shift.masked_fill_(shift == NEG_INF, 0.0)  # rows that see nothing here either
        if summed:
            correction = self.walk.units.exp_(self.shift - shift).masked_fill_(empty, 1.0)
            self.running_sum.mul_(correction)
            self.acc.mul_(correction)
        self.shift = shift
        if self.fused:
            self.q_block[..., -1:] = -shift.view(*self.q_block.shape[:-1], 1)
        return scores.sub_(shift)

    def add(self, weights: Tensor, block_sum: Tensor, values: Tensor) -> None:
        """Sum one block's ``weights (B*Hkv, R, C)`` and their rows ``block_sum``, over
        ``values (B*Hkv, C, D)``."""
        if self.running_sum is None:
            self.running_sum, self.acc = block_sum, torch.bmm(weights, values)  # (…, 1), (…, D)
        else:
            self.running_sum += block_sum
            self.acc.baddbmm_(weights, values)

    def see_nothing(self, head_size: int) -> None:
        """The state of rows that meet no key block: nothing summed, shift 0."""
        self.shift = self.q_block.new_zeros(
            self.walk.batch * self.walk.kv_heads, self.q_block.shape[2], 1
        )
        self.running_sum = torch.zeros_like(self.shift)  # (B*Hkv, R, 1)
        self.acc = self.shift.new_zeros(*self.shift.shape[:-1], head_size)  # (B*Hkv, R, D)

    def absorb(self, logits: Tensor) -> None:
        """One more score per row, ``(B*Hkv, R, 1)`` in units, that joins the sum and carries
        no value: an attention sink. The shift moves up to it where it is larger (rows that
        saw no key take it), rescaling what was summed by ``exp(old - new) <= 1``."""
        empty = self.running_sum == 0
        shift = torch.where(empty, logits, torch.maximum(self.shift, logits))
        shift.masked_fill_(shift == NEG_INF, 0.0)  # a -inf sink and no key: nothing is summed
        correction = self.walk.units.exp_(self.shift - shift).masked_fill_(empty, 1.0)
        self.running_sum.mul_(correction).add_(self.walk.units.exp_(logits - shift))
        self.acc.mul_(correction)
        self.shift = shift

    def output(self) -> Tensor:
        """Normalised output ``(B*Hkv, R, D)``; rows that saw no key are 0."""
        # A row that saw a key sums to at least 1 (its shift's own weight); one that saw none
        # has acc = 0, and 0 / tiny = 0.
        return self.acc.div_(self.running_sum.clamp_min(torch.finfo(self.acc.dtype).tiny))


@block_steps
def forward_rows(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules
) -> tuple[Tensor, RowStats]:
    """The forward block steps; ``out`` and the exact row statistics. See :func:`attend_forward`.

    Inputs are assumed finite, and checked only afterwards: a NaN or infinity that reached
    any row shows up as NaN in the output (O(Q·D) to look at, against O(K·D) for the inputs,
    which is the whole cost of decoding one token). Only then is the call run again with the
    masked fills that keep a hidden NaN out of the rows that cannot see it.
    """
    if fits_whole(query, key, rules) and not _sees_every_key(query, key, rules):
        return whole_forward(query, key, value, rules)
    out, rows = _forward_pass(query, key, value, rules, careful=False)
    if bool(out.isnan().any()):
        out, rows = _forward_pass(query, key, value, rules, careful=True)
    return out, rows


def _forward_pass(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules, *, careful: bool
) -> tuple[Tensor, RowStats]:
    mask, scale, sinks = rules.mask, rules.scale, rules.sinks
    dtype = accumulation_dtype(query.dtype)
    heads, kv_heads, head_size = query.shape[1], key.shape[1], query.shape[-1]
    units = Units.choose(rules)
    if 0 in query.shape or 0 in key.shape:  # no rows, or no keys to see: zeros, as naive gives
        nothing = query.new_zeros(query.shape[:-1], dtype=dtype)  # (B, H, Q)
        if sinks is None:
            return query.new_zeros(query.shape, dtype=dtype), RowStats(nothing, nothing, units)
        # The sink alone is in each row's denominator: its log-sum-exp is the sink's logit
        # (-inf for a -inf sink, which sums nothing).
        logits = (sinks.to(dtype) * units.unit).view(1, -1, 1).expand_as(nothing)  # (B, H, Q)
        shift = logits.masked_fill(logits == NEG_INF, 0.0)
        rows = RowStats(shift, units.exp_(logits - shift), units)
        return query.new_zeros(query.shape, dtype=dtype), rows
    if not careful and _sees_every_key(query, key, rules):
        return _one_row_each(query, key, value, scale * units.unit, units)
    float_mask = mask is not None and mask.is_floating_point()
    rows_per_block = min(rules.block[0], query.shape[2]) * (heads // kv_heads)
    # The fused shift costs a copy of the keys with a column of ones: worth it when each key
    # block meets many query rows, not when decoding one token against a long cache. A float
    # mask must be added before the shift is subtracted, so it is never fused; nor are the
    # score modifiers, which act on the scores themselves.
    modified = rules.softcap is not None or rules.alibi_slopes is not None
    fused = rows_per_block >= FUSED_SHIFT_ROWS and not float_mask and not modified
    extra = 0.0 if fused else None
    folded = fold(query, kv_heads, scale * units.unit, dtype, extra)  # (B, Hkv, Q, G, D [+ 1])
    keys = fold_keys(key, dtype, 1.0 if fused else None)  # (B, Hkv, K, D [+ 1])
    value = blockwise(value.to(dtype))  # (B, Hkv, K, D)
    broken = None
    if careful:
        # 0 x NaN is NaN: a value a row cannot see must not reach it through a zero weight.
        # Values are summed clean, and what a row can see of the rest is put back at the
        # end: per dimension, NaN where it sees a NaN or infinities of both signs, else the
        # infinity it sees (as the definition gives, whatever the tiles).
        kinds = (value.isnan(), value == float("inf"), value == float("-inf"))
        value = value.masked_fill(~value.isfinite(), 0.0)
        broken = as_3d(torch.cat(kinds, dim=-1).to(dtype))  # (B*Hkv, K, 3 * D)
    walk = BlockWalk(folded, keys, rules, units, careful=careful)
    if sinks is not None:
        sinks = (sinks.to(dtype) * units.unit).view(1, kv_heads, 1, -1)  # (1, Hkv, 1, G)

    def attend(rows: range) -> tuple[Tensor, Tensor, Tensor]:
        """One query block's output ``(B, Hkv, R, G, D)``, shift and sum ``(B, Hkv, R, G)``;
        blocks run concurrently on CPU."""
        state = OnlineSoftmax(walk, walk.rows(folded, rows), rows, fused)
        poison = None
        for columns in walk.key_blocks(rows):
            rebased = state.needs_rebase()
            scores = state.rebase(columns) if rebased else state.scores(columns)
            visible = scores != NEG_INF if careful else None  # (B*Hkv, R, C)
            weights = units.exp_(scores)  # (B*Hkv, R, C), in place of the scores
            block_sum = weights.sum(dim=-1, keepdim=True)  # (B*Hkv, R, 1)
            if not rebased and not bool(block_sum.max() <= CEILING):  # also inf and NaN
                # A score rose far above its row's shift: redo the block with the shift moved.
                weights = units.exp_(state.rebase(columns))
                block_sum = weights.sum(dim=-1, keepdim=True)
            keys_here = slice(columns.start, columns.stop)
            state.add(weights, block_sum, as_3d(value[:, :, keys_here]))
            if careful:
                seen_broken = torch.bmm(visible.to(dtype), broken[:, keys_here]) > 0
                poison = seen_broken if poison is None else poison | seen_broken
        if state.running_sum is None:  # the rows met no key block
            state.see_nothing(head_size)
        if sinks is not None:
            shape = (walk.batch, kv_heads, len(rows), walk.group)
            state.absorb(sinks.expand(shape).reshape(walk.batch * kv_heads, -1, 1))
        result = state.output()  # (B*Hkv, R, D)
        if poison is not None:  # a row already NaN (a NaN score) stays NaN
            nan, high, low = poison.split(head_size, dim=-1)  # (B*Hkv, R, D) each
            nan = nan | (high & low) | result.isnan()
            result.masked_fill_(high, float("inf")).masked_fill_(low, float("-inf"))
            result.masked_fill_(nan, float("nan"))
        shape = (walk.batch, kv_heads, len(rows), walk.group)
        total = state.running_sum.view(shape)
        return result.view(*shape, head_size), state.shift.view(shape), total

    blocks = walk.largest_first()
    if len(blocks) == 1:  # decoding, short chunks: the block's own tensors, no copy
        out, shift, total = attend(blocks[0])
    else:
        out = folded.new_empty(*folded.shape[:-1], head_size)  # (B, Hkv, Q, G, D)
        shift = folded.new_empty(folded.shape[:-1])  # (B, Hkv, Q, G), in units
        total = torch.empty_like(shift)  # (B, Hkv, Q, G)

        def write(rows: range) -> None:
            for whole, part in zip((out, shift, total), attend(rows), strict=True):
                whole[:, :, rows.start : rows.stop] = part

        parallel_map(write, blocks, query.device)
    rows = RowStats(
        unfold_heads(shift), unfold_heads(total), units, careful, frozenset(walk.rebased), fused
    )
    return unfold_heads(out), rows


def _sees_every_key(query: Tensor, key: Tensor, rules: Rules) -> bool:
    """Whether this is one query row per head (decoding a token) that sees every key: then
    its attention is a single softmax, whatever the tiles."""
    keys = range(key.shape[2])
    if query.shape[2] != 1 or not fully_visible(
        range(1), keys, rules.past, rules.causal, rules.window
    ):
        return False
    structure = (rules.mask, rules.key_lengths, rules.key_starts, rules.documents)
    modifiers = (rules.softcap, rules.alibi_slopes, rules.sinks, rules.block_mask)
    return all(x is None for x in (*structure, *modifiers))


def _one_row_each(query, key, value, scale: float, units: Units) -> tuple[Tensor, RowStats]:
    """Decoding one token against every key: one softmax over the keys, its operations issued
    back to back. The block loop would give the same numbers (its first block sets the shift
    to the maximum just as here), but on CPU each large operation that follows a pause in
    Python starts slower, and the loop's bookkeeping is such a pause between every two."""
    batch, heads, _, head_size = query.shape
    dtype = accumulation_dtype(query.dtype)
    rows = (query.to(dtype) * scale).reshape(-1, heads // key.shape[1], head_size)  # (B*Hkv, G, D)
    keys = as_3d(fold_keys(key, dtype, None))  # (B*Hkv, K, D)
    weights = torch.bmm(rows, keys.transpose(1, 2))  # (B*Hkv, G, K)
    shift = weights.amax(dim=-1, keepdim=True)  # (B*Hkv, G, 1)
    units.exp_(weights.sub_(shift))
    total = weights.sum(dim=-1, keepdim=True)  # (B*Hkv, G, 1)
    out = torch.bmm(weights, as_3d(blockwise(value.to(dtype)))).div_(total)  # (B*Hkv, G, D)
    # Formed whole and shifted, as the loop's first (and widest) block, from plain operands.
    shift, total = shift.view(batch, heads, 1), total.view(batch, heads, 1)
    stats = RowStats(shift, total, units, rebased=frozenset({(0, 0)}), shift_column=False)
    return out.view(batch, heads, 1, head_size), stats


def attend_forward(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules
) -> tuple[Tensor, Tensor]:
    """Attention of ``query`` over one chunk of keys: the forward block steps as a function.

    ``query (B, H, Q, D)``, ``key``/``value (B, Hkv, K, D)``, under ``rules``. Inputs are not
    validated here (the public functions do that). Returns ``out (B, H, Q, D)`` normalised,
    and ``lse (B, H, Q)``, both in the accumulation dtype; rows that see no key get
    ``out = 0`` and ``lse = -inf``. Two such partial results over disjoint key chunks combine
    exactly with :func:`merge`.

    Softmax is invariant to a per-row shift, so the shift need not be the exact running
    maximum: it is set from each row's first visible block and moves up only when a later
    block's weights sum past ``CEILING`` (or overflow), in which case that block is recomputed
    against the new shift. The usual block therefore costs no maximum pass and no rescale.
    """
    out, rows = forward_rows(query, key, value, rules)
    return out, rows.lse()
