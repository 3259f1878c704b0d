"""The reference: the whole score matrix, mask, softmax, multiply by the values (seed, Day 1).

Short and obviously right on purpose; it is what the other implementations are checked against,
and, run in float64, the "golden" reference of DESIGN §4. Memory is O(q_len x k_len) per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octlm.attention.inputs import check_inputs
from octlm.attention.masks import dense_mask


def naive_attention(
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
) -> Tensor:
    """Attention by the definition. Shapes and rules as :func:`octlm.attention.tiled_attention`.

    Returns ``(batch, heads, q_len, head_size)`` in the input dtype.
    """
    shape = check_inputs(
        query, key, value, causal=causal, window=window, mask=mask, scale=scale,
        dropout_p=dropout_p, key_lengths=key_lengths,
    )  # fmt: skip
    key = key.repeat_interleave(shape.group, dim=1)  # (B, H, K, D)
    value = value.repeat_interleave(shape.group, dim=1)  # (B, H, K, D)
    scores = query @ key.transpose(-2, -1) * shape.scale  # (B, H, Q, K)
    hidden = dense_mask(shape.q_len, shape.k_len, causal, window, mask, query.device, key_lengths)
    if hidden is not None and hidden.dtype == torch.bool:
        scores = scores.masked_fill(~hidden, float("-inf"))
    elif hidden is not None:
        scores = scores + hidden.to(scores.dtype)
    # A row that sees no key would be a softmax of all -inf (NaN); DESIGN §2 makes it zero,
    # with zero gradient, so give those rows finite scores and zero their weights.
    seen = scores.amax(dim=-1, keepdim=True) > float("-inf")  # (B, H, Q, 1)
    weights = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1).masked_fill(~seen, 0.0)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return weights @ value  # (B, H, Q, D)
