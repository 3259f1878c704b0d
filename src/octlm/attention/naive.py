"""The reference: the whole score matrix, mask, softmax, multiply by the values.

The handwritten path the project began with. Short and obviously right on purpose: it is what
the other implementations are checked against, and, run in float64, the reference of
docs/design.md, 'When are two results equal'. Memory is O(q_len x k_len) per head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from octlm.attention.inputs import call_of, check, keyword_only
from octlm.attention.masks import alibi_bias, dense_mask

if TYPE_CHECKING:
    from octlm.attention.block_masks import BlockMask

NEG_INF = float("-inf")


@keyword_only
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
    block_mask: BlockMask | None = None,
) -> Tensor:
    """Attention by the definition. Shapes and rules as :func:`octlm.attention.tiled_attention`.

    The score modifiers act on the whole score matrix: ``softcap`` bounds the scaled scores,
    ``alibi_slopes`` adds ALiBi's bias, ``sinks`` join each row's softmax as one more logit per
    head. Returns ``(batch, heads, q_len, head_size)`` in the input dtype.
    """
    call = check(call_of(locals()))
    key = key.repeat_interleave(call.group, dim=1)  # (B, H, K, D)
    value = value.repeat_interleave(call.group, dim=1)  # (B, H, K, D)
    scores = query @ key.transpose(-2, -1) * call.scale  # (B, H, Q, K)
    if call.softcap is not None:
        scores = call.softcap * torch.tanh(scores / call.softcap)
    if call.alibi_slopes is not None:
        # Formed in the finer of the slopes' and the scores' dtypes, then rounded once.
        slopes = call.alibi_slopes.to(torch.promote_types(call.alibi_slopes.dtype, scores.dtype))
        scores = scores + alibi_bias(slopes, call.q_len, call.k_len).to(scores.dtype)
    hidden = dense_mask(call)
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
    if call.sinks is not None:  # one more logit per row, whose weight multiplies no value
        sink = call.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)  # (B, H, Q, K + 1)
    weights = torch.softmax(logits, dim=-1)[..., : call.k_len].masked_fill(~seen, 0.0)
    if call.dropout_p > 0:
        weights = F.dropout(weights, call.dropout_p)
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
