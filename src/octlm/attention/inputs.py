"""One validation for every implementation: shapes, dtypes, devices, masks, options.

Every public attention function calls :func:`check_inputs` first, so a bad call fails with a
``ValueError``/``TypeError`` that names the argument, what it got and what was expected, before
any kernel runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Shape:
    """What the checked inputs describe. ``past = k_len - q_len`` (bottom-right causal)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_size: int
    scale: float

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, ``heads`` for MQA)."""
        return self.heads // self.kv_heads

    @property
    def past(self) -> int:
        return self.k_len - self.q_len


def check_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    window: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_supported: bool = True,
    key_lengths: Tensor | None = None,
    key_starts: Tensor | None = None,
    document_ids: Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    block_mask=None,
) -> Shape:
    """Validate an attention call against docs/design.md §2 and return its :class:`Shape`."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, length, head_size), got shape "
                f"{tuple(tensor.shape)}"
            )
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but query has {query.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    batch, heads, q_len, head_size = query.shape
    kv_batch, kv_heads, k_len, key_size = key.shape
    if kv_batch != batch:
        raise ValueError(f"key has batch {kv_batch} but query has batch {batch}")
    if key_size != head_size:
        raise ValueError(f"key has head_size {key_size} but query has head_size {head_size}")
    if value.shape != key.shape:
        raise ValueError(
            f"value must have the shape of key {tuple(key.shape)}, got {tuple(value.shape)}"
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})"
        )
    if head_size < 1:
        raise ValueError("head_size must be at least 1")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = no window), got {window!r}")
    if mask is not None:
        _check_mask(mask, query, (batch, heads, q_len, k_len))
    for name, bound in (("key_lengths", key_lengths), ("key_starts", key_starts)):
        if bound is not None:
            _check_integers(name, bound, query, (batch,), "(batch,)")
            if batch and (bound.min() < 0 or bound.max() > k_len):
                raise ValueError(f"{name} must lie in [0, k_len={k_len}], got {bound.tolist()}")
    if document_ids is not None:
        _check_integers(
            "document_ids", document_ids, query, (batch, k_len), "(batch, k_len)"
        )  # fmt: skip
        if q_len > k_len:
            raise ValueError(
                f"document_ids needs q_len <= k_len (query row i is in the document of key "
                f"k_len - q_len + i), got q_len={q_len}, k_len={k_len}"
            )
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, int | float)
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    if alibi_slopes is not None:
        shapes = ((heads,), (batch, heads))
        _check_floats("alibi_slopes", alibi_slopes, query, shapes, "(heads,) or (batch, heads)")
    if sinks is not None:
        _check_floats("sinks", sinks, query, ((heads,),), "(heads,)")
    if block_mask is not None:
        _check_block_mask(block_mask, query, (batch, heads, q_len, k_len))
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    elif (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if not isinstance(dropout_p, int | float) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_p > 0 and not dropout_supported:
        raise ValueError(
            f"dropout_p={dropout_p} asked of an implementation without dropout; "
            "use naive or sdpa for attention dropout"
        )
    return Shape(batch, heads, kv_heads, q_len, k_len, head_size, float(scale))


def _check_mask(mask: Tensor, query: Tensor, full: tuple[int, int, int, int]) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = may attend) or floating point (added to the "
            f"scores), got {mask.dtype}"
        )
    if mask.device != query.device:
        raise ValueError(f"mask is on {mask.device} but query is on {query.device}")
    if mask.dim() > 4:
        raise ValueError(f"mask must have at most 4 dims, got shape {tuple(mask.shape)}")
    try:
        broadcast = torch.broadcast_shapes(mask.shape, full)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(full):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (batch, heads, q_len, "
            f"k_len) = {full}"
        )


def _check_block_mask(block_mask, query: Tensor, full: tuple[int, int, int, int]) -> None:
    from octlm.attention.block_masks import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a BlockMask (octlm.attention.block_masks) or None, got "
            f"{type(block_mask).__name__}"
        )
    built = (block_mask.batch, block_mask.heads, block_mask.q_len, block_mask.k_len)
    if built != full:
        raise ValueError(
            f"block_mask was built for (batch, heads, q_len, k_len) = {built}, but the call "
            f"has {full}"
        )
    if block_mask.state.device != query.device:
        raise ValueError(
            f"block_mask was built on {block_mask.state.device} but query is on {query.device}"
        )


def _check_floats(
    name: str, tensor: Tensor, query: Tensor, shapes: tuple[tuple[int, ...], ...], names: str
) -> None:
    """A floating-point tensor of one of ``shapes`` on the query's device."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if tuple(tensor.shape) not in shapes:
        shown = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {names} = {shown}, got {tuple(tensor.shape)}")
    if tensor.device != query.device:
        raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")


def _check_integers(
    name: str, tensor: Tensor, query: Tensor, shape: tuple[int, ...], names: str
) -> None:
    """An integer tensor of exactly ``shape`` on the query's device."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(tensor).__name__}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if tensor.shape != shape:
        raise ValueError(f"{name} must have shape {names} = {shape}, got {tuple(tensor.shape)}")
    if tensor.device != query.device:
        raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
