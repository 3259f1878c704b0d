"""Exact attention, several ways behind one signature (docs/design.md, 'Tensor conventions' and
'Public names').

- :func:`naive_attention`: the reference; the whole score matrix.
- :func:`sdpa_attention`: PyTorch's fused ``scaled_dot_product_attention``.
- :func:`tiled_attention`: FlashAttention's blocking in plain PyTorch, with its own backward.
- :func:`auto_attention`: per call, sdpa or tiled, as :func:`route` picks from its structure.
- :func:`ring_attention`: the tiled blocks over a sequence sharded across processes.

``IMPLEMENTATIONS`` maps each name to its function and what it supports; look them up there.
The keywords they share, with their defaults, are written once, as the fields of
:class:`~octlm.attention.inputs.Call`, and checked once, by :func:`~octlm.attention.inputs.check`.
:func:`block_mask` evaluates any ``mask_mod`` once per block, for ``block_mask=`` in every
single-process implementation.

Notation: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``Q``/``K`` query and key
lengths, ``D`` head size. Grouped-query attention shares each key/value head among
``G = H // Hkv`` consecutive query heads::

    MHA (G = 1)        GQA (G = 2)        MQA (G = H)
    q q q q            q q q q            q q q q
    | | | |            \\/  \\/            \\ \\/ /
    k k k k            k    k               k
"""

from octlm.attention.auto import auto_attention, route
from octlm.attention.block_masks import BlockMask, block_mask
from octlm.attention.masks import attention_mask
from octlm.attention.naive import naive_attention
from octlm.attention.registry import IMPLEMENTATIONS, Implementation, implementation
from octlm.attention.ring import ring_attention
from octlm.attention.sdpa import sdpa_attention
from octlm.attention.tiled import tiled_attention

__all__ = [
    "IMPLEMENTATIONS",
    "BlockMask",
    "Implementation",
    "attention_mask",
    "auto_attention",
    "block_mask",
    "implementation",
    "naive_attention",
    "ring_attention",
    "route",
    "sdpa_attention",
    "tiled_attention",
]
