"""Tiled attention: FlashAttention's blocking in plain PyTorch, and its Triton kernel.

- :mod:`~octlm.attention.tiled.attention`: :func:`tiled_attention`, the public function, behind
  autograd; :mod:`~octlm.attention.tiled.options`: its tiles and kernels.
- The engines, reached through one door, :mod:`~octlm.attention.tiled.engine`, which picks one
  per call and has the backward follow it: :mod:`~octlm.attention.tiled.whole` (a call in one
  tile per head, forward and backward), :mod:`~octlm.attention.tiled.walk` (which tiles a query
  block visits, and the online softmax over them) and
  :mod:`~octlm.attention.tiled.walk_backward` (the walk's recomputing backward);
  :mod:`~octlm.attention.tiled.core` holds what they share (a call's rules, the units, the row
  statistics, the folded layout, the modifiers' gradients).
- :mod:`~octlm.attention.tiled.threads`: query blocks on CPU threads.
- :mod:`~octlm.attention.tiled.triton_flash`: the same algorithm as one Triton kernel, for CUDA.
"""

from octlm.attention.tiled.attention import tiled_attention
from octlm.attention.tiled.options import DEFAULT_BLOCK, KERNELS, parse_block

__all__ = ["DEFAULT_BLOCK", "KERNELS", "parse_block", "tiled_attention"]
