"""octlm: exact attention behind one signature (reference, SDPA, tiled, Triton, ring), checked
against each other inside a small language model that trains, resumes and exports.

Every name is loaded on first use, so that ``import octlm`` (and ``octlm --help``) imports
neither torch nor the model.
"""

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_SOURCES = {
    "attention_mask": "octlm.attention",
    "auto_attention": "octlm.attention",
    "naive_attention": "octlm.attention",
    "route": "octlm.attention",
    "sdpa_attention": "octlm.attention",
    "tiled_attention": "octlm.attention",
    "KVCache": "octlm.model",
    "ModelConfig": "octlm.model",
    "OctLM": "octlm.model",
    "Run": "octlm.training.folder",
    "load_run": "octlm.training.folder",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module 'octlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_SOURCES])
