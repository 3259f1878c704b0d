"""The structural rules of docs/design.md, 'Tensor conventions': bottom-right causal alignment, the
sliding window, padding and packed documents.

Query row ``i`` sits at key position ``past + i``; it may see key ``j`` iff ``j <= past + i``
(when causal) and ``past + i - j < window`` (when ``window > 0``). ``past`` is
``k_len - q_len`` for a single call, and any offset at all when a caller attends one chunk of
queries to one chunk of keys (the context-parallel ring does). Padding hides keys outside
``[key_starts[b], key_lengths[b])``; documents hide keys of another document than the row's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from octlm.attention.inputs import Call


def allowed(
    rows: range, columns: range, past: int, causal: bool, window: int, device=None
) -> Tensor:
    """Bool ``(len(rows), len(columns))``, True where query row may see key column."""
    position = past + torch.arange(rows.start, rows.stop, device=device).unsqueeze(1)  # (Q, 1)
    column = torch.arange(columns.start, columns.stop, device=device).unsqueeze(0)  # (1, K)
    visible = torch.ones(len(rows), len(columns), dtype=torch.bool, device=device)
    if causal:
        visible &= column <= position
    if window:
        visible &= position - column < window
    return visible


def attention_mask(length: int, past: int = 0, window: int = 0, device=None) -> Tensor:
    """Causal mask for ``length`` new queries after ``past`` cached keys.

    Returns bool ``(length, past + length)``, True = may attend. ``window > 0`` also hides
    keys ``window`` or more positions behind the query.
    """
    for name, number in (("length", length), ("past", past), ("window", window)):
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(f"{name} must be an int >= 0, got {number!r}")
    return allowed(range(length), range(past + length), past, True, window, device)


def key_range(
    rows: range, k_len: int, past: int, causal: bool, window: int, first: int = 0
) -> range:
    """Keys that any of ``rows`` may see, none before ``first``; everything outside is skipped
    whole."""
    low, high = first, k_len
    if causal:
        high = min(high, past + rows.stop)  # last row sees up to past + rows.stop - 1
    if window:
        low = max(low, past + rows.start - window + 1)
    return range(low, max(low, high))


def fully_visible(rows: range, columns: range, past: int, causal: bool, window: int) -> bool:
    """True when every row sees every column, so the block needs no mask arithmetic."""
    if causal and columns.stop - 1 > past + rows.start:
        return False
    return not (window and past + rows.stop - 1 - columns.start >= window)


def dense_mask(call: Call) -> Tensor | None:
    """A checked call's structural rules and ``mask`` as one dense mask, for kernels that need one.

    ``None`` when nothing is hidden; bool (True = may attend) when the mask is bool or absent;
    a float mask with ``-inf`` at hidden places when it is float. ``key_lengths`` and
    ``key_starts`` hide keys outside ``[start, length)``, ``document_ids`` keys of other
    documents than the row's (row ``i`` is in the document of key ``past + i``), and a
    ``block_mask`` (:mod:`octlm.attention.block_masks`) adds its pattern.
    """
    structural, columns, device = None, range(call.k_len), call.query.device
    if call.causal or call.window:
        rows = range(call.q_len)
        structural = allowed(rows, columns, call.past, call.causal, call.window, device)
    if call.key_lengths is not None or call.key_starts is not None:
        present = padding_mask(call.key_lengths, columns, call.key_starts)  # (B, 1, 1, K)
        structural = present if structural is None else structural & present
    if call.document_ids is not None:
        own = call.document_ids[:, call.past :]  # (B, Q), each row's document
        same = (own[:, :, None] == call.document_ids[:, None, :]).unsqueeze(1)  # (B, 1, Q, K)
        structural = same if structural is None else structural & same
    if call.block_mask is not None:
        pattern = call.block_mask.dense(device)  # (b, h, Q, K)
        structural = pattern if structural is None else structural & pattern
    mask = call.mask
    if mask is None:
        return structural
    if structural is None:
        return mask
    if mask.dtype == torch.bool:
        return mask & structural
    return torch.where(structural, mask, float("-inf"))


def distance(rows: range, columns: range, past: int, dtype=None, device=None) -> Tensor:
    """``|past + i - j|`` as ``(len(rows), len(columns))``: how far key ``j`` lies from query
    row ``i``, which ALiBi's bias ``-slope * distance`` penalises."""
    position = past + torch.arange(rows.start, rows.stop, device=device).unsqueeze(1)  # (R, 1)
    column = torch.arange(columns.start, columns.stop, device=device).unsqueeze(0)  # (1, C)
    return (position - column).abs().to(dtype)


def alibi_bias(slopes: Tensor, q_len: int, k_len: int) -> Tensor:
    """ALiBi's dense bias ``-slope * |k_len - q_len + i - j|``, ``(B|1, H, Q, K)``, for the
    implementations that add it to the whole score matrix."""
    slopes = slopes.view(-1, slopes.shape[-1], 1, 1)  # (B|1, H, 1, 1)
    far = distance(range(q_len), range(k_len), k_len - q_len, slopes.dtype, slopes.device)
    return -slopes * far  # (B|1, H, Q, K)


def as_4d(mask: Tensor) -> Tensor:
    """A mask broadcastable to ``(B, H, Q, K)`` as a 4-D view, leading dims of size 1."""
    return mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))


def padding_mask(
    key_lengths: Tensor | None, columns: range, key_starts: Tensor | None = None
) -> Tensor:
    """Bool ``(B, 1, 1, len(columns))``: True where the key lies in ``[key_starts[b],
    key_lengths[b])``, its batch element's keys (either bound may be ``None``)."""
    bound = key_lengths if key_lengths is not None else key_starts
    column = torch.arange(columns.start, columns.stop, device=bound.device)  # (C,)
    present = torch.ones(bound.shape[0], len(columns), dtype=torch.bool, device=bound.device)
    if key_lengths is not None:
        present &= column < key_lengths[:, None]
    if key_starts is not None:
        present &= column >= key_starts[:, None]
    return present[:, None, None, :]
