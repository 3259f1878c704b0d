"""FlashAttention-2 as Triton kernels: forward, and a deterministic recomputing backward.

The same algorithm and semantics as :mod:`octlm.attention.tiled` (docs/design.md §2),
compiled for the GPU: GQA (query head ``h`` reads key/value head ``h // (H // Hkv)``),
bottom-right causal alignment, a sliding window, any lengths, head sizes up to 256 (padded
inside the kernels to a power of two, at least 16, with masked loads), float16, bfloat16 and
float32 inputs with fp32 accumulation, zeros (never NaN) for rows that see no key and an fp32
log-sum-exp.

Three kernels, one program per tile, no atomics:

- forward: one program per (query block, head, batch) walks the key blocks its rows may see,
  carrying ``running_max``/``running_sum`` (online softmax, base 2), and writes the output and
  the fp32 log-sum-exp.
- key/value gradients: one program per (key block, kv head, batch) walks every query head of
  its GQA group and every query block that may see it, recomputing the probabilities as
  ``exp(scores - lse)``; the group's sum happens in registers, in a fixed order.
- query gradient: one program per (query block, head, batch) walks the key blocks again.

``delta = rowsum(dO * O)`` is computed once beforehand, in PyTorch. Key blocks that the causal or
window rule hides from a whole query block (and vice versa) are never visited.

Triton is optional (``octlm[triton]``): without it this module still imports and
:func:`is_available` says False. With it, importing this module imports Triton (about 0.3 s)
and builds the kernels, so callers import it when they first need it. For the kernels to run
on CPU tensors, ``TRITON_INTERPRET=1`` must be set before Triton is first imported in the
process (tests do that); the interpreter computes bfloat16 wrongly, so it is refused there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octlm.attention.inputs import COMMON, Call, attention_function

try:
    import triton
    import triton.language as tl
except ImportError:  # octlm[triton] not installed
    triton = None

MAX_HEAD_SIZE = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _jit(fn):
    """``triton.jit``, or the plain function when Triton is missing (never launched then)."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _visible(position, key, k_len, window, CAUSAL: tl.constexpr):
    """Where a query at ``position`` may see ``key`` (broadcast shapes): docs/design.md §2."""
    seen = (key < k_len) & (position - key < window)
    if CAUSAL:
        seen = seen & (key <= position)
    return seen


@_jit
def _key_range(start_m, past, k_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):  # fmt: skip
    """Keys ``[lo, hi)`` that rows ``start_m .. start_m + BLOCK_M - 1`` may see; lo on a block."""
    lo = tl.maximum(past + start_m - window + 1, 0) // BLOCK_N * BLOCK_N  # first row's window
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(past + start_m + BLOCK_M, k_len)  # the last row sees up to here
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
def _row_stats(LSE, DELTA, offset, rows, row_ok):
    """A block's base-2 log-sum-exp and delta ``(M,)``, as the backward kernels need them.

    Rows that see no key have lse = -inf; every score of theirs is masked to -inf, so any
    finite shift (0) gives probability 0 where -inf would give NaN.
    """
    lse = tl.load(LSE + offset + rows, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634  # log2(e)
    delta = tl.load(DELTA + offset + rows, mask=row_ok, other=0.0)
    return lse, delta


@_jit
def _key_value_block(k_base, v_base, stride_kl, stride_vl, cols, dims, k_len, dim_ok):
    """Key and value rows ``cols`` of one head, ``(N, D)`` each (zeros past ``k_len`` and in
    the head-size padding), and where they are real."""
    kv_ok = (cols < k_len)[:, None] & dim_ok[None, :]  # (N, D)
    k = tl.load(k_base + cols[:, None] * stride_kl + dims[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_base + cols[:, None] * stride_vl + dims[None, :], mask=kv_ok, other=0.0)
    return k, v, kv_ok


@_jit
def _forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_ol,
    heads, group, q_len, k_len, window, scale,
    HEAD_SIZE: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Output and log-sum-exp of one query block of one head."""
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
    qk_scale = scale * 1.4426950408889634  # scores in base 2: exp2 is the native instruction
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # (M,)
    running_sum = tl.zeros([BLOCK_M], tl.float32)  # (M,) sum of exp2(score - running_max)
    acc = tl.zeros([BLOCK_M, HEAD_BLOCK], tl.float32)  # (M, D) unnormalised output

    lo, hi = _key_range(start_m, past, k_len, window, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # (N,) keys
        k, v, _ = _key_value_block(k_base, v_base, stride_kl, stride_vl, cols, dims, k_len, dim_ok)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (M, N)
        visible = _visible(past + rows[:, None], cols[None, :], k_len, window, CAUSAL)
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

    seen = running_sum > 0  # (M,) False for rows that see no key
    total = tl.where(seen, running_sum, 1.0)  # (M,)
    out = acc / total[:, None]  # (M, D), zeros where unseen
    lse = tl.where(seen, (running_max + tl.log2(total)) * 0.6931471805599453, float("-inf"))
    o_at = rows[:, None] * stride_ol + dims[None, :]  # (M, D)
    tl.store(o_base + o_at, out.to(O.dtype.element_ty), mask=q_ok)
    tl.store(LSE + (batch * heads + head) * q_len + rows, lse, mask=rows < q_len)  # ln, not log2


@_jit
def _key_value_grad_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_gb, stride_gh, stride_gl,
    heads, group, q_len, k_len, window, scale,
    HEAD_SIZE: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key block of one kv head, summed over its GQA group in fixed order.

    ``DO`` has the strides of ``Q`` (the wrapper makes sure); ``DK``/``DV`` share the strides
    ``stride_g*``. Tiles are transposed (keys by rows) so that both gradients come straight out
    of a matmul.
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
    k, v, kv_ok = _key_value_block(k_base, v_base, stride_kl, stride_vl, cols, dims, k_len, dim_ok)
    qk_scale = scale * 1.4426950408889634
    grad_key = tl.zeros([BLOCK_N, HEAD_BLOCK], tl.float32)  # (N, D), per unit of scores
    grad_value = tl.zeros([BLOCK_N, HEAD_BLOCK], tl.float32)  # (N, D)

    lo, hi = _query_range(start_n, past, q_len, window, BLOCK_M, BLOCK_N, CAUSAL)
    for member in range(group):  # the query heads that read this kv head
        head = kv_head * group + member
        q_base = Q + batch * stride_qb + head * stride_qh
        do_base = DO + batch * stride_qb + head * stride_qh
        stats = (batch * heads + head) * q_len  # where this head's rows start in LSE, DELTA
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)  # (M,) query rows
            row_ok = rows < q_len
            q_ok = row_ok[:, None] & dim_ok[None, :]  # (M, D)
            q_at = rows[:, None] * stride_ql + dims[None, :]  # (M, D) offsets, also for dO
            q = tl.load(q_base + q_at, mask=q_ok, other=0.0)  # (M, D)
            grad_out = tl.load(do_base + q_at, mask=q_ok, other=0.0)  # (M, D)
            lse, delta = _row_stats(LSE, DELTA, stats, rows, row_ok)  # (M,), (M,)
            scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (N, M)
            visible = _visible(past + rows[None, :], cols[:, None], k_len, window, CAUSAL)
            scores_t = tl.where(visible & row_ok[None, :], scores_t, float("-inf"))
            probs_t = tl.exp2(scores_t - lse[None, :])  # (N, M), the forward's weights
            grad_value = tl.dot(
                probs_t.to(grad_out.dtype), grad_out, grad_value, input_precision=PRECISION
            )  # (N, D) += Pᵀ dO
            grad_probs_t = tl.dot(v, tl.trans(grad_out), input_precision=PRECISION)  # (N, M)
            grad_scores_t = probs_t * (grad_probs_t - delta[None, :])  # (N, M) softmax VJP
            grad_key = tl.dot(
                grad_scores_t.to(q.dtype), q, grad_key, input_precision=PRECISION
            )  # (N, D) += dSᵀ Q

    grad_at = batch * stride_gb + kv_head * stride_gh + cols[:, None] * stride_gl + dims[None, :]
    tl.store(DK + grad_at, (grad_key * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + grad_at, grad_value.to(DV.dtype.element_ty), mask=kv_ok)


@_jit
def _query_grad_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_gb, stride_gh, stride_gl,
    heads, group, q_len, k_len, window, scale,
    HEAD_SIZE: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ of one query block of one head; ``DO`` has the strides of ``Q``, ``DQ`` its own."""
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
    lse, delta = _row_stats(LSE, DELTA, (batch * heads + head) * q_len, rows, row_ok)
    qk_scale = scale * 1.4426950408889634
    grad_query = tl.zeros([BLOCK_M, HEAD_BLOCK], tl.float32)  # (M, D), per unit of scores

    lo, hi = _key_range(start_m, past, k_len, window, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # (N,)
        k, v, _ = _key_value_block(k_base, v_base, stride_kl, stride_vl, cols, dims, k_len, dim_ok)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (M, N)
        visible = _visible(past + rows[:, None], cols[None, :], k_len, window, CAUSAL)
        probs = tl.exp2(tl.where(visible, scores, float("-inf")) - lse[:, None])  # (M, N)
        grad_probs = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)  # (M, N)
        grad_scores = probs * (grad_probs - delta[:, None])  # (M, N)
        grad_query = tl.dot(
            grad_scores.to(k.dtype), k, grad_query, input_precision=PRECISION
        )  # (M, D) += dS K

    grad_at = batch * stride_gb + head * stride_gh + rows[:, None] * stride_gl + dims[None, :]
    tl.store(DQ + grad_at, (grad_query * scale).to(DQ.dtype.element_ty), mask=q_ok)


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


def _sizes(query: Tensor, key: Tensor, causal: bool, window: int, scale: float) -> dict:
    """The scalar kernel arguments shared by all three kernels, in their order."""
    _, heads, q_len, head_size = query.shape
    k_len = key.shape[2]
    return {
        "heads": heads,
        "group": heads // key.shape[1],
        "q_len": q_len,
        "k_len": k_len,
        # "No window" as a window longer than any query-key distance (at most k_len - 1).
        "window": window or k_len + 1,
        "scale": scale,
        "HEAD_SIZE": head_size,
        "HEAD_BLOCK": max(16, triton.next_power_of_2(head_size)),  # tl.dot needs >= 16
        "CAUSAL": causal,
        # fp32 inputs get true fp32 products: TF32, Triton's default for them, would not pass
        # docs/design.md §4 against an fp32 reference. fp16/bf16 operands keep Triton's default.
        "PRECISION": "ieee" if query.dtype == torch.float32 else None,
    }


def _strides(*tensors: Tensor) -> list[int]:
    """Batch, head and row strides of each (B, H, L, D) tensor; the last stride is 1."""
    return [stride for tensor in tensors for stride in tensor.stride()[:3]]


def _unit_last(tensor: Tensor) -> Tensor:
    """``tensor`` if its head dimension is contiguous (the kernels assume so), else a copy."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _forward(query, key, value, causal, window, scale) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: ``out`` (B, H, Q, D) in the input dtype, ``lse`` fp32."""
    batch, heads, q_len, _ = query.shape
    sizes = _sizes(query, key, causal, window, scale)
    tiles = _tiles("forward", sizes["HEAD_BLOCK"], query.dtype, q_len)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # (B, H, Q, D)
    lse = query.new_empty(batch, heads, q_len, dtype=torch.float32)  # (B, H, Q)
    grid = (triton.cdiv(q_len, tiles["BLOCK_M"]), heads, batch)
    _forward_kernel[grid](
        query, key, value, out, lse, *_strides(query, key, value, out), **sizes, **tiles
    )
    return out, lse


def _backward(query, key, value, out, lse, grad_out, causal, window, scale):
    """Launch the two gradient kernels: ``dq`` (B, H, Q, D), ``dk``/``dv`` (B, Hkv, K, D)."""
    batch, heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    # The kernels read dO with the query's strides; a query with another layout is copied.
    if query.stride() != grad_out.stride():
        query, grad_out = query.contiguous(), grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # (B, H, Q) rowsum(dO * O)
    sizes = _sizes(query, key, causal, window, scale)
    grad_query = torch.empty_like(query, memory_format=torch.contiguous_format)
    grad_key = torch.empty_like(key, memory_format=torch.contiguous_format)
    grad_value = torch.empty_like(value, memory_format=torch.contiguous_format)

    tiles = _tiles("key_value", sizes["HEAD_BLOCK"], query.dtype, q_len)
    grid = (triton.cdiv(k_len, tiles["BLOCK_N"]), kv_heads, batch)
    _key_value_grad_kernel[grid](
        query, key, value, grad_out, lse, delta, grad_key, grad_value,
        *_strides(query, key, value, grad_key), **sizes, **tiles,
    )  # fmt: skip
    tiles = _tiles("query", sizes["HEAD_BLOCK"], query.dtype, q_len)
    grid = (triton.cdiv(q_len, tiles["BLOCK_M"]), heads, batch)
    _query_grad_kernel[grid](
        query, key, value, grad_out, lse, delta, grad_query,
        *_strides(query, key, value, grad_query), **sizes, **tiles,
    )  # fmt: skip
    return grad_query, grad_key, grad_value


class _TritonAttention(torch.autograd.Function):
    """Autograd through the kernels; saves query, key, value, output and lse only."""

    @staticmethod
    def forward(ctx, query, key, value, causal, window, scale):
        out, lse = _forward(query, key, value, causal, window, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.options = (causal, window, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        grads = _backward(query, key, value, out, lse, _unit_last(grad_out), *ctx.options)
        return (*grads, None, None, None)


@attention_function(dropout=False, keywords=COMMON)
def triton_attention(call: Call, *, return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention by FlashAttention-2 Triton kernels, differentiable.

    Args:
        query: ``(batch, heads, q_len, head_size)``, float16, bfloat16 or float32, on CUDA (or
            any device under ``TRITON_INTERPRET=1``); ``head_size <= 256``.
        key, value: ``(batch, kv_heads, k_len, head_size)``; query head ``h`` reads key/value
            head ``h // (heads // kv_heads)``.
        causal: bottom-right aligned: row ``i`` sees key ``j`` iff ``j <= k_len - q_len + i``.
        window: if > 0, a row also sees only the ``window`` most recent keys (itself included).
        mask, key_lengths: not supported; must be None (use ``tiled_attention`` for them).
        scale: score scale, ``1 / sqrt(head_size)`` by default.
        dropout_p: must be 0; these kernels have no dropout.
        return_lse: also return the fp32 log-sum-exp of the scaled scores, ``(batch, heads,
            q_len)``, ``-inf`` for rows that see no key.

    Returns:
        The output in the input dtype (rows that see no key are zero), or ``(out, lse)``.
        Gradients are deterministic: no atomics, GQA groups summed in a fixed order.
    """
    mask, key_lengths = call.mask, call.key_lengths
    if mask is not None or key_lengths is not None:
        raise ValueError(
            "triton_attention supports no mask or key_lengths (got "
            f"mask={'a tensor' if mask is not None else None}, key_lengths="
            f"{'a tensor' if key_lengths is not None else None}); use tiled_attention for them"
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
    out, lse = _TritonAttention.apply(query, key, value, call.causal, call.window, call.scale)
    return (out, lse) if return_lse else out
