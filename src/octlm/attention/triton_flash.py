"""A second import path for :mod:`octlm.attention.tiled.triton_flash`, the same module object
(it needs Triton)."""

import sys

from octlm.attention.tiled import triton_flash

sys.modules[__name__] = triton_flash
