"""PyTorch's fused ``scaled_dot_product_attention`` behind octlm's signature.

SDPA's ``is_causal`` is top-left aligned, so it is passed only for plain causal attention with
``q_len == k_len``; one query row against a cache sees every key, so it needs no mask at all;
every other shape (bottom-right causal for a KV cache, a window, a user mask) goes in as one
explicit mask. Never both.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from octlm.attention.inputs import Call, call_of, check, keyword_only
from octlm.attention.masks import alibi_bias, as_4d, dense_mask, padding_mask

if TYPE_CHECKING:
    from octlm.attention.block_masks import BlockMask


@keyword_only
def sdpa_attention(
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
) -> Tensor:
    """Attention through SDPA's fused backends. Shapes and rules as ``tiled_attention``.

    SDPA knows none of the score modifiers, so they enter densely: ALiBi as a float mask; with
    a softcap the capped scores themselves, with a query of zeros, so SDPA adds them to
    nothing (a mask of ``capped - raw`` would cancel against SDPA's own raw scores and keep
    only their precision); each sink as one more key of zeros whose mask entry is the sink's
    logit. Where a row's largest finite mask value is beyond ``±LSE_LIMIT`` and gradients are
    wanted, SDPA's MATH backend runs instead of its fused ones, whose backward recomputes the
    probabilities from a log-sum-exp too coarse at that size to hold the row's own scores.
    """
    return sdpa_call(check(call_of(locals())))


def sdpa_call(call: Call) -> Tensor:
    """:func:`sdpa_attention` of a checked call."""
    query, key, value = call.query, call.key, call.value
    padded = call.key_lengths is not None or call.key_starts is not None
    # A window as wide as the keys hides nothing: it needs no mask.
    structured = call.mask is not None or padded or 0 < call.window < call.k_len
    structured = structured or call.document_ids is not None or call.block_mask is not None
    modified = call.softcap is not None or call.alibi_slopes is not None or call.sinks is not None
    # Bottom-right causal hides nothing from a single row (decoding): it is not causal then.
    causal = call.causal and not (call.q_len == 1 and call.k_len > 0)
    plain = not structured and not modified and (not causal or call.past == 0)
    attn_mask = None
    if padded:
        # No row sees a padded key, so its contents must not matter; SDPA's kernels multiply
        # zero weights by it, and 0 x NaN is NaN. Zero the padding instead.
        present = padding_mask(call.key_lengths, range(call.k_len), call.key_starts)  # (B, 1, 1, K)
        present = present.transpose(-2, -1)  # (B, 1, K, 1)
        key, value = key.masked_fill(~present, 0.0), value.masked_fill(~present, 0.0)
    if not plain:
        attn_mask = dense_mask(call)
        bias = _score_bias(call, key)  # (B|1, H, Q, K) or None
        if bias is not None:
            attn_mask = bias if attn_mask is None else _hide(bias, attn_mask)
        if call.sinks is not None:
            key, value, attn_mask = _with_sinks(key, value, attn_mask, call)
        attn_mask = as_4d(attn_mask)  # SDPA wants at least 2-D
        if attn_mask.is_floating_point():
            attn_mask = attn_mask.to(query.dtype)  # SDPA wants the query's dtype
    coarse = _lse_too_coarse(attn_mask, query, key, value)
    if call.softcap is not None and call.k_len:
        query = torch.zeros_like(query)  # the capped scores are all in the mask
    with sdpa_kernel(SDPBackend.MATH) if coarse else contextlib.nullcontext():
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=call.dropout_p,
            is_causal=plain and causal,
            scale=call.scale,
            enable_gqa=call.kv_heads != call.heads,
        )


# Past this size a float32 log-sum-exp rounds by 1/128 or more (2 ** 16 * 2 ** -23): a fused
# backward that recomputes probabilities from it no longer holds the row's own scores.
LSE_LIMIT = 2.0**16


def _lse_too_coarse(attn_mask: Tensor | None, *tensors: Tensor) -> bool:
    """Whether gradients are wanted and some row's largest finite mask value (where its
    log-sum-exp will sit) is beyond ``±LSE_LIMIT``: ``finfo.min`` on every key of a row, or a
    huge bonus."""
    if attn_mask is None or not attn_mask.is_floating_point() or not attn_mask.numel():
        return False
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (attn_mask, *tensors)):
        return False
    row_max = attn_mask.amax(dim=-1)  # (b, h, q)
    return bool(((row_max.abs() > LSE_LIMIT) & row_max.isfinite()).any())


def _score_bias(call: Call, key: Tensor) -> Tensor | None:
    """What the modifiers add to SDPA's scaled scores, as one dense float mask; ``key`` is
    the call's, with its padding zeroed."""
    dtype = torch.promote_types(call.query.dtype, torch.float32)
    bias = None
    if call.softcap is not None:  # the capped scores, whole: SDPA is given a zero query
        key = key.to(dtype).repeat_interleave(call.group, dim=1)  # (B, H, K, D)
        raw = call.query.to(dtype) @ key.transpose(-2, -1) * call.scale  # (B, H, Q, K)
        bias = call.softcap * torch.tanh(raw / call.softcap)
    if call.alibi_slopes is not None:
        alibi = alibi_bias(call.alibi_slopes.to(dtype), call.q_len, call.k_len)  # (B|1, H, Q, K)
        bias = alibi if bias is None else bias + alibi
    return bias


def _hide(bias: Tensor, mask: Tensor) -> Tensor:
    """``bias`` plus a float mask, or with a bool mask's hidden places at ``-inf``."""
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def _with_sinks(key, value, attn_mask, call: Call) -> tuple[Tensor, Tensor, Tensor]:
    """Each sink as one more key and value of zeros, seen by every row with the sink's logit
    as its mask entry: its score is ``0 + sink`` and its value adds nothing."""
    sinks, q_len, k_len = call.sinks, call.q_len, call.k_len
    zeros = key.new_zeros(*key.shape[:2], 1, key.shape[3])  # (B, Hkv, 1, D)
    key, value = torch.cat([key, zeros], dim=2), torch.cat([value, zeros], dim=2)
    if attn_mask is None:
        attn_mask = torch.zeros(q_len, k_len, dtype=sinks.dtype, device=sinks.device)
    elif attn_mask.dtype == torch.bool:
        hidden = ~attn_mask
        attn_mask = torch.zeros(hidden.shape, dtype=sinks.dtype, device=sinks.device)
        attn_mask = attn_mask.masked_fill(hidden, float("-inf"))
    batch, heads = as_4d(attn_mask).shape[0], call.heads
    full = as_4d(attn_mask).expand(batch, heads, q_len, k_len)  # (b, H, Q, K)
    sink = sinks.view(1, heads, 1, 1).expand(batch, heads, q_len, 1).to(full.dtype)
    return key, value, torch.cat([full, sink], dim=-1)  # (b, H, Q, K + 1)
