"""Ring attention and context-parallel model equal their single-process counterparts.

Each world size (2 and 4) is one group of gloo processes on this CPU, spawned once per session:
the workers run every check and write one JSON file per rank; the tests below read them. A
spawn costs seconds, a check milliseconds, so checks are batched rather than spawned apiece.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from octlm.attention import naive_attention, ring_attention
from octlm.attention.ring import _visible_pairs
from octlm.context_parallel import (
    context_parallel_forward,
    context_parallel_loss,
    gather_logits,
    gather_sequence,
    reduce_gradients,
    shard_pieces,
    shard_positions,
    shard_sequence,
)
from octlm.equality import GRADIENT_FACTOR, OUTPUT_FACTOR, judge, max_abs_diff
from octlm.model import ModelConfig, OctLM
from tests.helpers import join_gloo, make_qkv, once_per_session, reference, spawn

pytestmark = pytest.mark.distributed

WORLDS = (2, 4)
LENGTH = 48  # splits into 2W chunks for W = 2 and 4
BLOCK = (4, 8)  # small tiles, so pieces span several blocks and edge blocks get masked
SPAWN_TIMEOUT = 240.0

# name: (dtype, causal, window, layout, heads, kv_heads)
ATTENTION_CASES = {
    "causal-zigzag-mha-float64": (torch.float64, True, 0, "zigzag", 2, 2),
    "causal-plain-gqa-float64": (torch.float64, True, 0, "plain", 4, 2),
    "full-zigzag-gqa-float64": (torch.float64, False, 0, "zigzag", 4, 2),
    "full-plain-mqa-float64": (torch.float64, False, 0, "plain", 4, 1),
    "window-zigzag-gqa-float64": (torch.float64, True, 5, "zigzag", 4, 2),
    "window-plain-gqa-float64": (torch.float64, True, 7, "plain", 4, 2),
    "causal-zigzag-gqa-float32": (torch.float32, True, 0, "zigzag", 4, 2),
    "causal-zigzag-gqa-bfloat16": (torch.bfloat16, True, 0, "zigzag", 4, 2),
}
# Packed documents that cross every shard edge, and documents of one token; the second row
# differs from the first, so a shard pair can share a document in one row and not the other.
DOCUMENT_IDS = torch.stack([
    torch.repeat_interleave(torch.arange(6), torch.tensor([1, 10, 7, 1, 20, 9])),
    torch.repeat_interleave(torch.arange(4), torch.tensor([13, 1, 1, 33])),
])  # (2, LENGTH)  # fmt: skip
# name: the structure and score keywords, on the whole sequence (the same on every rank)
FEATURES = {
    "documents": lambda heads: {"document_ids": DOCUMENT_IDS},
    "modifiers": lambda heads: {
        "softcap": 2.0,
        "alibi_slopes": torch.linspace(0.05, 0.4, 2 * heads, dtype=torch.float64).view(2, heads),
        "sinks": torch.linspace(-1.0, 2.0, heads, dtype=torch.float64),
    },
}
FEATURES["everything"] = lambda heads: FEATURES["documents"](heads) | FEATURES["modifiers"](heads)
# name: (attention case as above, features)
STRUCTURE_CASES = {
    "documents-causal-zigzag-gqa-float64": ((torch.float64, True, 0, "zigzag", 4, 2), "documents"),
    "documents-full-plain-mqa-float64": ((torch.float64, False, 0, "plain", 4, 1), "documents"),
    "modifiers-causal-zigzag-gqa-float64": ((torch.float64, True, 0, "zigzag", 4, 2), "modifiers"),
    "everything-window-plain-gqa-float32": ((torch.float32, True, 9, "plain", 4, 2), "everything"),
}
MODEL_WINDOWS = (0, 10)
# name: what the error must say on every rank ("{last}" = the last rank, the odd one out)
ERROR_CASES = {
    "unequal-shards": ("differ in query shape", "rank 0: (2, 4, 8, 8)", "(2, 4, 12, 8)"),
    "odd-zigzag-shard": ("refused on every rank", "even, got 7"),
    "keys-not-queries": ("refused on every rank", "same positions"),
    "dtype": ("differ in dtype", "rank 0: torch.float16", "torch.bfloat16"),
    "window": ("differ in window", "rank {last}: 3"),
    "layout": ("differ in layout", "rank {last}: plain"),
    "causal": ("differ in causal", "rank {last}: False"),
    "scale": ("differ in scale", "rank {last}: 0.5"),
    "mask-on-one-rank": ("refused on every rank", "rank {last}: ValueError: ring_attention takes"),
    "documents-on-one-rank": ("differ in document_ids", "rank {last}: (2, 8)"),
}


def _attention_check(rank: int, world: int, case: tuple, features: str | None = None) -> str | None:
    """Ring output and gradients vs the fp64 reference on the whole sequence; None if equal.

    With ``features``, also the structure and score keywords of :data:`FEATURES`: document
    ids are sharded like the sequence, and the gradients of ALiBi slopes and sinks (each
    rank's share) are summed over the ranks before they are judged.
    """
    dtype, causal, window, layout, heads, kv_heads = case
    inputs = make_qkv(heads=heads, kv_heads=kv_heads, q_len=LENGTH, head_size=8, dtype=dtype)
    grad_out = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    grad_out = grad_out.to(dtype)  # (B, H, T, D), the same on every rank
    given = FEATURES[features](heads) if features else {}
    learned = [name for name in ("alibi_slopes", "sinks") if name in given]

    def leaves(tensors, precision):
        return [t.detach().to(precision).clone().requires_grad_() for t in tensors]

    def with_leaves(precision):  # the keywords, slopes and sinks as fresh leaves
        return given | {name: leaves([given[name]], precision)[0] for name in learned}

    def full_result(attend, precision):
        tensors = leaves(inputs, precision)
        extra = with_leaves(precision)
        out = attend(*tensors, causal=causal, window=window, **extra)
        out.backward(grad_out.to(out.dtype))
        return [out.detach()] + [t.grad for t in tensors + [extra[n] for n in learned]]

    golden = full_result(reference, torch.float64)
    base = full_result(naive_attention, dtype)
    local = [shard_sequence(t, rank, world, layout).requires_grad_() for t in inputs]
    extra = with_leaves(dtype)
    if "document_ids" in given:
        extra["document_ids"] = shard_sequence(given["document_ids"], rank, world, layout, dim=1)
    out = ring_attention(
        *local, causal=causal, window=window, layout=layout, block=BLOCK, **extra
    )  # fmt: skip
    out.backward(shard_sequence(grad_out, rank, world, layout))
    tested = [gather_sequence(t, layout=layout) for t in [out.detach()] + [t.grad for t in local]]
    for name in learned:  # each rank holds its own rows' share
        dist.all_reduce(extra[name].grad)
        tested.append(extra[name].grad)

    failures = []
    names = ("out", "dq", "dk", "dv", *(f"d{name}" for name in learned))
    for name, tensors in zip(names, zip(tested, base, golden, strict=True), strict=True):
        verdict = judge(*tensors, factor=OUTPUT_FACTOR if name == "out" else GRADIENT_FACTOR)
        if not verdict.passed:
            failures.append(f"{name}: {verdict}")
    return "; ".join(failures) or None


def _model_check(rank: int, world: int, window: int) -> str | None:
    """Sharded logits, loss and summed parameter gradients vs one process, in float64."""
    config = ModelConfig(
        vocab_size=64, width=32, n_layers=2, n_heads=4, n_kv_heads=2, max_length=LENGTH,
        attention="ring", window=window,
    )  # fmt: skip
    torch.manual_seed(0)
    model = OctLM(config).double()
    single = OctLM(replace(config, attention="naive")).double()
    single.load_state_dict(model.state_dict())
    tokens = torch.randint(64, (2, LENGTH + 1), generator=torch.Generator().manual_seed(2))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each

    logits = single(inputs)  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    with torch.no_grad():
        local_logits = gather_logits(context_parallel_forward(model, inputs))  # (B, T, V)
    local_loss = context_parallel_loss(model, inputs, targets)
    local_loss.backward()
    reduce_gradients(model)
    summed_loss = local_loss.detach().clone()
    dist.all_reduce(summed_loss)

    differences = {
        "logits": max_abs_diff(local_logits, logits),
        "loss": abs(summed_loss.item() - loss.item()),
    }
    for (name, parameter), (_, expected) in zip(
        model.named_parameters(), single.named_parameters(), strict=True
    ):
        differences[name] = max_abs_diff(parameter.grad, expected.grad)
    failures = [f"{name} off by {diff:.3g}" for name, diff in differences.items() if diff > 1e-10]
    return "; ".join(failures) or None


def _error_check(rank: int, world: int, case: str) -> str | None:
    """The bad call must raise one ValueError on every rank, so that no rank returns garbage
    computed under other rules than its peers' or waits on a peer that has given up."""
    last = rank == world - 1
    length = {"unequal-shards": 8 + 4 * rank, "odd-zigzag-shard": 7}.get(case, 8)
    dtype = {"dtype": torch.float16 if rank == 0 else torch.bfloat16}.get(case, torch.float64)
    query, key, value = make_qkv(q_len=length, head_size=8, dtype=dtype)
    if case == "keys-not-queries":
        key, value = key[:, :, :4], value[:, :, :4]
    options = {
        "window": {"window": 3 if last else 0},
        "layout": {"layout": "plain" if last else "zigzag"},
        "causal": {"causal": not last},
        "scale": {"scale": 0.5 if last else None},
        "mask-on-one-rank": {"mask": torch.ones(8, 8, dtype=torch.bool) if last else None},
        "documents-on-one-rank": {
            "document_ids": torch.zeros(2, 8, dtype=torch.long) if last else None
        },
    }.get(case, {})
    try:
        ring_attention(query, key, value, **options)
    except ValueError as error:
        words = [word.format(last=world - 1) for word in ERROR_CASES[case]]
        missing = [word for word in words if word not in str(error)]
        return f"message lacks {missing}: {error}" if missing else None
    return "no ValueError raised"


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    join_gloo(rank, world, init_file)
    results = {}
    for name, case in ATTENTION_CASES.items():
        results[f"attention/{name}"] = _attention_check(rank, world, case)
    for name, (case, features) in STRUCTURE_CASES.items():
        results[f"structure/{name}"] = _attention_check(rank, world, case, features)
    for window in MODEL_WINDOWS:
        results[f"model/window{window}"] = _model_check(rank, world, window)
    for case in ERROR_CASES:
        results[f"error/{case}"] = _error_check(rank, world, case)
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"world{world}")
def ring_results(request, tmp_path_factory) -> list[dict]:
    """Every rank's ``{check: None or what failed}`` for one world size, from one group of
    ranks per test session."""
    world = request.param

    def run(folder: Path) -> None:
        args = (world, str(folder / "store"), str(folder))
        spawn(_worker, args, world, SPAWN_TIMEOUT, f"ring workers (world {world})")

    folder = once_per_session(tmp_path_factory, f"ring{world}", run)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


# Each check the workers run, by the name they record it under.
CHECKS = (
    [f"attention/{name}" for name in ATTENTION_CASES]
    + [f"structure/{name}" for name in STRUCTURE_CASES]
    + [f"model/window{window}" for window in MODEL_WINDOWS]
    + [f"error/{case}" for case in ERROR_CASES]
)


@pytest.mark.parametrize("check", CHECKS)
def test_every_rank_passes_the_check(ring_results, check):
    """attention/ and structure/ (documents, modifiers): ring attention matches the reference;
    model/: the context-parallel model matches one process; error/: a bad or mismatched call
    raises on every rank."""
    failures = {rank: r[check] for rank, r in enumerate(ring_results) if r[check] is not None}
    assert not failures, f"{check}: {failures}"


def test_ring_attention_without_process_group_raises():
    query, key, value = make_qkv(q_len=8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(query, key, value)


def test_unknown_layout_raises():
    query, key, value = make_qkv(q_len=8)
    with pytest.raises(ValueError, match="layout"):
        ring_attention(query, key, value, layout="striped")
    with pytest.raises(ValueError, match="layout"):
        shard_positions(8, 0, 2, "striped")


@pytest.mark.parametrize("layout, length", [("zigzag", 12), ("plain", 10)])
def test_length_the_layout_cannot_split_raises(layout, length):
    with pytest.raises(ValueError, match=f"sequence length {length}"):
        shard_sequence(torch.zeros(1, 1, length, 2), 0, 4, layout)


def test_shard_pairs_that_share_no_document_are_skipped():
    """Zigzag over 2 ranks, 16 tokens in 4 documents of 4 (one per chunk): rank 0 holds chunks
    0 and 3, rank 1 chunks 1 and 2, so rank 0's queries share no document with rank 1's keys
    and no pair is attended, where without documents all four would be."""
    ids = torch.arange(16).div(4, rounding_mode="floor").unsqueeze(0)  # (1, 16)
    options = {"causal": False, "window": 0}
    queries, keys = shard_pieces(0, 2, "zigzag", 8), shard_pieces(1, 2, "zigzag", 8)
    shard = [shard_sequence(ids, rank, 2, "zigzag", dim=1) for rank in (0, 1)]  # (1, 8) each
    assert len(list(_visible_pairs(queries, keys, options, None, None))) == 4
    assert not list(_visible_pairs(queries, keys, options, *shard))
    own = list(_visible_pairs(queries, queries, options, shard[0], shard[0]))
    assert [(q.start, k.start) for q, k, _, _ in own] == [(0, 0), (12, 12)]


def test_shard_positions_cover_the_sequence_once():
    world = 4
    zigzag = [shard_positions(16, rank, world, "zigzag").tolist() for rank in range(world)]
    assert zigzag[0] == [0, 1, 14, 15] and zigzag[3] == [6, 7, 8, 9]
    assert sorted(p for shard in zigzag for p in shard) == list(range(16))
    assert shard_positions(16, 1, world, "plain").tolist() == [4, 5, 6, 7]


def test_shard_sequence_follows_shard_positions():
    x = torch.arange(16.0).view(1, 1, 16, 1)  # (B, H, T, D), value = position
    for rank in range(4):
        shard = shard_sequence(x, rank, 4, "zigzag")  # (1, 1, 4, 1)
        assert shard.flatten().tolist() == shard_positions(16, rank, 4).tolist()


def test_context_parallel_forward_needs_ring_attention():
    model = OctLM(ModelConfig(vocab_size=16, width=16, n_layers=1, n_heads=2, max_length=8))
    with pytest.raises(ValueError, match="attention='ring'"):
        context_parallel_forward(model, torch.zeros(1, 8, dtype=torch.int64))
