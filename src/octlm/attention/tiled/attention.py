"""Tiled attention: the block engine of :mod:`octlm.attention.tiled` behind autograd.

FlashAttention's blocking in plain PyTorch: exact attention with O(T) memory on any device PyTorch
runs on, differentiable through its own recomputing backward (FlashAttention-2). The forward saves
only query, key, value, output and two numbers per query row (the shift and the sum of the online
softmax, from which the log-sum-exp follows), plus the caller's own mask, key bounds or document
ids; the backward recomputes each block's probabilities from them. For CUDA tensors
``kernel="auto"`` takes the Triton kernel instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from octlm.attention.inputs import Call, call_of, check, keyword_only
from octlm.attention.tiled.core import (
    RowStats,
    Rules,
    delta_error,
    sink_gradient,
    sink_share,
    slope_gradient,
    unfold_heads,
)
from octlm.attention.tiled.engine import attend_backward, forward_rows
from octlm.attention.tiled.options import DEFAULT_BLOCK, KERNELS, parse_block

if TYPE_CHECKING:
    from octlm.attention.block_masks import BlockMask


class _TiledAttention(torch.autograd.Function):
    """Autograd through the block steps; saves query, key, value, output and the per-row shift
    and sum of the online softmax (docs/design.md, 'The numerics of the tiled core'). The
    caller's tensors (``OPTIONAL_TENSORS``) come in one by one, so that autograd sees them, and
    join the tensor-free ``rules`` here."""

    @staticmethod
    def forward(
        ctx,
        query,
        key,
        value,
        mask,
        key_lengths,
        key_starts,
        document_ids,
        alibi_slopes,
        sinks,
        rules,
    ):
        tensors = mask, key_lengths, key_starts, document_ids, alibi_slopes, sinks
        out, rows = _forward(query, key, value, tensors, rules)
        ctx.save_for_backward(query, key, value, out, rows.shift, rows.total, *tensors)
        ctx.rules, ctx.units, ctx.careful = rules, rows.units, rows.careful
        ctx.tiles = rows.rebased, rows.shift_column, rows.whole  # the tiles formed as before
        lse = rows.lse()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, shift, total, *tensors = ctx.saved_tensors
        mask, _, _, _, alibi_slopes, sinks = tensors
        delta = (grad_out.to(shift.dtype) * out.to(shift.dtype)).sum(dim=-1)  # (B, H, Q)
        batch, heads, q_len, _ = query.shape
        kv_heads, group, k_len = key.shape[1], heads // key.shape[1], key.shape[2]
        grad_mask = None
        if mask is not None and ctx.needs_input_grad[3]:
            grad_mask = shift.new_zeros(batch, kv_heads, q_len, group, k_len)
        moments = None  # each row's, for the slopes' gradient (core.slope_moments)
        if alibi_slopes is not None and ctx.needs_input_grad[7]:
            moments = shift.new_zeros(batch, heads, q_len, 4, dtype=torch.float64)
        want_sinks = sinks is not None and ctx.needs_input_grad[8]
        residue = None  # what the rounded delta leaves in each row's ds, for the sinks
        if want_sinks:
            residue = shift.new_zeros(batch, kv_heads, q_len, group, dtype=torch.float64)
        rows = RowStats(shift, total, ctx.units, ctx.careful, *ctx.tiles)
        grad_query, grad_key, grad_value = attend_backward(
            query,
            key,
            value,
            grad_out,
            rows,
            delta,
            _rules_with(ctx.rules, *tensors),
            grad_mask=grad_mask,
            residue=residue,
            moments=moments,
        )
        if grad_mask is not None:
            full = (1,) * (4 - mask.dim()) + tuple(mask.shape)
            grad_mask = unfold_heads(grad_mask).sum_to_size(full).view(mask.shape).to(mask.dtype)
        grad_alibi = None
        if moments is not None:  # natural units (Units.choose): exp(sink - shift) as it is
            sink = None if sinks is None else (sinks.double().view(1, -1, 1) - shift).exp()
            grad_alibi = slope_gradient(moments, alibi_slopes, sink)
        grad_sinks = None
        if want_sinks:
            share = sink_share(rows, sinks)  # (B, H, Q)
            error = delta_error(residue, delta, share)
            grad_sinks = sink_gradient(share, delta.double() + error).to(sinks.dtype)
        return (
            grad_query.to(query.dtype),
            grad_key.to(key.dtype),
            grad_value.to(value.dtype),
            grad_mask,
            None,
            None,
            None,
            grad_alibi,
            grad_sinks,
            None,
        )


def _forward(query, key, value, tensors, rules) -> tuple[Tensor, RowStats]:
    """The block steps' output, in the input dtype, and their row statistics."""
    out, rows = forward_rows(query, key, value, _rules_with(rules, *tensors))
    return out.to(query.dtype), rows


def _rules_with(rules, mask, key_lengths, key_starts, document_ids, alibi_slopes, sinks) -> Rules:
    """``rules`` with the caller's tensors; row ``i`` is in the document of key ``past + i``."""
    documents = None if document_ids is None else (document_ids[:, rules.past :], document_ids)
    return replace(
        rules,
        mask=mask,
        key_lengths=key_lengths,
        key_starts=key_starts,
        documents=documents,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )


@keyword_only
def tiled_attention(
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
    block_mask: BlockMask | None = None,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    return_lse: bool = False,
    kernel: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention with O(T) memory, by FlashAttention's blocking, on any PyTorch device.

    Args:
        query: ``(batch, heads, q_len, head_size)``.
        key, value: ``(batch, kv_heads, k_len, head_size)``; ``heads % kv_heads == 0`` and
            query head ``h`` reads key/value head ``h // (heads // kv_heads)``.
        block: ``(block_q, block_k)`` query rows and keys per tile, or one int for both. A
            performance choice, not a numerical one: the output changes only by rounding.
            On CPU with several threads, query blocks are cut smaller (down to 128 rows) so
            that every thread gets many (docs/design.md, 'The numerics of the tiled core').
        causal: bottom-right aligned: row ``i`` sees key ``j`` iff ``j <= k_len - q_len + i``.
        window: if > 0, a row also sees only the ``window`` most recent keys (itself included).
        mask: bool (True = may attend) or float (added to the scaled scores), broadcastable
            to ``(batch, heads, q_len, k_len)``; combined with causal/window by AND. A float
            mask that requires grad receives its gradient.
        scale: score scale, ``1 / sqrt(head_size)`` by default.
        dropout_p: must be 0; the tiled path has no attention dropout (use naive or sdpa).
        key_lengths: int ``(batch,)``: keys at and after ``key_lengths[b]`` are padding.
            Blocks past the longest length are skipped whole.
        key_starts: int ``(batch,)``: keys before ``key_starts[b]`` are padding (left
            padding). Blocks before the earliest start are skipped whole.
        document_ids: int ``(batch, k_len)``, the document of each key (packed sequences).
            Query row ``i`` is in the document of key ``k_len - q_len + i`` (so ``q_len <=
            k_len``) and sees only keys of its own document. Block pairs that share no
            document are skipped; blocks inside one document get no document mask. Ids need
            not be sorted, but runs of equal ids are what makes blocks skippable.
        softcap: if given, scaled scores ``s`` become ``softcap * tanh(s / softcap)`` (as
            Gemma 2), before any mask or bias is added; per tile, in forward and backward.
        alibi_slopes: ``(heads,)`` or ``(batch, heads)``: adds ALiBi's bias
            ``-slope * |k_len - q_len + i - j|`` to each score, per tile (never a ``q_len x
            k_len`` tensor). Slopes that require grad receive their gradient.
        sinks: ``(heads,)``: one learnable logit per head that joins every row's softmax
            denominator and carries no value (attention sinks); receives its gradient. A row
            that sees no key still returns zeros; its log-sum-exp is the sink's.
        block_mask: a :class:`~octlm.attention.block_masks.BlockMask` (any pattern, built
            once by ``block_mask(mask_mod, ...)``), ANDed with the other rules. Its empty
            blocks are skipped and its full ones get no mask; its blocks are the tiles
            (``block`` is not used then).
        return_lse: also return the log-sum-exp of the scaled scores, ``(batch, heads,
            q_len)``, fp32 (fp64 for fp64 inputs), ``-inf`` for rows that see no key (the
            sink's logit with ``sinks``, which is always in the denominator). It carries no
            gradient: a loss that uses it gets none through it.
        kernel: ``"auto"`` runs the Triton kernel (:mod:`octlm.attention.tiled.triton_flash`, which
            picks its own tiles and implements every argument here but ``mask`` and
            ``block_mask``, forward and backward) for CUDA tensors when Triton is installed, no
            ``mask`` is given, the dtype is not float64 and ``head_size <= 256``; the
            plain-PyTorch blocks otherwise (always for :data:`PYTORCH_ONLY` arguments).
            ``"pytorch"`` or ``"triton"`` force one.

    Returns:
        The output in the input dtype (rows that see no key are zero), or ``(out, lse)``.
    """
    call = check(call_of(locals()), dropout=False)
    return tiled_call(call, block=block, return_lse=return_lse, kernel=kernel)


def tiled_call(
    call: Call, *, block: int | tuple[int, int], return_lse: bool = False, kernel: str = "auto"
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`tiled_attention` of a checked call."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    block = parse_block(block)  # checked on every path, used by the PyTorch one
    pytorch_only = [name for name in PYTORCH_ONLY if getattr(call, name) is not None]
    if kernel == "triton" and pytorch_only:
        raise ValueError(
            f"kernel='triton' does not take {', '.join(pytorch_only)}; use kernel='pytorch'"
        )
    if kernel == "triton" or (kernel == "auto" and not pytorch_only and _triton_fits(call)):
        from octlm.attention.tiled.triton_flash import triton_call

        return triton_call(call, return_lse=return_lse)
    rules = Rules(
        past=call.past,
        scale=call.scale,
        causal=call.causal,
        window=call.window,
        block=block,
        softcap=call.softcap,
        block_mask=call.block_mask,
    )
    tensors = [getattr(call, name) for name in OPTIONAL_TENSORS]
    inputs = (call.query, call.key, call.value, *tensors)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        out, lse = _TiledAttention.apply(*inputs, rules)
        return (out, lse) if return_lse else out
    # Nothing to differentiate (decoding, evaluation): no autograd node, no lse unless asked.
    out, rows = _forward(call.query, call.key, call.value, tensors, rules)
    return (out, rows.lse()) if return_lse else out


# The caller's tensors that the autograd function takes, in its order.
OPTIONAL_TENSORS = ("mask", "key_lengths", "key_starts", "document_ids", "alibi_slopes", "sinks")
# Arguments only the plain-PyTorch blocks implement; kernel="auto" routes calls with them there.
PYTORCH_ONLY = ("block_mask",)


def _triton_fits(call: Call) -> bool:
    """Whether ``kernel="auto"`` should take the Triton kernel for this call."""
    query = call.query
    if not query.is_cuda or call.mask is not None:
        return False
    if query.dtype == torch.float64 or call.head_size > 256:
        return False
    try:
        from octlm.attention.tiled.triton_flash import is_available
    except ImportError:
        return False
    return is_available(query.device)
