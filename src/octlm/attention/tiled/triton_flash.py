"""FlashAttention-2 as Triton kernels: forward, and a deterministic recomputing backward.

The same algorithm and semantics as :mod:`octlm.attention.tiled` (docs/design.md, 'Tensor
conventions'), compiled for the GPU: GQA (query head ``h`` reads key/value head ``h // (H //
Hkv)``), bottom-right causal alignment, a sliding window, left and right padding (``key_starts``,
``key_lengths``), packed documents (``document_ids``), the score modifiers ``softcap`` and
``alibi_slopes`` and learnable ``sinks``, any lengths, head sizes up to 256 (padded inside the
kernels to a power of two, at least 16, with masked loads), float16, bfloat16 and float32 inputs
with fp32 accumulation, zeros (never NaN) for rows that see no key and an fp32 log-sum-exp. Only
``mask`` and ``block_mask`` are left to the PyTorch blocks.

Three kernels, one program per tile, no atomics:

- forward: one program per (query block, head, batch) walks the key blocks its rows may see,
  carrying ``running_max``/``running_sum`` (online softmax, base 2), and writes the output, the
  fp32 log-sum-exp, and for the backward each row's final base-2 shift and sum.
- key/value gradients: one program per (key block, kv head, batch) walks every query head of
  its GQA group and every query block that may see it, recomputing the probabilities as
  ``exp2(scores - shift) / sum``; the group's sum happens in registers, in a fixed order.
- query gradient: one program per (query block, head, batch) walks the key blocks again.

The backward recomputes each score as the forward formed it: the same ``q @ kᵀ`` operand order (the
key/value kernel transposes the product, not its operands), the same base-2 arithmetic, and the
forward's own shift, never one rebuilt from the natural-log lse (whose rounding, times ``log2(e)``,
would move it). So a row whose only score is its shift gets probability exactly 1, as in the forward
(docs/design.md, 'The numerics of the tiled core', for the PyTorch engine).

``delta = rowsum(dO * O)`` is computed once beforehand, in PyTorch, and so are the gradients of
the sinks (from the row statistics and delta alone) and the sum of the query-gradient programs'
partial sums for the ALiBi slopes. Key blocks that the causal or window rule or the padding
hides from a whole query block (and vice versa) are never visited, nor are those outside the
span of the block's documents: each key's document is passed as the first and one past the last
position of its id in the row (:func:`_document_spans`), so a block's span is a min and a max,
with no branch inside the loop. Inside the span, documents are masked element by element.

Triton is optional (``octlm[triton]``): without it this module still imports and
:func:`is_available` says False. With it, importing this module imports Triton (about 0.3 s)
and builds the kernels, so callers import it when they first need it. For the kernels to run
on CPU tensors, ``TRITON_INTERPRET=1`` must be set before Triton is first imported in the
process (tests do that); the interpreter computes bfloat16 wrongly, so it is refused there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octlm.attention.inputs import COMMON, Call, call_of, check, keyword_only

# The call keywords triton_attention takes: all but ``block_mask`` (and a ``mask`` is refused).
TRITON_KEYWORDS = (*COMMON, "key_starts", "document_ids", "softcap", "alibi_slopes", "sinks")

try:
    import triton
    import triton.language as tl
except ImportError:  # octlm[triton] not installed
    triton = None

MAX_HEAD_SIZE = 256
LOG2E = 1.4426950408889634  # log2(e): the kernels keep scores in base 2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _jit(fn):
    """``triton.jit``, or the plain function when Triton is missing (never launched then)."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _visible(position, key, k_lo, k_hi, window, CAUSAL: tl.constexpr):
    """Where a query at ``position`` may see ``key`` (broadcast shapes), keys outside
    ``[k_lo, k_hi)`` being padding: docs/design.md, 'Tensor conventions'. Documents are checked by
    the caller."""
    seen = (key >= k_lo) & (key < k_hi) & (position - key < window)
    if CAUSAL:
        seen = seen & (key <= position)
    return seen


@_jit
def _key_bounds(BOUNDS, batch, k_len, PADDED: tl.constexpr):
    """Keys ``[k_lo, k_hi)`` that are not padding in batch row ``batch``."""
    k_lo = 0
    k_hi = k_len
    if PADDED:
        k_lo = tl.load(BOUNDS + 2 * batch)
        k_hi = tl.load(BOUNDS + 2 * batch + 1)
    return k_lo, k_hi


@_jit
def _document_span(DOCS, batch, stride_db, first, k_len, BLOCK: tl.constexpr):
    """The documents of key positions ``first .. first + BLOCK - 1`` ``(BLOCK,)``, each named by
    the position where it first appears in the row, and the keys ``[low, high)`` that all of
    them span. ``first < k_len``; positions past ``k_len`` repeat its document."""
    base = DOCS + batch * stride_db  # (2, K): first position, and one past the last, per key
    positions = first + tl.arange(0, BLOCK)  # (BLOCK,)
    positions = tl.where(positions < k_len, positions, first)
    docs = tl.load(base + positions)  # (BLOCK,)
    ends = tl.load(base + k_len + positions)  # (BLOCK,)
    return docs, tl.min(docs, 0), tl.max(ends, 0)


@_jit
def _key_range(start_m, past, k_lo, k_hi, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):  # fmt: skip
    """Keys ``[lo, hi)`` that rows ``start_m .. start_m + BLOCK_M - 1`` may see, of the keys
    ``[k_lo, k_hi)`` that are not padding; lo on a block."""
    lo = tl.maximum(tl.maximum(past + start_m - window + 1, k_lo), 0) // BLOCK_N * BLOCK_N
    hi = k_hi
    if CAUSAL:
        hi = tl.minimum(past + start_m + BLOCK_M, k_hi)  # the last row sees up to here
    return lo, hi


@_jit
def _query_range(start_n, past, q_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr):  # fmt: skip
    """Rows ``[lo, hi)`` that may see any key of ``start_n .. start_n + BLOCK_N - 1``."""
    lo = 0
    if CAUSAL:
        lo = tl.maximum(start_n - past, 0) // BLOCK_M * BLOCK_M  # first row to reach start_n
    hi = tl.minimum(start_n + BLOCK_N - 1 - past + window, q_len)  # last key's window ends
    return lo, hi


@_jit
def _slope(SLOPES, batch, head, stride_sb, ALIBI: tl.constexpr):
    """ALiBi's slope of this batch row and head, in base-2 units (0 without ALiBi)."""
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + batch * stride_sb + head) * 1.4426950408889634
    return slope


@_jit
def _scores(products, position, key, scale, softcap, slope, SOFTCAP: tl.constexpr,
            ALIBI: tl.constexpr):  # fmt: skip
    """Base-2 scores of a tile from its ``q·k`` products (any orientation; ``position`` and
    ``key`` broadcast to it), with the modifiers of docs/design.md, 'Tensor conventions' in their
    order: the softcap, then ALiBi's bias. Base 2, since exp2 is the native instruction. Also
    ``tanh(s / softcap)``, whose derivative the backward needs (the products themselves without a
    softcap)."""
    tanh = products
    if SOFTCAP:
        # tanh from exp2, as the interpreter has no libdevice: exp2 -> inf gives 1, -> 0 gives -1
        tanh = 1.0 - 2.0 / (tl.exp2(products * (2.0 * 1.4426950408889634 * scale / softcap)) + 1.0)
        scores = tanh * (softcap * 1.4426950408889634)
    else:
        scores = products * (scale * 1.4426950408889634)
    if ALIBI:
        scores = scores - slope * tl.abs(position - key).to(tl.float32)
    return scores, tanh


@_jit
def _row_stats(SHIFT, INVERSE, DELTA, offset, rows, row_ok):
    """A block's forward shift (base 2), ``1 / sum`` and delta ``(M,)``: the probabilities are
    ``exp2(score - shift) * inverse``. Rows that see no key have shift 0 and inverse 0."""
    shift = tl.load(SHIFT + offset + rows, mask=row_ok, other=0.0)
    inverse = tl.load(INVERSE + offset + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + offset + rows, mask=row_ok, other=0.0)
    return shift, inverse, delta


@_jit
def _key_value_block(k_base, v_base, stride_kl, stride_vl, cols, dims, k_lo, k_hi, dim_ok):
    """Key and value rows ``cols`` of one head, ``(N, D)`` each: zeros outside the keys
    ``[k_lo, k_hi)`` that are not padding (a NaN there is never read) and in the head-size
    padding."""
    kv_ok = ((cols >= k_lo) & (cols < k_hi))[:, None] & dim_ok[None, :]  # (N, D)
    k = tl.load(k_base + cols[:, None] * stride_kl + dims[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_base + cols[:, None] * stride_vl + dims[None, :], mask=kv_ok, other=0.0)
    return k, v


@_jit
def _forward_kernel(
    Q, K, V, O, LSE, SHIFT, TOTAL, DOCS, BOUNDS, SLOPES, SINKS,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_ol,
    stride_db, stride_sb,
    heads, group, q_len, k_len, window, scale, softcap,
    HEAD_SIZE: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr, PADDED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    SINK: tl.constexpr,
):  # fmt: skip
    """Output and log-sum-exp of one query block of one head, and each row's final base-2
    shift and sum, from which the backward recomputes the probabilities."""
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // group
    past = k_len - q_len
    # Where this (batch, head)'s (L, D) slice of each tensor starts.
    q_base = Q + batch * stride_qb + head * stride_qh
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    o_base = O + batch * stride_ob + head * stride_oh
    rows = start_m + tl.arange(0, BLOCK_M)  # (M,) query rows
    dims = tl.arange(0, HEAD_BLOCK)  # (D,) padded to a power of two; the pad loads zeros
    dim_ok = dims < HEAD_SIZE
    q_ok = (rows < q_len)[:, None] & dim_ok[None, :]  # (M, D)
    q = tl.load(q_base + rows[:, None] * stride_ql + dims[None, :], mask=q_ok, other=0.0)
    k_lo, k_hi = _key_bounds(BOUNDS, batch, k_len, PADDED)
    slope = _slope(SLOPES, batch, head, stride_sb, ALIBI)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # (M,)
    running_sum = tl.zeros([BLOCK_M], tl.float32)  # (M,) sum of exp2(score - running_max)
    acc = tl.zeros([BLOCK_M, HEAD_BLOCK], tl.float32)  # (M, D) unnormalised output

    lo, hi = _key_range(start_m, past, k_lo, k_hi, window, BLOCK_M, BLOCK_N, CAUSAL)
    if DOCUMENTS:  # row i is in the document of key past + i; keys outside them are skipped
        row_docs, low, high = _document_span(DOCS, batch, stride_db, past + start_m, k_len,
                                             BLOCK_M)  # fmt: skip
        lo = tl.maximum(lo, low // BLOCK_N * BLOCK_N)
        hi = tl.minimum(hi, high)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # (N,) keys
        k, v = _key_value_block(
            k_base, v_base, stride_kl, stride_vl, cols, dims, k_lo, k_hi, dim_ok
        )
        products = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N)
        position = past + rows[:, None]  # (M, 1)
        scores, _ = _scores(products, position, cols[None, :], scale, softcap, slope,
                            SOFTCAP, ALIBI)  # fmt: skip
        visible = _visible(position, cols[None, :], k_lo, k_hi, window, CAUSAL)  # (M, N)
        if DOCUMENTS:
            key_docs, _, _ = _document_span(DOCS, batch, stride_db, start_n, k_len, BLOCK_N)
            visible = visible & (row_docs[:, None] == key_docs[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        block_max = tl.maximum(running_max, tl.max(scores, 1))  # (M,)
        # A row that has seen nothing yet keeps max -inf; shifting by 0 there makes its
        # weights exp2(-inf) = 0 instead of exp2(-inf - -inf) = NaN.
        shift = tl.where(block_max == float("-inf"), 0.0, block_max)  # (M,)
        correction = tl.exp2(running_max - shift)  # (M,) rescales what was summed so far
        weights = tl.exp2(scores - shift[:, None])  # (M, N)
        running_sum = running_sum * correction + tl.sum(weights, 1)
        acc = tl.dot(weights.to(v.dtype), v, acc * correction[:, None], input_precision=PRECISION)
        running_max = block_max

    if SINK:  # one more logit per row, with no value: it joins the sum and shrinks the output
        sink = tl.load(SINKS + head) * 1.4426950408889634
        block_max = tl.maximum(running_max, sink)  # (M,)
        shift = tl.where(block_max == float("-inf"), 0.0, block_max)  # (M,)
        correction = tl.exp2(running_max - shift)  # (M,)
        running_sum = running_sum * correction + tl.exp2(sink - shift)
        acc = acc * correction[:, None]
        running_max = block_max
    seen = running_sum > 0  # (M,) False for rows that see no key (nor a sink)
    total = tl.where(seen, running_sum, 1.0)  # (M,)
    out = acc / total[:, None]  # (M, D), zeros where unseen
    lse = tl.where(seen, (running_max + tl.log2(total)) * 0.6931471805599453, float("-inf"))
    o_at = rows[:, None] * stride_ol + dims[None, :]  # (M, D)
    tl.store(o_base + o_at, out.to(O.dtype.element_ty), mask=q_ok)
    stats = (batch * heads + head) * q_len + rows  # (M,)
    tl.store(LSE + stats, lse, mask=rows < q_len)  # ln, not log2
    # A row that sees nothing keeps shift 0: its scores are all -inf, so its weights are 0.
    tl.store(SHIFT + stats, tl.where(seen, running_max, 0.0), mask=rows < q_len)
    tl.store(TOTAL + stats, running_sum, mask=rows < q_len)


@_jit
def _key_value_grad_kernel(
    Q, K, V, DO, SHIFT, INVERSE, DELTA, DK, DV, DOCS, BOUNDS, SLOPES,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_gb, stride_gh, stride_gl,
    stride_db, stride_sb,
    heads, group, q_len, k_len, window, scale, softcap,
    HEAD_SIZE: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr, PADDED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key block of one kv head, summed over its GQA group in fixed order.

    ``DO`` has the strides of ``Q`` (the wrapper makes sure); ``DK``/``DV`` share the strides
    ``stride_g*``. Tiles are transposed (keys by rows) so that both gradients come straight out
    of a matmul; the scores' products are taken as the forward takes them and then transposed.
    """
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    past = k_len - q_len
    cols = start_n + tl.arange(0, BLOCK_N)  # (N,) keys
    dims = tl.arange(0, HEAD_BLOCK)  # (D,)
    dim_ok = dims < HEAD_SIZE
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    k_lo, k_hi = _key_bounds(BOUNDS, batch, k_len, PADDED)
    k, v = _key_value_block(k_base, v_base, stride_kl, stride_vl, cols, dims, k_lo, k_hi, dim_ok)
    grad_key = tl.zeros([BLOCK_N, HEAD_BLOCK], tl.float32)  # (N, D), per unit of scores
    grad_value = tl.zeros([BLOCK_N, HEAD_BLOCK], tl.float32)  # (N, D)

    lo, hi = _query_range(start_n, past, q_len, window, BLOCK_M, BLOCK_N, CAUSAL)
    if PADDED:  # a block of padding keys is seen by no row
        hi = tl.where((start_n + BLOCK_N > k_lo) & (start_n < k_hi), hi, lo)
    if DOCUMENTS:  # rows outside this block's documents are skipped
        key_docs, low, high = _document_span(DOCS, batch, stride_db, start_n, k_len, BLOCK_N)
        lo = tl.maximum(lo, tl.maximum(low - past, 0) // BLOCK_M * BLOCK_M)
        hi = tl.minimum(hi, high - past)
    for member in range(group):  # the query heads that read this kv head
        head = kv_head * group + member
        q_base = Q + batch * stride_qb + head * stride_qh
        do_base = DO + batch * stride_qb + head * stride_qh
        stats = (batch * heads + head) * q_len  # where this head's rows start in the stats
        slope = _slope(SLOPES, batch, head, stride_sb, ALIBI)
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)  # (M,) query rows
            row_ok = rows < q_len
            q_ok = row_ok[:, None] & dim_ok[None, :]  # (M, D)
            q_at = rows[:, None] * stride_ql + dims[None, :]  # (M, D) offsets, also for dO
            q = tl.load(q_base + q_at, mask=q_ok, other=0.0)  # (M, D)
            grad_out = tl.load(do_base + q_at, mask=q_ok, other=0.0)  # (M, D)
            shift, inverse, delta = _row_stats(SHIFT, INVERSE, DELTA, stats, rows, row_ok)
            # q @ kᵀ as in the forward, so each product is its bits; k @ qᵀ may round otherwise.
            products = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N)
            products_t = tl.trans(products)  # (N, M)
            position = past + rows[None, :]  # (1, M)
            scores_t, tanh_t = _scores(products_t, position, cols[:, None], scale, softcap,
                                       slope, SOFTCAP, ALIBI)  # fmt: skip
            visible = _visible(position, cols[:, None], k_lo, k_hi, window, CAUSAL)
            visible = visible & row_ok[None, :]  # (N, M)
            if DOCUMENTS:
                row_docs, _, _ = _document_span(DOCS, batch, stride_db, past + start_m,
                                                k_len, BLOCK_M)  # fmt: skip
                visible = visible & (key_docs[:, None] == row_docs[None, :])
            scores_t = tl.where(visible, scores_t, float("-inf"))
            probs_t = tl.exp2(scores_t - shift[None, :]) * inverse[None, :]  # (N, M)
            grad_value = tl.dot(
                probs_t.to(grad_out.dtype), grad_out, grad_value, input_precision=PRECISION
            )  # (N, D) += Pᵀ dO
            grad_probs_t = tl.dot(v, tl.trans(grad_out), input_precision=PRECISION)  # (N, M)
            grad_scores_t = probs_t * (grad_probs_t - delta[None, :])  # (N, M) softmax VJP
            if SOFTCAP:  # through the cap: d tanh = 1 - tanh²
                grad_scores_t = grad_scores_t * (1.0 - tanh_t * tanh_t)
            grad_key = tl.dot(
                grad_scores_t.to(q.dtype), q, grad_key, input_precision=PRECISION
            )  # (N, D) += dSᵀ Q

    grad_at = batch * stride_gb + kv_head * stride_gh + cols[:, None] * stride_gl + dims[None, :]
    kv_ok = (cols < k_len)[:, None] & dim_ok[None, :]  # (N, D) padding keys get zeros
    tl.store(DK + grad_at, (grad_key * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + grad_at, grad_value.to(DV.dtype.element_ty), mask=kv_ok)


@_jit
def _query_grad_kernel(
    Q, K, V, DO, SHIFT, INVERSE, DELTA, DQ, DOCS, BOUNDS, SLOPES, DSLOPES,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_gb, stride_gh, stride_gl,
    stride_db, stride_sb,
    heads, group, q_len, k_len, window, scale, softcap,
    HEAD_SIZE: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr, PADDED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    SLOPE_GRAD: tl.constexpr,
):  # fmt: skip
    """dQ of one query block of one head; ``DO`` has the strides of ``Q``, ``DQ`` its own.
    With ``SLOPE_GRAD``, also this block's share of the ALiBi slope's gradient, into
    ``DSLOPES`` ``(B, H, query blocks)`` (summed by the caller: no atomics)."""
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // group
    past = k_len - q_len
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    rows = start_m + tl.arange(0, BLOCK_M)  # (M,)
    dims = tl.arange(0, HEAD_BLOCK)  # (D,)
    row_ok = rows < q_len
    dim_ok = dims < HEAD_SIZE
    q_ok = row_ok[:, None] & dim_ok[None, :]  # (M, D)
    q_at = batch * stride_qb + head * stride_qh + rows[:, None] * stride_ql + dims[None, :]
    q = tl.load(Q + q_at, mask=q_ok, other=0.0)  # (M, D); dO shares the query's strides
    grad_out = tl.load(DO + q_at, mask=q_ok, other=0.0)  # (M, D)
    stats = (batch * heads + head) * q_len
    shift, inverse, delta = _row_stats(SHIFT, INVERSE, DELTA, stats, rows, row_ok)  # (M,) each
    k_lo, k_hi = _key_bounds(BOUNDS, batch, k_len, PADDED)
    slope = _slope(SLOPES, batch, head, stride_sb, ALIBI)
    grad_query = tl.zeros([BLOCK_M, HEAD_BLOCK], tl.float32)  # (M, D), per unit of scores
    grad_slope = tl.zeros([BLOCK_M], tl.float32)  # (M,) -sum of dS * distance, per row

    lo, hi = _key_range(start_m, past, k_lo, k_hi, window, BLOCK_M, BLOCK_N, CAUSAL)
    if DOCUMENTS:  # row i is in the document of key past + i; keys outside them are skipped
        row_docs, low, high = _document_span(DOCS, batch, stride_db, past + start_m, k_len,
                                             BLOCK_M)  # fmt: skip
        lo = tl.maximum(lo, low // BLOCK_N * BLOCK_N)
        hi = tl.minimum(hi, high)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # (N,)
        k, v = _key_value_block(
            k_base, v_base, stride_kl, stride_vl, cols, dims, k_lo, k_hi, dim_ok
        )
        products = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N)
        position = past + rows[:, None]  # (M, 1)
        scores, tanh = _scores(products, position, cols[None, :], scale, softcap, slope,
                               SOFTCAP, ALIBI)  # fmt: skip
        visible = _visible(position, cols[None, :], k_lo, k_hi, window, CAUSAL)  # (M, N)
        if DOCUMENTS:
            key_docs, _, _ = _document_span(DOCS, batch, stride_db, start_n, k_len, BLOCK_N)
            visible = visible & (row_docs[:, None] == key_docs[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        probs = tl.exp2(scores - shift[:, None]) * inverse[:, None]  # (M, N), as the forward's
        grad_probs = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)  # (M, N)
        grad_scores = probs * (grad_probs - delta[:, None])  # (M, N)
        if SLOPE_GRAD:  # the bias is -slope * distance
            distance = tl.abs(position - cols[None, :]).to(tl.float32)  # (M, N)
            grad_slope -= tl.sum(grad_scores * distance, 1)
        if SOFTCAP:  # through the cap: d tanh = 1 - tanh²
            grad_scores = grad_scores * (1.0 - tanh * tanh)
        grad_query = tl.dot(
            grad_scores.to(k.dtype), k, grad_query, input_precision=PRECISION
        )  # (M, D) += dS K

    grad_at = batch * stride_gb + head * stride_gh + rows[:, None] * stride_gl + dims[None, :]
    tl.store(DQ + grad_at, (grad_query * scale).to(DQ.dtype.element_ty), mask=q_ok)
    if SLOPE_GRAD:
        blocks = tl.num_programs(0)
        tl.store(DSLOPES + (batch * heads + head) * blocks + tl.program_id(0), tl.sum(grad_slope))


INTERPRETED = triton is not None and not isinstance(_forward_kernel, triton.runtime.JITFunction)


def is_available(device: torch.device | str) -> bool:
    """True when the kernels can run on ``device``: Triton is installed and either the device is
    CUDA or the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    return INTERPRETED or (torch.device(device).type == "cuda" and torch.cuda.is_available())


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and padded head size (up to 64, 128, 256).
# The FlashAttention-2 split: forward and dQ keep a tall query block resident and stream key
# blocks, dK/dV the reverse. Chosen, without a GPU, as the largest tiles that ptxas (Triton 3.9,
# sm_90) compiles with no register spills (a few bytes at most); fp32 runs on FMA units
# ("ieee") and needs smaller ones. Not yet timed on a GPU: tune (or autotune) there.
_HALF_TILES = {
    "forward": {64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)},
    "key_value": {64: (32, 128, 8, 3), 128: (32, 64, 8, 3), 256: (32, 32, 8, 2)},
    "query": {64: (128, 32, 8, 3), 128: (64, 32, 4, 3), 256: (32, 32, 8, 2)},
}
_FLOAT32_TILES = {
    "forward": {64: (64, 32, 8, 2), 128: (32, 16, 8, 2), 256: (32, 16, 8, 2)},
    "key_value": {64: (32, 32, 8, 2), 128: (16, 32, 8, 2), 256: (16, 16, 8, 2)},
    "query": {64: (64, 32, 8, 2), 128: (32, 16, 8, 2), 256: (32, 16, 8, 2)},
}


def _tiles(kind: str, head_block: int, dtype: torch.dtype, q_len: int) -> dict:
    """Block sizes and launch options for one kernel: fixed tables, not autotuned.

    Under the interpreter, 16 x 16 blocks keep tests quick and still cut small inputs into
    several blocks, partial blocks and skipped blocks.
    """
    if INTERPRETED:
        return {"BLOCK_M": 16, "BLOCK_N": 16}
    table = _FLOAT32_TILES if dtype == torch.float32 else _HALF_TILES
    block_m, block_n, warps, stages = table[kind][max(64, head_block)]
    if kind == "forward":  # decoding and short chunks: no 128-row block for one query
        block_m = min(block_m, max(16, triton.next_power_of_2(q_len)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def _sizes(query, key, documents, bounds, slopes, causal, window, scale, softcap) -> dict:
    """The scalar kernel arguments shared by all three kernels."""
    _, heads, q_len, head_size = query.shape
    k_len = key.shape[2]
    return {
        "stride_db": 0 if documents is None else documents.stride(0),
        # Slopes of shape (1, H) serve every batch row.
        "stride_sb": 0 if slopes is None or slopes.shape[0] == 1 else slopes.stride(0),
        "heads": heads,
        "group": heads // key.shape[1],
        "q_len": q_len,
        "k_len": k_len,
        # "No window" as a window longer than any query-key distance (at most k_len - 1).
        "window": window or k_len + 1,
        "scale": scale,
        "softcap": softcap or 1.0,  # read only with SOFTCAP
        "HEAD_SIZE": head_size,
        "HEAD_BLOCK": max(16, triton.next_power_of_2(head_size)),  # tl.dot needs >= 16
        "CAUSAL": causal,
        # fp32 inputs get true fp32 products: TF32, Triton's default for them, would not pass
        # docs/design.md, 'When are two results equal' against an fp32 reference. fp16/bf16 operands
        # keep Triton's default.
        "PRECISION": "ieee" if query.dtype == torch.float32 else None,
        "DOCUMENTS": documents is not None,
        "PADDED": bounds is not None,
        "SOFTCAP": softcap is not None,
        "ALIBI": slopes is not None,
    }


def _strides(*tensors: Tensor) -> list[int]:
    """Batch, head and row strides of each (B, H, L, D) tensor; the last stride is 1."""
    return [stride for tensor in tensors for stride in tensor.stride()[:3]]


def _unit_last(tensor: Tensor) -> Tensor:
    """``tensor`` if its head dimension is contiguous (the kernels assume so), else a copy."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _forward(query, key, value, documents, bounds, slopes, sinks, options):
    """Launch the forward kernel: ``out`` (B, H, Q, D) in the input dtype, and fp32 ``lse``,
    ``shift`` and ``total`` (B, H, Q): each row's base-2 shift and ``sum exp2(score - shift)``
    (0 and 0 for rows that see nothing), which the backward recomputes the probabilities from."""
    batch, heads, q_len, _ = query.shape
    sizes = _sizes(query, key, documents, bounds, slopes, **options)
    tiles = _tiles("forward", sizes["HEAD_BLOCK"], query.dtype, q_len)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # (B, H, Q, D)
    lse = query.new_empty(batch, heads, q_len, dtype=torch.float32)  # (B, H, Q), the caller's
    # The backward's own, in a buffer apart: an in-place change to lse must not touch them.
    shift, total = query.new_empty(2, batch, heads, q_len, dtype=torch.float32)  # (B, H, Q)
    grid = (triton.cdiv(q_len, tiles["BLOCK_M"]), heads, batch)
    _forward_kernel[grid](
        query, key, value, out, lse, shift, total, documents, bounds, slopes, sinks,
        *_strides(query, key, value, out), **sizes, **tiles, SINK=sinks is not None,
    )  # fmt: skip
    return out, lse, shift, total


def _backward(query, key, value, out, shift, inverse, grad_out, documents, bounds, slopes,
              slope_grad, options):  # fmt: skip
    """Launch the two gradient kernels: ``dq`` (B, H, Q, D), ``dk``/``dv`` (B, Hkv, K, D),
    the slopes' gradient ``(B, H)`` if ``slope_grad`` (else None), and ``delta`` (B, H, Q).
    ``shift`` and ``inverse = 1 / total`` (B, H, Q) are the forward's row statistics."""
    batch, heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    # The kernels read dO with the query's strides; a query with another layout is copied.
    if query.stride() != grad_out.stride():
        query, grad_out = query.contiguous(), grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # (B, H, Q) rowsum(dO * O)
    sizes = _sizes(query, key, documents, bounds, slopes, **options)
    pointers = (shift, inverse, delta)
    grad_query = torch.empty_like(query, memory_format=torch.contiguous_format)
    grad_key = torch.empty_like(key, memory_format=torch.contiguous_format)
    grad_value = torch.empty_like(value, memory_format=torch.contiguous_format)

    tiles = _tiles("key_value", sizes["HEAD_BLOCK"], query.dtype, q_len)
    grid = (triton.cdiv(k_len, tiles["BLOCK_N"]), kv_heads, batch)
    _key_value_grad_kernel[grid](
        query, key, value, grad_out, *pointers, grad_key, grad_value, documents, bounds, slopes,
        *_strides(query, key, value, grad_key), **sizes, **tiles,
    )  # fmt: skip
    tiles = _tiles("query", sizes["HEAD_BLOCK"], query.dtype, q_len)
    grid = (triton.cdiv(q_len, tiles["BLOCK_M"]), heads, batch)
    # One partial sum per query block, added up here: deterministic, no atomics.
    grad_slopes = delta.new_empty(batch, heads, grid[0]) if slope_grad else None  # (B, H, blocks)
    _query_grad_kernel[grid](
        query, key, value, grad_out, *pointers, grad_query, documents, bounds, slopes,
        grad_slopes, *_strides(query, key, value, grad_query), **sizes, **tiles,
        SLOPE_GRAD=slope_grad,
    )  # fmt: skip
    grad_slopes = None if grad_slopes is None else grad_slopes.sum(dim=-1)  # (B, H)
    return grad_query, grad_key, grad_value, grad_slopes, delta


class _TritonAttention(torch.autograd.Function):
    """Autograd through the kernels; saves query, key, value, output and each row's shift and
    sum, and the structure and modifier tensors given."""

    @staticmethod
    def forward(ctx, query, key, value, documents, bounds, alibi_slopes, sinks, options):
        heads = query.shape[1]
        slopes = None  # (1 or B, H) fp32, as the kernels read them
        if alibi_slopes is not None:
            slopes = alibi_slopes.detach().float().reshape(-1, heads).contiguous()
        sink_logits = None if sinks is None else sinks.detach().float().contiguous()  # (H,)
        out, lse, shift, total = _forward(
            query, key, value, documents, bounds, slopes, sink_logits, options
        )  # fmt: skip
        ctx.save_for_backward(
            query, key, value, out, shift, total, documents, bounds, slopes, sink_logits
        )  # fmt: skip
        ctx.options = options
        ctx.modifiers = [None if x is None else (x.shape, x.dtype) for x in (alibi_slopes, sinks)]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, shift, total, documents, bounds, slopes, sinks = ctx.saved_tensors
        slope_grad = ctx.needs_input_grad[5]
        inverse = torch.where(total > 0, 1.0 / total, 0.0)  # (B, H, Q), 0 where nothing is seen
        grad_query, grad_key, grad_value, grad_slopes, delta = _backward(
            query, key, value, out, shift, inverse, _unit_last(grad_out), documents, bounds,
            slopes, slope_grad, ctx.options,
        )  # fmt: skip
        if grad_slopes is not None:  # (B, H) -> the slopes' (H,) or (B, H)
            shape, dtype = ctx.modifiers[0]
            grad_slopes = grad_slopes.sum_to_size(slopes.shape).view(shape).to(dtype)
        grad_sinks = None
        if ctx.needs_input_grad[6]:
            grad_sinks = _sink_gradient(sinks, shift, inverse, delta).to(ctx.modifiers[1][1])
        return grad_query, grad_key, grad_value, None, None, grad_slopes, grad_sinks, None


def _sink_gradient(sinks: Tensor, shift: Tensor, inverse: Tensor, delta: Tensor) -> Tensor:
    """d loss / d sinks ``(H,)``: a sink takes ``p = exp2(sink - shift) / total`` of each row's
    mass (in the forward's base-2 units) and gives no value, so ``d out / d sink = -p * out``
    and the gradient is ``-sum p * delta``. A -inf sink takes nothing (exp2(-inf) = 0)."""
    logits = sinks.view(1, -1, 1) * LOG2E  # (1, H, 1), as the forward kernel scales them
    taken = torch.exp2(logits - shift) * inverse  # (B, H, Q)
    return -(taken * delta).sum(dim=(0, 2))


def _document_spans(document_ids: Tensor) -> Tensor:
    """Each key's document as the kernels read it, int32 ``(B, 2, K)``: ``[b, 0, j]`` the first
    position of key j's id in row b (two keys share a document iff they share it), ``[b, 1, j]``
    one past its last. Any ids, sorted or not, in a few sync-free passes (no ``unique``)."""
    batch, k_len = document_ids.shape
    order = document_ids.argsort(dim=1, stable=True)  # (B, K) positions by id, then position
    ids = document_ids.gather(1, order)  # (B, K) sorted
    index = torch.arange(k_len, device=ids.device).expand(batch, k_len)  # (B, K)
    starts = torch.ones_like(ids, dtype=torch.bool)  # (B, K) where a run of one id begins
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    ends = torch.ones_like(starts)  # (B, K) where it ends
    ends[:, :-1] = starts[:, 1:]
    run_start = torch.where(starts, index, 0).cummax(dim=1).values  # (B, K)
    run_end = torch.where(ends, index, k_len).flip(1).cummin(dim=1).values.flip(1)  # (B, K)
    spans = torch.stack([order.gather(1, run_start), order.gather(1, run_end) + 1], dim=1).int()
    return torch.empty_like(spans).scatter_(2, order.unsqueeze(1).expand(-1, 2, -1), spans)


def _padding_bounds(query: Tensor, k_len: int, key_starts, key_lengths) -> Tensor | None:
    """Keys ``[start, end)`` of each batch row that are not padding, int32 ``(B, 2)``."""
    if key_starts is None and key_lengths is None:
        return None
    batch = query.shape[0]
    starts = torch.zeros(batch, device=query.device) if key_starts is None else key_starts
    ends = torch.full((batch,), k_len, device=query.device) if key_lengths is None else key_lengths
    return torch.stack([starts.to(torch.int32), ends.to(torch.int32)], dim=1)  # (B, 2)


@keyword_only
def triton_attention(
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
    key_starts: Tensor | None = None,
    document_ids: Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention by FlashAttention-2 Triton kernels, differentiable.

    Args:
        query: ``(batch, heads, q_len, head_size)``, float16, bfloat16 or float32, on CUDA (or
            any device under ``TRITON_INTERPRET=1``); ``head_size <= 256``.
        key, value: ``(batch, kv_heads, k_len, head_size)``; query head ``h`` reads key/value
            head ``h // (heads // kv_heads)``.
        causal: bottom-right aligned: row ``i`` sees key ``j`` iff ``j <= k_len - q_len + i``.
        window: if > 0, a row also sees only the ``window`` most recent keys (itself included).
        mask: not supported; must be None (use ``tiled_attention`` for it).
        scale: score scale, ``1 / sqrt(head_size)`` by default.
        dropout_p: must be 0; these kernels have no dropout.
        key_lengths, key_starts: int ``(batch,)``: keys at and after ``key_lengths[b]``, and
            before ``key_starts[b]``, are padding; key blocks wholly outside are skipped.
        document_ids: int ``(batch, k_len)``: row ``i`` is in the document of key ``k_len -
            q_len + i`` and sees only keys of its own document. Block pairs whose id ranges
            do not meet are skipped; the others are masked element-wise.
        softcap, alibi_slopes, sinks: the score modifiers of ``tiled_attention``, per tile in
            forward and backward; slopes and sinks that require grad receive their gradients.
        return_lse: also return the fp32 log-sum-exp of the scaled scores, ``(batch, heads,
            q_len)``, ``-inf`` for rows that see no key (the sink's logit with sinks). It
            carries no gradient: a loss that uses it gets none through it.

    Returns:
        The output in the input dtype (rows that see no key are zero), or ``(out, lse)``.
        Gradients are deterministic: no atomics, GQA groups summed in a fixed order.
    """
    return triton_call(check(call_of(locals()), dropout=False), return_lse=return_lse)


def triton_call(call: Call, *, return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`triton_attention` of a checked call."""
    mask = call.mask
    if mask is not None:
        raise ValueError(
            "triton_attention supports no mask (got a tensor); use tiled_attention for it"
        )
    query, key, value = call.query, call.key, call.value
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"triton_attention takes float16, bfloat16 or float32 inputs, got {query.dtype}"
        )
    if INTERPRETED and query.dtype == torch.bfloat16:
        raise TypeError(
            "Triton's CPU interpreter (TRITON_INTERPRET=1) computes bfloat16 wrongly; use "
            "float16 or float32 there, or a GPU"
        )
    if call.head_size > MAX_HEAD_SIZE:
        raise ValueError(
            f"triton_attention takes head_size <= {MAX_HEAD_SIZE}, got {call.head_size}"
        )
    if not is_available(query.device):
        raise ValueError(
            f"triton_attention cannot run on {query.device}: it needs Triton "
            "(pip install octlm[triton]) and a CUDA device, or TRITON_INTERPRET=1 set before "
            "Triton is first imported"
        )
    query, key, value = _unit_last(query), _unit_last(key), _unit_last(value)
    bounds = _padding_bounds(query, call.k_len, call.key_starts, call.key_lengths)
    documents = None if call.document_ids is None else _document_spans(call.document_ids)
    options = dict(causal=call.causal, window=call.window, scale=call.scale, softcap=call.softcap)
    out, lse = _TritonAttention.apply(
        query, key, value, documents, bounds, call.alibi_slopes, call.sinks, options
    )  # fmt: skip
    return (out, lse) if return_lse else out
