"""The import path of :mod:`octlm.attention.tiled.options` before the tiled package: the same
module object, so ``from octlm.attention.tiles import DEFAULT_BLOCK`` keeps working."""

import sys

from octlm.attention.tiled import options

sys.modules[__name__] = options
