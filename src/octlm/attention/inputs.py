"""The attention call, defined once: its keywords and their one validation.

:class:`Call` lists the keywords every implementation takes, with their defaults (docs/design.md,
'Tensor conventions'); each public function writes them out in its ``def`` line, in this order with
these defaults (tests/attention/test_signatures.py holds them to it), and hands its arguments to
:func:`call_of`. :func:`check` validates a call, so a bad one fails with a
``ValueError``/``TypeError`` that names the argument, what it got and what was expected, before any
kernel runs.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from octlm.attention.block_masks import BlockMask


def _size(tensor: str, dim: int) -> property:
    """One size of one of a call's tensors, as a read-only attribute."""
    return property(lambda call: getattr(call, tensor).shape[dim])


@dataclass(eq=False)
class Call:
    """One attention call: query, key, value and the keywords, defaults as the public ones.

    A call returned by :func:`check` is valid and has its ``scale`` filled in. Query row ``i``
    sits at key position ``past + i``, ``past = k_len - q_len`` (bottom-right causal). A value,
    never changed once made; not ``frozen`` only because a frozen dataclass takes several
    microseconds longer to build, paid on every attention call of every decoding step.
    """

    query: Tensor  # (B, H, Q, D)
    key: Tensor  # (B, Hkv, K, D)
    value: Tensor  # (B, Hkv, K, D)
    _: KW_ONLY
    causal: bool = True
    window: int = 0
    mask: Tensor | None = None
    scale: float | None = None
    dropout_p: float = 0.0
    key_lengths: Tensor | None = None
    key_starts: Tensor | None = None
    document_ids: Tensor | None = None
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None
    block_mask: BlockMask | None = None

    # Sizes read off the tensors: (B, H, Q, D) = query.shape, (B, Hkv, K, D) = key.shape.
    batch, heads, q_len, head_size = (_size("query", dim) for dim in range(4))
    kv_heads, k_len = _size("key", 1), _size("key", 2)

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, ``heads`` for MQA)."""
        return self.heads // self.kv_heads

    @property
    def past(self) -> int:
        return self.k_len - self.q_len


# The call's keywords; the first six every implementation takes (ring and Triton refuse a mask
# or key_lengths by value), the rest are the structure and score keywords of docs/design.md, 'Tensor
# conventions' that only the single-process PyTorch implementations take.
KEYWORDS = tuple(field.name for field in fields(Call) if field.kw_only)
COMMON = ("causal", "window", "mask", "scale", "dropout_p", "key_lengths")
FEATURES = tuple(name for name in KEYWORDS if name not in COMMON)
TENSORS = tuple(field.name for field in fields(Call) if not field.kw_only)
FIELDS = frozenset(field.name for field in fields(Call))


def call_of(arguments: dict) -> Call:
    """The :class:`Call` of a public function's arguments, ``locals()`` on entry: the fields
    it takes, the others at their defaults. Its own keywords (tiled's ``block``) stay out."""
    return Call(**{name: arguments[name] for name in FIELDS if name in arguments})


def keyword_only(function: Callable) -> Callable:
    """``function(query, key, value, *, ...)`` as it is, with errors that say how to call it:
    a fourth positional argument names the keyword it was most likely meant for (the
    function's own first keyword, tiled's ``block``, else its first) and shows that call;
    unknown keywords are named all at once, with the keywords it takes. ``inspect.signature``
    sees the function's own ``def`` line."""
    signature = inspect.signature(function)
    taken = frozenset(signature.parameters)

    @functools.wraps(function)
    def public(*args, **kwargs):
        if len(args) != len(TENSORS) or not taken.issuperset(kwargs):
            _refuse(function.__name__, signature, args, kwargs)
        return function(*args, **kwargs)

    return public


def _refuse(name: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
    """Raise the ``TypeError`` that names what is wrong with a call of ``name``, if anything."""
    keywords = list(signature.parameters)[len(TENSORS) :]
    if len(args) > len(TENSORS):
        meant = next((k for k in keywords if k not in FIELDS), keywords[0])
        given = args[len(TENSORS)]
        shown = repr(given) if isinstance(given, int | float | tuple | str) else "..."
        raise TypeError(
            f"{name}() takes only query, key and value by position, got {len(args)} positional "
            f"arguments; {meant} and every other argument are keyword-only: call "
            f"{name}(query, key, value, {meant}={shown})"
        )
    unknown = [keyword for keyword in kwargs if keyword not in signature.parameters]
    if unknown:
        raise TypeError(
            f"{name}() got unexpected keyword argument(s) {', '.join(unknown)}; it takes "
            f"{', '.join(keywords)}"
        )
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{name}(): {error}") from None


def check(call: Call, *, dropout: bool = True, values: bool = True) -> Call:
    """Validate ``call`` against docs/design.md, 'Tensor conventions'; the same call with its
    ``scale`` filled in.

    ``dropout=False`` refuses ``dropout_p > 0``, for an implementation without attention
    dropout. ``values=False`` checks only types, shapes, devices and plain numbers, never a
    tensor's values (no device synchronisation, meta tensors welcome): for :func:`route`,
    whose choice runs no kernel; the implementations check the values too.
    """
    query, key, value = call.query, call.key, call.value
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
    if not isinstance(call.causal, bool):
        raise TypeError(f"causal must be a bool, got {type(call.causal).__name__}")
    window = call.window
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = no window), got {window!r}")
    if call.mask is not None:
        _check_mask(call.mask, query, (batch, heads, q_len, k_len))
    for name in ("key_lengths", "key_starts"):
        bound = getattr(call, name)
        if bound is not None:
            _check_integers(name, bound, query, (batch,), "(batch,)")
            if values and batch and (bound.min() < 0 or bound.max() > k_len):
                raise ValueError(f"{name} must lie in [0, k_len={k_len}], got {bound.tolist()}")
    if call.document_ids is not None:
        _check_integers("document_ids", call.document_ids, query, (batch, k_len), "(batch, k_len)")
        if q_len > k_len:
            raise ValueError(
                f"document_ids needs q_len <= k_len (query row i is in the document of key "
                f"k_len - q_len + i), got q_len={q_len}, k_len={k_len}"
            )
    softcap = call.softcap
    if softcap is not None and not _positive_finite(softcap):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    if call.alibi_slopes is not None:
        shapes = ((heads,), (batch, heads))
        _check_floats(
            "alibi_slopes", call.alibi_slopes, query, shapes, "(heads,) or (batch, heads)"
        )
    if call.sinks is not None:
        _check_floats("sinks", call.sinks, query, ((heads,),), "(heads,)")
    if call.block_mask is not None:
        _check_block_mask(call.block_mask, query, (batch, heads, q_len, k_len))
    scale = 1.0 / math.sqrt(head_size) if call.scale is None else call.scale
    if not _positive_finite(scale):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    dropout_p = call.dropout_p
    if not isinstance(dropout_p, int | float) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_p > 0 and not dropout:
        raise ValueError(
            f"dropout_p={dropout_p} asked of an implementation without dropout; "
            "use naive or sdpa for attention dropout"
        )
    return Call(**vars(call) | {"scale": float(scale)})


def _positive_finite(number: object) -> bool:
    return (
        not isinstance(number, bool)
        and isinstance(number, int | float)
        and math.isfinite(number)
        and number > 0
    )


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
    # Imported here: block masks take the tiles' options, and the tiled package this module.
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
