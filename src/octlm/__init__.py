"""octlm: exact attention behind one signature (reference, SDPA, tiled, Triton, ring), checked
against each other inside a small language model that trains, resumes and exports."""

from octlm.attention import (
    attention_mask,
    auto_attention,
    naive_attention,
    route,
    sdpa_attention,
    tiled_attention,
)
from octlm.model import KVCache, ModelConfig, OctLM
from octlm.run_folder import Run, load_run

__all__ = [
    "KVCache",
    "ModelConfig",
    "OctLM",
    "Run",
    "attention_mask",
    "auto_attention",
    "load_run",
    "naive_attention",
    "route",
    "sdpa_attention",
    "tiled_attention",
]
__version__ = "0.1.0"
