"""The structural rules of docs/design.md §2: bottom-right causal alignment and the sliding window.

Query row ``i`` sits at key position ``past + i``; it may see key ``j`` iff ``j <= past + i``
(when causal) and ``past + i - j < window`` (when ``window > 0``). ``past`` is
``k_len - q_len`` for a single call, and any offset at all when a caller attends one chunk of
queries to one chunk of keys (the context-parallel ring does).
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def key_range(rows: range, k_len: int, past: int, causal: bool, window: int) -> range:
    """Keys that any of ``rows`` may see; everything outside is skipped whole."""
    low, high = 0, k_len
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


def dense_mask(
    q_len: int,
    k_len: int,
    causal: bool,
    window: int,
    mask: Tensor | None,
    device=None,
    key_lengths: Tensor | None = None,
) -> Tensor | None:
    """The structural rules and a user ``mask`` as one dense mask, for kernels that need one.

    ``None`` when nothing is hidden; bool (True = may attend) when ``mask`` is bool or absent;
    a float mask with ``-inf`` at hidden places when ``mask`` is float. ``key_lengths``
    (batch,) hides keys at and after each batch element's length.
    """
    structural = None
    if causal or window:
        structural = allowed(range(q_len), range(k_len), k_len - q_len, causal, window, device)
    if key_lengths is not None:
        present = padding_mask(key_lengths, range(k_len))  # (B, 1, 1, K)
        structural = present if structural is None else structural & present
    if mask is None:
        return structural
    if structural is None:
        return mask
    if mask.dtype == torch.bool:
        return mask & structural
    return torch.where(structural, mask, float("-inf"))


def as_4d(mask: Tensor) -> Tensor:
    """A mask broadcastable to ``(B, H, Q, K)`` as a 4-D view, leading dims of size 1."""
    return mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))


def padding_mask(key_lengths: Tensor, columns: range) -> Tensor:
    """Bool ``(B, 1, 1, len(columns))``: True where the key is inside its batch's length."""
    column = torch.arange(columns.start, columns.stop, device=key_lengths.device)
    return (column < key_lengths[:, None])[:, None, None, :]
