"""Test helpers: inputs, a float64 reference written independently of octlm, the verdict."""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from octlm.attention import IMPLEMENTATIONS, naive_attention, tiled_attention
from octlm.equality import judge


def make_qkv(
    batch=2, heads=4, kv_heads=2, q_len=33, k_len=None, head_size=32, dtype=torch.float32,
    seed=0, requires_grad=False,
):  # fmt: skip
    """Random query, key, value in the tested dtype (drawn in fp64, so every dtype sees the
    same numbers up to rounding)."""
    k_len = q_len if k_len is None else k_len
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, q_len, head_size)] + 2 * [(batch, kv_heads, k_len, head_size)]
    tensors = [torch.randn(s, generator=generator, dtype=torch.float64).to(dtype) for s in shapes]
    return [t.requires_grad_(requires_grad) for t in tensors]


def reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    window: int = 0,
    mask: Tensor | None = None,
    key_lengths: Tensor | None = None,
    scale: float | None = None,
    key_starts: Tensor | None = None,
    document_ids: Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention in float64 from the definition, sharing no code with octlm.

    Visibility is built from absolute positions: query row i is at position k_len - q_len + i,
    and belongs to that key's document. ``softcap`` bounds the scaled scores before anything is
    added; ``alibi_slopes`` adds -slope * distance; ``sinks`` are one extra logit per head in
    every row's softmax, with no value. With ``return_lse`` also the log of each row's
    softmax denominator, ``(B, H, Q)``, ``-inf`` where it is empty.
    """
    query, key, value = query.double(), key.double(), value.double()
    batch, heads, q_len, head_size = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    owner = torch.arange(heads) // (heads // kv_heads)  # kv head read by each query head
    key, value = key[:, owner], value[:, owner]
    scale = head_size**-0.5 if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", query, key) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    position = (k_len - q_len + torch.arange(q_len)).view(-1, 1)
    column = torch.arange(k_len).view(1, -1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().expand(batch, heads)[:, :, None, None]
        scores = scores - slopes * (position - column).abs()
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:
        visible = visible & (column <= position)
    if window:
        visible = visible & (position - column < window)
    visible = visible.expand(batch, heads, q_len, k_len)
    if key_lengths is not None:
        visible = visible & (column < key_lengths.view(-1, 1, 1, 1))
    if key_starts is not None:
        visible = visible & (column >= key_starts.view(-1, 1, 1, 1))
    if document_ids is not None:
        row_documents = document_ids[:, position.view(-1)]  # (B, Q)
        same = row_documents[:, :, None] == document_ids[:, None, :]  # (B, Q, K)
        visible = visible & same[:, None]
    if mask is not None and mask.dtype == torch.bool:
        visible = visible & mask
    elif mask is not None:
        scores = scores + mask.double()
        visible = visible & (mask.double() != float("-inf"))  # only -inf hides
    scores = torch.where(visible, scores, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.double().view(1, heads, 1, 1)
        top = torch.maximum(top, sink)
    top = torch.where(top.isinf(), torch.zeros_like(top), top)
    weights = (scores - top).exp()
    total = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + (sink - top).exp()
    weights = weights / torch.where(total == 0, torch.ones_like(total), total)
    if value.isfinite().all():
        out = torch.einsum("bhqk,bhkd->bhqd", weights, value)
    else:
        # A value a row cannot see must not reach it, even times a zero weight: sum term by term.
        terms = weights[..., None] * value[:, :, None]  # (B, H, Q, K, D)
        out = torch.where(visible[..., None], terms, 0.0).sum(dim=-2)
    if not return_lse:
        return out
    return out, (top + total.log()).squeeze(-1)


def assert_judged(tested: Tensor, base: Tensor, golden: Tensor, factor: float = 2.0) -> None:
    """docs/design.md, 'When are two results equal': within factor x the plain method's error (+
    atol) of the fp64 golden."""
    verdict = judge(tested, base, golden, factor=factor)
    assert verdict.passed, str(verdict)


def assert_like_reference(tested: Tensor, query: Tensor, key: Tensor, value: Tensor, **options):
    """``tested``, one call's output, judged against the float64 reference of the same call
    relative to naive's error on it (docs/design.md, 'When are two results equal')."""
    golden = reference(query, key, value, **options)
    assert_judged(tested, naive_attention(query, key, value, **options), golden)


def with_block(function, block):
    """``function`` (one that takes tiles) with its ``block`` bound."""
    return lambda *args, **kw: function(*args, block=block, **kw)


def tiled(block):
    """``tiled_attention`` with its ``block`` bound."""
    return with_block(tiled_attention, block)


def implementations_with(feature: str, block=(16, 32)) -> dict:
    """Every registered implementation that takes ``feature``, those with tiles given small
    blocks (so short inputs still cut into several)."""
    return {
        name: with_block(impl.function, block) if "block" in impl.tuning else impl.function
        for name, impl in IMPLEMENTATIONS.items()
        if feature in impl.features
    }


def once_per_session(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder ``name``, filled by ``build(folder)`` once per test session. pytest-xdist
    workers share it: a spawned process group costs seconds of CPU, and a module-scoped
    fixture alone would run again in every worker that draws one of the module's tests. The
    first worker to need the folder builds it while the others wait on its lock; a build that
    failed leaves no mark of completion, so the next worker builds it again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's folder, above each worker's own
    folder = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def spawn(worker, args: tuple, world: int, timeout: float, what: str) -> None:
    """Run ``worker(rank, *args)`` in ``world`` spawned processes and wait for all of them; the
    test fails, naming ``what``, if they have not finished after ``timeout`` seconds.

    The processes fork from a server that has imported torch, octlm and the worker's module
    once (forkserver): a fresh interpreter per rank would import them again, seconds of CPU
    each, and forking the test process itself would copy its threads' state."""
    mp.set_forkserver_preload(["tests.helpers", worker.__module__])
    context = mp.start_processes(
        worker, args=args, nprocs=world, join=False, start_method="forkserver"
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail(f"{what} did not finish in {timeout} s")


def join_gloo(rank: int, world: int, store: str) -> None:
    """Join, as ``rank`` of ``world``, the gloo group of spawned processes that meet at the file
    ``store``; one thread each, since the ranks share this machine's cores."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip


def trained_on_ranks(folder, corpus, plan: str, world: int, timeout: float):
    """Train every mode of ``plan`` (a test module whose ``mode_configs(corpus)`` maps each
    mode to a function giving its model and run configs) on ``world`` gloo ranks, one run
    folder per mode under ``folder``; each rank's failures must be none. Returns ``folder``."""
    import json

    spawn(_train_each_mode, (plan, str(corpus), str(folder), world), world, timeout, plan)
    for rank in range(world):
        failures = json.loads((folder / f"rank{rank}.json").read_text())
        assert not failures, f"rank {rank}: {failures}"
    return folder


def _train_each_mode(rank: int, plan: str, corpus: str, folder: str, world: int) -> None:
    """One rank's work for :func:`trained_on_ranks`, recording each mode's failure."""
    import importlib
    import json
    from pathlib import Path

    import torch.distributed as dist

    from octlm.training import train

    join_gloo(rank, world, f"{folder}/store")
    failures = {}
    for mode, config in importlib.import_module(plan).mode_configs(Path(corpus)).items():
        try:
            train(*config(), Path(folder, mode), progress=False)
        except Exception as error:  # reported by the test, with the mode that failed
            failures[mode] = f"{type(error).__name__}: {error}"
    dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(failures))
