"""The import path of :mod:`octlm.attention.tiled.triton_flash` before the tiled package: the
same module object (it needs Triton, as ever)."""

import sys

from octlm.attention.tiled import triton_flash

sys.modules[__name__] = triton_flash
