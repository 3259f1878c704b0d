"""Tiled attention: FlashAttention's blocking in plain PyTorch, and its Triton kernel.

- :mod:`~octlm.attention.tiled.attention`: :func:`tiled_attention`, the public function, behind
  autograd; :mod:`~octlm.attention.tiled.options`: its tiles and kernels.
- The engine: :mod:`~octlm.attention.tiled.core` (a call's rules, the units, the folded
  layout), :mod:`~octlm.attention.tiled.walk` (which tiles a query block visits, one score tile
  at a time), :mod:`~octlm.attention.tiled.forward` (the online softmax) and
  :mod:`~octlm.attention.tiled.backward` (the recomputing backward).
- :mod:`~octlm.attention.tiled.threads`: query blocks on CPU threads.
- :mod:`~octlm.attention.tiled.triton_flash`: the same algorithm as one Triton kernel, for CUDA.
"""

from octlm.attention.tiled.attention import tiled_attention
from octlm.attention.tiled.options import DEFAULT_BLOCK, KERNELS, parse_block

__all__ = ["DEFAULT_BLOCK", "KERNELS", "parse_block", "tiled_attention"]
