"""One registry of attention implementations: name -> function and what it supports.

Callers (the model, verify, the benchmark worker, the tests) look an implementation up here and
never branch on its name. Every function takes ``(query, key, value, *, causal, window, mask,
scale, dropout_p, key_lengths)`` (``COMMON`` in :mod:`octlm.attention.inputs`, where the call
is defined once); ``tuning`` lists the extra keywords one also accepts (the tiled ``block``
and ``kernel``), which change speed, never the result beyond rounding, and ``features`` the
call's other keywords that it takes, which change what is computed (packed documents, left
padding, score modifiers, sinks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from octlm.attention.auto import auto_attention
from octlm.attention.inputs import FEATURES
from octlm.attention.naive import naive_attention
from octlm.attention.ring import ring_attention
from octlm.attention.sdpa import sdpa_attention
from octlm.attention.tiled import tiled_attention


@dataclass(frozen=True)
class Implementation:
    """One attention implementation and its capabilities."""

    name: str
    function: Callable
    summary: str
    dropout: bool  # accepts dropout_p > 0
    mask_grad: bool  # a float mask that requires grad receives its gradient
    tuning: tuple[str, ...] = ()  # keywords beyond the shared signature
    distributed: bool = False  # a collective over a process group: no mask or key_lengths
    features: tuple[str, ...] = ()  # keywords beyond the shared signature that change the result


# What tiled, and auto through it, takes: the block engine's tiles and kernel, every feature.
BLOCKS = dict(mask_grad=True, tuning=("block", "kernel"), features=FEATURES)

IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl
    for impl in (
        Implementation(
            "naive",
            naive_attention,
            "the reference: whole score matrix, O(Q*K) memory",
            dropout=True,
            mask_grad=True,
            features=FEATURES,
        ),
        Implementation(
            "sdpa",
            sdpa_attention,
            "PyTorch's fused scaled_dot_product_attention",
            dropout=True,
            mask_grad=True,
            features=FEATURES,
        ),
        Implementation(
            "tiled",
            tiled_attention,
            "FlashAttention's blocking in PyTorch, O(Q+K) memory",
            dropout=False,
            **BLOCKS,
        ),
        Implementation(
            "auto",
            auto_attention,
            "per call, sdpa or tiled, whichever is faster for its structure (route)",
            dropout=True,
            **BLOCKS,
        ),
        Implementation(
            "ring",
            ring_attention,
            "tiled blocks over a sequence sharded across processes",
            dropout=False,
            mask_grad=False,
            tuning=("block", "layout", "group"),
            distributed=True,
        ),
    )
}


def implementation(name: str) -> Implementation:
    """The registered implementation called ``name``; a ``ValueError`` lists the choices."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {tuple(IMPLEMENTATIONS)}, got {name!r}")
    return IMPLEMENTATIONS[name]


def taking(feature: str) -> tuple[str, ...]:
    """The names of the implementations that take the keyword ``feature``."""
    return tuple(name for name, impl in IMPLEMENTATIONS.items() if feature in impl.features)
