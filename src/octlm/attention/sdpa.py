"""PyTorch's fused ``scaled_dot_product_attention`` behind octlm's signature.

SDPA's ``is_causal`` is top-left aligned, so it is passed only for plain causal attention with
``q_len == k_len``; one query row against a cache sees every key, so it needs no mask at all;
every other shape (bottom-right causal for a KV cache, a window, a user mask) goes in as one
explicit mask. Never both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octlm.attention.inputs import Call, attention_function
from octlm.attention.masks import alibi_bias, as_4d, dense_mask, padding_mask


@attention_function()
def sdpa_attention(call: Call) -> Tensor:
    """Attention through SDPA's fused backends. Shapes and rules as ``tiled_attention``.

    SDPA knows none of the score modifiers, so they enter densely: ALiBi and the softcap
    (``capped - raw`` scores) as a float mask, each sink as one more key of zeros whose mask
    entry is the sink's logit.
    """
    query, key, value = call.query, call.key, call.value
    padded = call.key_lengths is not None or call.key_starts is not None
    structured = call.mask is not None or padded or call.window > 0
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
        bias = _score_bias(call)  # (B|1, H, Q, K) or None
        if bias is not None:
            attn_mask = bias if attn_mask is None else _hide(bias, attn_mask)
        if call.sinks is not None:
            key, value, attn_mask = _with_sinks(key, value, attn_mask, call)
        attn_mask = as_4d(attn_mask)  # SDPA wants at least 2-D
        if attn_mask.is_floating_point():
            attn_mask = attn_mask.to(query.dtype)  # SDPA wants the query's dtype
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


def _score_bias(call: Call) -> Tensor | None:
    """What the modifiers add to SDPA's scaled scores, as one dense float mask."""
    dtype = torch.promote_types(call.query.dtype, torch.float32)
    bias = None
    if call.softcap is not None:  # SDPA forms the raw scores; the mask adds what the cap takes off
        key = call.key.to(dtype).repeat_interleave(call.group, dim=1)  # (B, H, K, D)
        raw = call.query.to(dtype) @ key.transpose(-2, -1) * call.scale  # (B, H, Q, K)
        bias = call.softcap * torch.tanh(raw / call.softcap) - raw
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
