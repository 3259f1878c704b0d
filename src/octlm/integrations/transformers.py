"""octlm's attention inside Hugging Face transformers models, in one call.

::

    from octlm.integrations.transformers import register

    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="octlm_tiled")

:func:`register` adds ``"octlm_<name>"`` for each single-process octlm implementation (naive,
sdpa, tiled) to two transformers registries: the attention registry (the function every
attention layer calls) and the mask registry (what the model builds once per forward for each
layer type). Both are needed: registered only as an attention function, an implementation is
handed the raw 2-D padding mask or none at all, and left padding is silently ignored.

The mask builder never makes transformers' dense ``(B, 1, Q, K)`` mask when a structure will do.
It returns a :class:`StructuredMask` in octlm's terms:

- causal and sliding-window layers keep ``causal`` and ``window``: transformers'
  ``sliding_window=w`` lets a query see itself and the ``w - 1`` keys before it, as octlm's
  ``window=w`` does, so tiled still skips every hidden block;
- a static cache's empty tail is cut off (``keys``): transformers fills a static cache from slot
  0 and aligns causality top-left, octlm aligns it bottom-right (query row ``i`` at key slot
  ``k_len - q_len + i``), and the two agree once the slots that hold nothing yet are dropped;
- right padding becomes ``key_lengths`` (tiled skips the padded blocks); any other padding,
  such as left padding, a ``(B, 1, 1, K)`` bool mask;
- anything else (packed sequences found from position ids, chunked attention, custom mask
  functions, a 4-D mask the caller prepared) goes the exact route: transformers' own dense mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        sdpa_mask,
    )
except ImportError as error:
    raise ImportError(
        "octlm.integrations.transformers needs Hugging Face transformers: "
        "pip install 'octlm[transformers]'"
    ) from error

from octlm.attention import IMPLEMENTATIONS, Implementation, implementation

PREFIX = "octlm_"
# Keyword arguments some models pass that change the maths and that octlm does not implement.
UNSUPPORTED = ("softcap", "s_aux", "position_bias")
# At most this many mask values are evaluated at once when checking a mask function's pattern.
_CHECK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class StructuredMask:
    """One layer type's mask in octlm's terms, built once per forward and read by every layer.

    ``causal`` and ``window`` follow octlm's bottom-right rules on the first ``keys`` key
    slots (``None``: all of them). ``key_lengths`` ``(B,)`` hides keys at and after each
    length; ``mask`` is a bool ``(B, 1, 1, K)`` padding mask or a ``(B, 1, Q, K)`` exact one.
    """

    # generate() builds masks ahead for a static cache and hands them to the model, whose mask
    # creation reads ``.ndim`` and passes anything but a 2-D mask on to this builder unchanged.
    ndim: ClassVar[int] = 4

    causal: bool
    window: int
    keys: int | None = None
    key_lengths: Tensor | None = None
    mask: Tensor | None = None


def register() -> tuple[str, ...]:
    """Register ``octlm_naive``, ``octlm_sdpa`` and ``octlm_tiled`` with transformers.

    Safe to call more than once. Returns the registered names.
    """
    names = []
    for impl in IMPLEMENTATIONS.values():
        if impl.distributed:  # needs a process group and a sharded sequence
            continue
        name = PREFIX + impl.name
        AttentionInterface.register(name, _attention_function(impl.name))
        AttentionMaskInterface.register(name, structured_mask)
        names.append(name)
    return tuple(names)


def _attention_function(name: str):
    """The function transformers calls for ``octlm_<name>``, in every attention layer."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """query ``(B, H, Q, D)``, key/value ``(B, Hkv, K, D)`` -> ``((B, Q, H, D), None)``.

        GQA goes in as is: octlm reads each key/value head for its group of query heads.
        """
        impl = implementation(name)  # looked up per call: a replaced registry entry is used
        _check_supported(impl, module, dropout, kwargs)
        rules = _rules(attention_mask, module, kwargs)
        out = impl.function(
            query,
            key[:, :, : rules.keys],  # (B, Hkv, keys, D): a static cache's empty tail dropped
            value[:, :, : rules.keys],
            causal=rules.causal,
            window=rules.window,
            mask=rules.mask,
            scale=scaling,
            dropout_p=dropout,
            key_lengths=rules.key_lengths,
        )  # (B, H, Q, D)
        return out.transpose(1, 2).contiguous(), None  # (B, Q, H, D), no probabilities

    attention.__name__ = attention.__qualname__ = f"{PREFIX}{name}_attention"
    return attention


def _check_supported(impl: Implementation, module, dropout: float, kwargs: dict) -> None:
    """Refuse, with the way out, what this implementation would otherwise silently get wrong."""
    label = PREFIX + impl.name
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        raise ValueError(
            f"{label} returns no attention probabilities, but output_attentions=True was asked; "
            "use attn_implementation='eager' to get them"
        )
    for option in UNSUPPORTED:
        if kwargs.get(option) is not None:
            raise ValueError(
                f"{label} does not implement {option}; this model needs an implementation "
                "that does, such as attn_implementation='eager'"
            )
    if dropout > 0 and not impl.dropout:
        with_dropout = [PREFIX + i.name for i in IMPLEMENTATIONS.values() if i.dropout]
        raise ValueError(
            f"{label} has no attention dropout, but the model asks for dropout={dropout} while "
            f"training; use attn_implementation in {with_dropout}, or set "
            "config.attention_dropout=0.0"
        )


def _rules(attention_mask, module, kwargs: dict) -> StructuredMask:
    """What to hide, from what the model handed this layer."""
    if isinstance(attention_mask, StructuredMask):
        return attention_mask
    if attention_mask is None:
        # No mask was built (the layer was called on its own): causal if the layer is.
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        return StructuredMask(causal=bool(causal), window=0)
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        # A mask the caller prepared; transformers passes 4-D masks through untouched.
        return StructuredMask(causal=False, window=0, mask=attention_mask)
    shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else None
    raise TypeError(
        f"attention_mask must be built by octlm's mask builder, be a 4-D tensor or None; got "
        f"{type(attention_mask).__name__} of shape {shape}. Call "
        "octlm.integrations.transformers.register() so that the mask registry knows octlm too"
    )


def structured_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> StructuredMask:
    """transformers' mask request (the mask registry's signature) -> :class:`StructuredMask`.

    Key slot ``j`` holds position ``kv_offset + j`` and query row ``i`` sits at position
    ``q_offset + i``; ``attention_mask`` is the 2-D ``(B, positions)`` padding mask, True =
    a real token. The pattern is recognised, or checked a few rows at a time, never guessed.
    """
    if isinstance(attention_mask, StructuredMask):  # built ahead by generate() for this step
        return attention_mask
    # A static cache passes its live length tensor, which its update() then advances in place.
    q_offset = int(q_offset)
    structure = None
    if mask_function is causal_mask_function:
        structure = True, 0
    elif mask_function is bidirectional_mask_function:
        structure = False, 0
    elif not use_vmap and local_size and _is_sliding_window(
        mask_function, batch_size, range(q_offset, q_offset + q_length),
        range(kv_offset, kv_offset + kv_length), local_size, device,
    ):  # fmt: skip
        structure = True, int(local_size)
    # Causal: keep the slots up to the last query, so octlm's bottom-right rule puts row i at
    # position q_offset + i; the slots after it (a static cache's empty tail) are all hidden.
    keys = q_offset + q_length - kv_offset if structure and structure[0] else kv_length
    if structure is None or not q_length <= keys <= kv_length:
        dense = sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, use_vmap=use_vmap, device=device,
        )  # fmt: skip
        return StructuredMask(causal=False, window=0, mask=dense)  # (B, 1, Q, K) bool
    causal, window = structure
    key_lengths, padding = _padding(attention_mask, kv_offset, keys)
    return StructuredMask(causal, window, keys, key_lengths, padding)


def _is_sliding_window(
    mask_function, batch_size: int, rows: range, columns: range, window: int, device
) -> bool:
    """Whether ``mask_function`` is exactly causal with ``window`` on these positions.

    Evaluated as transformers does (broadcast indices), a slab of rows at a time, so the check
    costs ``O(block)`` memory, not ``O(Q * K)``.
    """
    batch = torch.arange(batch_size, device=device).view(-1, 1, 1, 1)
    head = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    column = torch.arange(columns.start, columns.stop, device=device).view(1, 1, 1, -1)
    step = max(1, _CHECK_ELEMENTS // (batch_size * len(columns)))
    for start in range(rows.start, rows.stop, step):
        row = torch.arange(start, min(start + step, rows.stop), device=device).view(1, 1, -1, 1)
        expected = (column <= row) & (row - column < window)  # (1, 1, rows, K)
        got = mask_function(batch, head, row, column)  # broadcasts to (B, 1, rows, K)
        shape = (batch_size, 1, row.shape[2], len(columns))
        if not torch.equal(got.expand(shape), expected.expand(shape)):
            return False
    return True


def _padding(
    attention_mask: Tensor | None, kv_offset: int, keys: int
) -> tuple[Tensor | None, Tensor | None]:
    """The 2-D padding mask on the kept key slots as ``(key_lengths, None)`` when it is right
    padding, ``(None, (B, 1, 1, keys) bool)`` otherwise, ``(None, None)`` when nothing is padded.
    """
    if attention_mask is None:
        return None, None
    present = attention_mask[:, kv_offset : kv_offset + keys].bool()  # (B, <= keys)
    # Positions the 2-D mask does not reach yet (a static cache's tail) are padding, as in
    # transformers.
    present = F.pad(present, (0, keys - present.shape[-1]))  # (B, keys)
    if present.all():
        return None, None
    lengths = present.sum(dim=-1)  # (B,)
    if torch.equal(present, torch.arange(keys, device=present.device) < lengths[:, None]):
        return lengths, None
    return None, present[:, None, None, :]  # (B, 1, 1, keys)
