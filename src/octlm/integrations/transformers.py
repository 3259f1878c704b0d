"""octlm's attention inside Hugging Face transformers models, in one call.

::

    from octlm.integrations.transformers import register

    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="octlm")

:func:`register` adds ``"octlm"`` (octlm's ``auto``: per call, the faster of sdpa and tiled)
and ``"octlm_<name>"`` for each single-process octlm implementation (naive, sdpa, tiled,
auto) to two transformers registries: the attention registry (the function every
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

Gemma 2's soft-capping and gpt-oss's sinks go on to octlm's ``softcap`` and ``sinks``; values
shorter than keys (latent attention) get zero columns, cut from the output again.
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
        sliding_window_causal_mask_function,
    )
except ImportError as error:
    raise ImportError(
        "octlm.integrations.transformers needs Hugging Face transformers: "
        "pip install 'octlm[transformers]'"
    ) from error

from octlm.attention import IMPLEMENTATIONS, Implementation, implementation

__all__ = ["StructuredMask", "register", "structured_mask"]

PREFIX = "octlm_"
# The plain name, and the implementation it runs.
DEFAULT, DEFAULT_IMPLEMENTATION = "octlm", "auto"
# Keyword arguments some models pass that change the maths and that octlm does not implement.
UNSUPPORTED = ("position_bias",)


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

    def __getattr__(self, name: str):
        """A model that reads the mask itself (its dtype, a slice) finds no tensor here."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_READ_BY_MODEL.format(what=f"its {name!r}"))

    def __getitem__(self, index):
        raise TypeError(_READ_BY_MODEL.format(what="a slice of it"))


_READ_BY_MODEL = (
    "this model reads the attention mask itself ({what}), and octlm's attention hands its "
    "layers a StructuredMask, not a tensor; use attn_implementation='sdpa' or 'eager' for it"
)


def register() -> tuple[str, ...]:
    """Register ``octlm`` (auto) and ``octlm_naive``, ``octlm_sdpa``, ``octlm_tiled``,
    ``octlm_auto`` with transformers.

    Safe to call more than once. Returns the registered names.
    """
    chosen = [(DEFAULT, DEFAULT_IMPLEMENTATION)]
    for impl in IMPLEMENTATIONS.values():
        if not impl.distributed:  # ring needs a process group and a sharded sequence
            chosen.append((PREFIX + impl.name, impl.name))
    for label, name in chosen:
        AttentionInterface.register(label, _attention_function(name, label))
        AttentionMaskInterface.register(label, structured_mask)
    return tuple(label for label, _ in chosen)


def _attention_function(name: str, label: str):
    """The function transformers calls for ``label`` (running octlm's ``name``), in every
    attention layer."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """query ``(B, H, Q, D)``, key/value ``(B, Hkv, K, D)`` -> ``((B, Q, H, D), None)``.

        GQA goes in as is: octlm reads each key/value head for its group of query heads.
        """
        impl = implementation(name)  # looked up per call: a replaced registry entry is used
        _check_supported(impl, label, module, dropout, kwargs)
        rules = _rules(attention_mask, module, kwargs)
        value_size = value.shape[-1]
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        # Multi-head latent attention's values are not as long as its keys: zero columns
        # (appended to the shorter side) change no score and no kept output column.
        query, key, value = _same_head_size(query, key, value)
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
            softcap=kwargs.get("softcap"),  # Gemma 2's logit soft-capping
            sinks=kwargs.get("s_aux"),  # gpt-oss's per-head sinks
        )  # (B, H, Q, D)
        out = out[..., :value_size]  # (B, H, Q, Dv)
        return out.transpose(1, 2).contiguous(), None  # (B, Q, H, Dv), no probabilities

    attention.__name__ = attention.__qualname__ = f"{label}_attention"
    return attention


def _same_head_size(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Query and key, or value, padded with zero columns to the longer of the two head sizes."""
    gap = value.shape[-1] - key.shape[-1]
    if gap > 0:
        return F.pad(query, (0, gap)), F.pad(key, (0, gap)), value
    if gap < 0:
        return query, key, F.pad(value, (0, -gap))
    return query, key, value


def _check_supported(impl: Implementation, label: str, module, dropout: float, kwargs: dict):
    """Refuse, with the way out, what this implementation would otherwise silently get wrong;
    ``label`` is the name transformers knows it by."""
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
        if kwargs.get("cu_seq_lens_q") is not None:
            raise ValueError(
                "octlm attention got a variable-length batch without a mask (continuous "
                "batching's paged cache), which it does not support; use transformers' own "
                "implementations for continuous batching"
            )
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
    a real token. Only a pattern recognised exactly becomes structure; the rest stays dense.
    """
    if isinstance(attention_mask, StructuredMask):  # built ahead by generate() for this step
        return attention_mask
    # A static cache passes its live length tensor, which its update() then advances in place.
    q_offset = int(q_offset)
    structure = None if use_vmap else _structure(mask_function, local_size)
    if structure is not None:
        causal, window = structure
        # Causal: keep the slots up to the last query, so that octlm's bottom-right rule puts
        # row i at position q_offset + i; the slots after it (a static cache's empty tail) are
        # hidden anyway.
        keys = q_offset + q_length - kv_offset if causal else kv_length
        if q_length <= keys <= kv_length:
            return StructuredMask(causal, window, keys, *_padding(attention_mask, kv_offset, keys))
    dense = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        use_vmap=use_vmap,
        device=device,
    )
    return StructuredMask(causal=False, window=0, mask=dense)  # (B, 1, Q, K) bool


def _structure(mask_function, local_size: int | None) -> tuple[bool, int] | None:
    """``(causal, window)`` when ``mask_function`` is one of transformers' plain patterns."""
    if _same_function(mask_function, causal_mask_function):
        return True, 0
    if _same_function(mask_function, bidirectional_mask_function):
        return False, 0
    if local_size and _same_function(
        mask_function, sliding_window_causal_mask_function(local_size)
    ):
        return True, int(local_size)
    return None


def _same_function(got, expected) -> bool:
    """Whether two mask functions run the same code over equal captured values.

    transformers composes masks from closures (``and_masks(sliding_window_overlay(w),
    causal_mask_function)``, plus packing or padding overlays); comparing code and captured
    values recognises a pattern exactly and in O(1), where evaluating it costs O(Q * K).
    Anything not recognised, including a future rewrite of these closures, takes the dense route.
    """
    if got is expected:
        return True
    if getattr(got, "__code__", None) is None or got.__code__ is not expected.__code__:
        return False
    cells, expected_cells = got.__closure__ or (), expected.__closure__ or ()
    return len(cells) == len(expected_cells) and all(
        _same_value(a.cell_contents, b.cell_contents)
        for a, b in zip(cells, expected_cells, strict=True)
    )


def _same_value(got, expected) -> bool:
    """Captured values: functions and tuples compared in depth, numbers and strings by value,
    anything else (a tensor of packed-sequence ids) only by identity."""
    if isinstance(got, tuple) and isinstance(expected, tuple):
        return len(got) == len(expected) and all(map(_same_value, got, expected))
    if callable(got) and callable(expected):
        return _same_function(got, expected)
    if isinstance(got, int | float | bool | str) and type(got) is type(expected):
        return got == expected
    return got is expected


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
