"""PyTorch's fused ``scaled_dot_product_attention`` behind octlm's signature.

SDPA's ``is_causal`` is top-left aligned, so it is passed only for plain causal attention with
``q_len == k_len``; every other shape (bottom-right causal for a KV cache, a window, a user mask)
goes in as one explicit mask. Never both.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from octlm.attention.inputs import check_inputs
from octlm.attention.masks import as_4d, dense_mask, padding_mask


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
) -> Tensor:
    """Attention through SDPA's fused backends. Shapes and rules as ``tiled_attention``."""
    shape = check_inputs(
        query, key, value, causal=causal, window=window, mask=mask, scale=scale,
        dropout_p=dropout_p, key_lengths=key_lengths, key_starts=key_starts,
        document_ids=document_ids,
    )  # fmt: skip
    padded = key_lengths is not None or key_starts is not None
    structured = mask is not None or padded or document_ids is not None or window > 0
    plain = not structured and (not causal or shape.past == 0)
    attn_mask = None
    if padded:
        # No row sees a padded key, so its contents must not matter; SDPA's kernels multiply
        # zero weights by it, and 0 x NaN is NaN. Zero the padding instead.
        present = padding_mask(key_lengths, range(shape.k_len), key_starts)  # (B, 1, 1, K)
        present = present.transpose(-2, -1)  # (B, 1, K, 1)
        key, value = key.masked_fill(~present, 0.0), value.masked_fill(~present, 0.0)
    if not plain:
        dense = dense_mask(
            shape.q_len, shape.k_len, causal, window, mask, query.device, key_lengths,
            key_starts, document_ids,
        )  # fmt: skip
        attn_mask = as_4d(dense)  # SDPA wants at least 2-D
        if attn_mask.is_floating_point():
            attn_mask = attn_mask.to(query.dtype)  # SDPA wants the query's dtype
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=plain and causal,
        scale=shape.scale,
        enable_gqa=shape.kv_heads != shape.heads,
    )
