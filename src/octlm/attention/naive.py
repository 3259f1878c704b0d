"""The reference: the whole score matrix, mask, softmax, multiply by the values.

The handwritten path the project began with. Short and obviously right on purpose: it is what
the other implementations are checked against, and, run in float64, the reference of
docs/design.md §4. Memory is O(q_len x k_len) per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octlm.attention.inputs import check_inputs
from octlm.attention.masks import alibi_bias, dense_mask

NEG_INF = float("-inf")


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
    key_starts: Tensor | None = None,
    document_ids: Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    block_mask=None,
) -> Tensor:
    """Attention by the definition. Shapes and rules as :func:`octlm.attention.tiled_attention`.

    The score modifiers act on the whole score matrix: ``softcap`` bounds the scaled scores,
    ``alibi_slopes`` adds ALiBi's bias, ``sinks`` join each row's softmax as one more logit per
    head. Returns ``(batch, heads, q_len, head_size)`` in the input dtype.
    """
    shape = check_inputs(
        query, key, value, causal=causal, window=window, mask=mask, scale=scale,
        dropout_p=dropout_p, key_lengths=key_lengths, key_starts=key_starts,
        document_ids=document_ids, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        block_mask=block_mask,
    )  # fmt: skip
    key = key.repeat_interleave(shape.group, dim=1)  # (B, H, K, D)
    value = value.repeat_interleave(shape.group, dim=1)  # (B, H, K, D)
    scores = query @ key.transpose(-2, -1) * shape.scale  # (B, H, Q, K)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, shape.q_len, shape.k_len).to(scores.dtype)
    hidden = dense_mask(
        shape.q_len, shape.k_len, causal, window, mask, query.device, key_lengths, key_starts,
        document_ids, block_mask,
    )  # fmt: skip
    if hidden is not None and hidden.dtype == torch.bool:
        scores = scores.masked_fill(~hidden, float("-inf"))
    elif hidden is not None:
        # A finite mask value is a score; only -inf hides (and hides a NaN score too).
        scores = (scores + hidden.to(scores.dtype)).masked_fill(hidden == float("-inf"), NEG_INF)
    # A row that sees no key would be a softmax of all -inf (NaN); it is zero instead, with
    # zero gradient, so give those rows finite scores and zero their weights. NaN counts as
    # seen, so a NaN a row can see makes the row NaN.
    seen = (scores != NEG_INF).any(dim=-1, keepdim=True)  # (B, H, Q, 1)
    logits = scores.masked_fill(~seen, 0.0)
    if sinks is not None:  # one more logit per row, whose weight multiplies no value
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)  # (B, H, Q, K + 1)
    weights = torch.softmax(logits, dim=-1)[..., : shape.k_len].masked_fill(~seen, 0.0)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    broken = ~value.isfinite()  # (B, H, K, D)
    if not broken.any():
        return weights @ value  # (B, H, Q, D)
    # 0 x NaN is NaN: sum the finite values, then add exactly what each row sees of the rest.
    out = weights @ value.masked_fill(broken, 0.0)  # (B, H, Q, D)
    columns = broken.flatten(0, 1).any(dim=0).any(dim=-1).nonzero().squeeze(1)  # keys with any
    visible = (scores != NEG_INF)[..., columns, None]  # (B, H, Q, K', 1)
    part = weights[..., columns, None] * value[:, :, None, columns].masked_fill(
        ~broken[:, :, None, columns], 0.0
    )  # (B, H, Q, K', D)
    return out + torch.where(visible, part, 0.0).sum(dim=-2)
