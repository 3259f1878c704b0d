"""How close a run comes to what its machine can do: the model's FLOPs per token, the host's
peak measured once and cached, and their ratio, the model FLOPs utilisation (MFU).

FLOPs per trained token (forward and backward, docs/benchmarks.md 'Share of peak'):

    6 x N + 6 x L x T x d

``N`` counts the weights that a step multiplies: every block's query/key/value, output and
three SwiGLU matrices, and the output head (the tied embedding counts once, as the head; the
embedding's lookup, norms and biases are no products). The second term is attention's two
products per layer (scores and their weighted values: ``2 x 2 x T x d`` a token forward, times
3 with the backward) over ``T`` keys of width ``d = heads x head size``, causal counted at
half; a sliding window of ``w`` sees ``min(T, w)`` keys.

The peak is the best rate of large square products (``PEAK_SIZES``) in the run's dtype
(bfloat16 through autocast, as the steps run it) on the run's threads: the rate a step's own
products could reach at best. It is measured once per machine, torch version, dtype and
thread count, outside any time budget, and cached in ``$XDG_CACHE_HOME/octlm/peak.json``
(``~/.cache``); ``$OCTLM_PEAK_FLOPS`` gives it instead (0: not measured, no MFU said).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

import torch

from octlm.machine import cpu_flags, cpu_model
from octlm.model import ModelConfig

PEAK_SIZES = (1536, 2048)  # square products large enough to reach the best rate
PEAK_REPEATS = 5  # timed products a size: the best of them counts
PEAK_VARIABLE = "OCTLM_PEAK_FLOPS"  # FLOP/s that stand for the measurement; 0 skips it


def multiplied_weights(config: ModelConfig) -> int:
    """N: the weights a step multiplies (the head included, the embedding's lookup not)."""
    width, mlp = config.width, config.mlp_width
    qkv = width * (config.n_heads + 2 * config.n_kv_heads) * config.head_size
    output = config.n_heads * config.head_size * width
    layer = qkv + output + 3 * width * mlp
    return config.n_layers * layer + width * config.vocab_size


def flops_per_token(config: ModelConfig, length: int) -> float:
    """FLOPs of one trained token in rows of ``length``: ``6 N + 6 L T d``, causal at half."""
    keys = min(length, config.window) if config.window else length
    attention = 6 * config.n_layers * keys * config.n_heads * config.head_size
    return 6 * multiplied_weights(config) + attention


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "octlm" / "peak.json"


def _key(device: torch.device, dtype: str, threads: int) -> str:
    """What a peak depends on: the processor, torch, the dtype and the threads."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_model()} {len(cpu_flags() or ())} flags"
    return f"{where} | torch {torch.__version__} | {dtype} | {threads} threads"


def measure_peak(device: torch.device, dtype: str) -> float:
    """The best FLOP/s of square products of :data:`PEAK_SIZES` on ``device`` in ``dtype``
    (float32, or bfloat16 and float16 through autocast)."""
    best = 0.0
    autocast = torch.autocast(device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32")
    for size in PEAK_SIZES:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator).to(device)  # (n, n)
        b = torch.randn(size, size, generator=generator).to(device)  # (n, n)
        with autocast:
            (a @ b).sum().item()  # warm-up: kernels chosen, memory touched
            for _ in range(PEAK_REPEATS):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                began = time.perf_counter()
                product = a @ b
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - began
                best = max(best, 2 * size**3 / seconds)
        del product
    return best


def peak(device: torch.device, dtype: str) -> float | None:
    """The host's peak FLOP/s in ``dtype`` on this process's threads: ``$OCTLM_PEAK_FLOPS``
    where set (None where 0), else from the cache, else measured now and cached. Processes of
    one host that ask at once measure it once (the cache file's lock)."""
    given = os.environ.get(PEAK_VARIABLE)
    if given is not None:
        try:
            rate = float(given)
        except ValueError:
            rate = -1.0
        if not rate >= 0:
            raise ValueError(f"${PEAK_VARIABLE} must be a number of FLOP/s >= 0, got {given!r}")
        return rate or None
    key = _key(device, dtype, torch.get_num_threads())
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # one measurement a host at a time
            cached = _read(path)
            if key not in cached:
                cached[key] = measure_peak(device, dtype)
                temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                temporary.write_text(json.dumps(cached, indent=2) + "\n")
                os.replace(temporary, path)
            return cached[key]
    except OSError:  # no writable cache (a read-only home): measured, not kept
        return measure_peak(device, dtype)


def _read(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(path.read_text())
        if isinstance(cached, dict):
            return {k: v for k, v in cached.items() if isinstance(v, int | float) and v > 0}
    return {}
