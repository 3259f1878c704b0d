"""Independent blocks of work on CPU threads, each thread running single-threaded ops: no
OpenMP barrier between the block loop's small ops, and a thread slowed by another process
simply takes fewer blocks (why: docs/design.md, 'The numerics of the tiled core', threads).

While such a call runs, PyTorch's intra-op thread count is 1 (the worker threads are set once
and keep it); it is restored when the last concurrent call ends.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_inside = 0  # calls now running their blocks on the pool
_saved_threads = 0  # the intra-op thread count to restore when the last of them ends
_worker = threading.local()  # marks the pool's own threads: a nested call runs inline


def parallel_map(
    function: Callable[[Item], Result], items: Sequence[Item], device: torch.device
) -> list[Result]:
    """``[function(item) for item in items]``, spread over the CPU's threads.

    Runs inline (with PyTorch's usual intra-op parallelism) for non-CPU devices, with one
    thread, when there are fewer items than threads (decoding one token is one block: its ops
    are better split across cores), and from inside a worker. ``function`` must be safe to run
    concurrently on different items; results come back in the order of ``items``, and items
    are started in that order (put the largest first).
    """
    threads = workers(device)
    if threads < 2 or len(items) < threads:
        return [function(item) for item in items]
    pool = _enter(threads)
    try:
        return list(pool.map(_in_callers_modes(function), items))
    finally:
        _leave()


def _in_callers_modes(function: Callable[[Item], Result]) -> Callable[[Item], Result]:
    """``function`` run under the caller's grad, inference and CPU autocast modes, which are
    per thread: a worker would otherwise record autograd graphs inside a custom autograd
    function's forward, or write into inference tensors from outside inference mode."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocast = torch.is_autocast_enabled("cpu")
    autocast_dtype = torch.get_autocast_dtype("cpu")

    def run(item: Item) -> Result:
        with (
            torch.inference_mode(inference),
            torch.set_grad_enabled(grad),
            torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast),
        ):
            return function(item)

    return run


def workers(device: torch.device) -> int:
    """How many threads :func:`parallel_map` would use on ``device``: 1 means inline."""
    if device.type != "cpu" or getattr(_worker, "active", False):
        return 1
    return torch.get_num_threads()


def _mark_worker() -> None:
    _worker.active = True


def _enter(threads: int) -> ThreadPoolExecutor:
    """Make intra-op parallelism 1 for the duration of a call; the pool for ``threads``."""
    global _pool, _pool_size, _inside, _saved_threads
    with _lock:
        if _inside == 0:
            _saved_threads = threads
            torch.set_num_threads(1)
        _inside += 1
        if _pool is None or _pool_size != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            # A worker's first op fixes its own thread count, from the 1 set above.
            _pool = ThreadPoolExecutor(threads, "octlm-blocks", initializer=_mark_worker)
            _pool_size = threads
        return _pool


def _leave() -> None:
    global _inside
    with _lock:
        _inside -= 1
        if _inside == 0:
            torch.set_num_threads(_saved_threads)


def _forget_pool() -> None:
    """A forked child has none of the parent's threads: it starts its own pool."""
    global _pool, _pool_size, _inside, _lock
    _pool, _pool_size, _inside, _lock = None, 0, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)
