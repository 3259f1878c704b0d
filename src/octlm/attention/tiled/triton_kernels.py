"""The Triton kernels of :mod:`octlm.attention.tiled.triton_flash`, which launches them.

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

Without Triton (``octlm[triton]`` not installed) the kernels stay plain functions, never
launched.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # octlm[triton] not installed
    triton = None
    tl = None


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
def _row_keys(
    DOCS, batch, stride_db, start_m, past, k_lo, k_hi, k_len, window, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr,
):  # fmt: skip
    """:func:`_key_range` of rows ``start_m ..``, narrowed with ``DOCUMENTS`` to the span of
    the rows' documents (row ``i`` is in the document of key ``past + i``); and those documents
    ``(BLOCK_M,)``, zeros without ``DOCUMENTS``."""
    lo, hi = _key_range(start_m, past, k_lo, k_hi, window, BLOCK_M, BLOCK_N, CAUSAL)
    row_docs = tl.zeros([BLOCK_M], tl.int32)
    if DOCUMENTS:
        row_docs, low, high = _document_span(DOCS, batch, stride_db, past + start_m, k_len,
                                             BLOCK_M)  # fmt: skip
        lo = tl.maximum(lo, low // BLOCK_N * BLOCK_N)
        hi = tl.minimum(hi, high)
    return lo, hi, row_docs


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
def _row_tile(
    q, k_base, v_base, stride_kl, stride_vl, start_n, rows, dims, dim_ok, past, k_lo, k_hi, k_len,
    window, scale, softcap, slope, DOCS, batch, stride_db, row_docs, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):  # fmt: skip
    """The key block at ``start_n`` for query rows ``rows``: its keys ``(N,)``, key and value
    rows ``(N, D)``, and the rows' base-2 scores ``(M, N)``, -inf where a row may not see a key,
    with their tanh. One function for the forward and the query gradient, so that the backward
    forms each score as the forward did."""
    cols = start_n + tl.arange(0, BLOCK_N)  # (N,) keys
    k, v = _key_value_block(k_base, v_base, stride_kl, stride_vl, cols, dims, k_lo, k_hi, dim_ok)
    products = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N)
    position = past + rows[:, None]  # (M, 1)
    scores, tanh = _scores(products, position, cols[None, :], scale, softcap, slope,
                           SOFTCAP, ALIBI)  # fmt: skip
    visible = _visible(position, cols[None, :], k_lo, k_hi, window, CAUSAL)  # (M, N)
    if DOCUMENTS:
        key_docs, _, _ = _document_span(DOCS, batch, stride_db, start_n, k_len, BLOCK_N)
        visible = visible & (row_docs[:, None] == key_docs[None, :])
    return cols, k, v, tl.where(visible, scores, float("-inf")), tanh


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

    lo, hi, row_docs = _row_keys(DOCS, batch, stride_db, start_m, past, k_lo, k_hi, k_len,
                                 window, BLOCK_M, BLOCK_N, CAUSAL, DOCUMENTS)  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        _, _, v, scores, _ = _row_tile(
            q, k_base, v_base, stride_kl, stride_vl, start_n, rows, dims, dim_ok, past, k_lo, k_hi,
            k_len, window, scale, softcap, slope, DOCS, batch, stride_db, row_docs, BLOCK_N,
            CAUSAL, PRECISION, DOCUMENTS, SOFTCAP, ALIBI,
        )  # fmt: skip
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

    lo, hi, row_docs = _row_keys(DOCS, batch, stride_db, start_m, past, k_lo, k_hi, k_len,
                                 window, BLOCK_M, BLOCK_N, CAUSAL, DOCUMENTS)  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        cols, k, v, scores, tanh = _row_tile(
            q, k_base, v_base, stride_kl, stride_vl, start_n, rows, dims, dim_ok, past, k_lo, k_hi,
            k_len, window, scale, softcap, slope, DOCS, batch, stride_db, row_docs, BLOCK_N,
            CAUSAL, PRECISION, DOCUMENTS, SOFTCAP, ALIBI,
        )  # fmt: skip
        probs = tl.exp2(scores - shift[:, None]) * inverse[:, None]  # (M, N), as the forward's
        grad_probs = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)  # (M, N)
        grad_scores = probs * (grad_probs - delta[:, None])  # (M, N)
        if SLOPE_GRAD:  # the bias is -slope * distance
            distance = tl.abs(past + rows[:, None] - cols[None, :]).to(tl.float32)  # (M, N)
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
