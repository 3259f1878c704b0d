"""A second import path for :mod:`octlm.attention.tiled.options`, the same module object, so
``from octlm.attention.tiles import DEFAULT_BLOCK`` works as well."""

import sys

from octlm.attention.tiled import options

sys.modules[__name__] = options
