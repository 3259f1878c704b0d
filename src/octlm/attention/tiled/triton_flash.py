"""FlashAttention-2 as Triton kernels: forward, and a deterministic recomputing backward.

The same algorithm and semantics as :mod:`octlm.attention.tiled` (docs/design.md, 'Tensor
conventions'), compiled for the GPU: GQA (query head ``h`` reads key/value head ``h // (H //
Hkv)``), bottom-right causal alignment, a sliding window, left and right padding (``key_starts``,
``key_lengths``), packed documents (``document_ids``), the score modifiers ``softcap`` and
``alibi_slopes`` and learnable ``sinks``, any lengths, head sizes up to 256 (padded inside the
kernels to a power of two, at least 16, with masked loads), float16, bfloat16 and float32 inputs
with fp32 accumulation, zeros (never NaN) for rows that see no key and an fp32 log-sum-exp. Only
``mask`` and ``block_mask`` are left to the PyTorch blocks.

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
from octlm.attention.tiled.triton_kernels import (
    _forward_kernel,
    _key_value_grad_kernel,
    _query_grad_kernel,
    triton,
)

# The call keywords triton_attention takes: all but ``block_mask`` (and a ``mask`` is refused).
TRITON_KEYWORDS = (*COMMON, "key_starts", "document_ids", "softcap", "alibi_slopes", "sinks")
MAX_HEAD_SIZE = 256
LOG2E = 1.4426950408889634  # log2(e): the kernels keep scores in base 2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
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
