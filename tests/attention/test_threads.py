"""Query blocks on CPU threads (octlm.attention.tiled.threads): the threads take the caller's modes,
leave PyTorch's thread count as they found it, and do not change results."""

import multiprocessing
import threading

import pytest
import torch

from octlm.attention import naive_attention, tiled_attention
from octlm.attention.tiled.core import Rules, Units
from octlm.attention.tiled.threads import parallel_map, workers
from octlm.attention.tiled.walk import BlockWalk
from tests.helpers import assert_judged, make_qkv, reference

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_items_run_on_single_threaded_workers_and_come_back_in_order(two_threads):
    def look(item):
        return item, threading.current_thread().name, torch.get_num_threads(), workers(CPU)

    results = parallel_map(look, list(range(6)), CPU)
    assert [item for item, *_ in results] == list(range(6))
    assert all(name.startswith("octlm-blocks") for _, name, _, _ in results)
    assert all(threads == 1 for _, _, threads, _ in results)
    assert all(nested == 1 for *_, nested in results)  # a call from a worker runs inline
    assert torch.get_num_threads() == 2


def test_fewer_items_than_threads_run_inline(two_threads):
    results = parallel_map(lambda _: threading.current_thread().name, [0], CPU)
    assert results == [threading.current_thread().name]


def test_an_error_in_a_block_is_raised_and_the_thread_count_restored(two_threads):
    def fail(item):
        if item == 3:
            raise ValueError("block 3")
        return item

    with pytest.raises(ValueError, match="block 3"):
        parallel_map(fail, list(range(6)), CPU)
    assert torch.get_num_threads() == 2


def test_workers_take_the_callers_grad_and_inference_modes(two_threads):
    def modes(_):
        return torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    with torch.no_grad():
        assert set(parallel_map(modes, [0, 1, 2], CPU)) == {(False, False)}
    with torch.inference_mode():
        assert set(parallel_map(modes, [0, 1, 2], CPU)) == {(False, True)}
    assert set(parallel_map(modes, [0, 1, 2], CPU)) == {(True, False)}


def test_tiled_under_inference_mode_matches_the_reference(two_threads):
    query, key, value = make_qkv(batch=1, heads=2, kv_heads=2, q_len=256, head_size=16)
    with torch.inference_mode():
        out = tiled_attention(query, key, value, block=32)
    assert_judged(out, naive_attention(query, key, value), reference(query, key, value))


def test_threaded_backward_is_reproducible_bit_for_bit(two_threads):
    """The key gradients are summed per group of query blocks and then in a fixed order, so
    which thread ran which group does not show in the result."""
    query, key, value = make_qkv(batch=1, heads=4, kv_heads=2, q_len=384, head_size=16)
    grad_out = torch.randn_like(query)

    def gradients():
        leaves = [x.clone().requires_grad_() for x in (query, key, value)]
        tiled_attention(*leaves, block=32).backward(grad_out)
        return [leaf.grad for leaf in leaves]

    first = gradients()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, gradients(), strict=True))
    torch.set_num_threads(1)  # inline: another grouping of the same sums
    inline = gradients()
    for threaded, alone in zip(first, inline, strict=True):
        torch.testing.assert_close(threaded, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [{"window": 48}, {"causal": False}, {"key_starts": torch.tensor([96, 130])}],
    ids=["window", "non-causal", "left-padding"],
)
def test_threaded_backward_runs_match_the_reference(two_threads, options):
    """Runs of query blocks, handed out to two threads, each sum their key gradients over
    the keys they see (an offset buffer, with a window or left padding) before the runs are
    added: every gradient is judged against the float64 reference."""
    inputs = make_qkv(batch=2, heads=4, kv_heads=2, q_len=320, head_size=16)
    grad_out = torch.randn(inputs[0].shape, dtype=torch.float64)

    def gradients(function, tensors):
        leaves = [x.detach().clone().requires_grad_() for x in tensors]
        function(*leaves, **options).backward(grad_out.to(leaves[0].dtype))
        return [leaf.grad for leaf in leaves]

    tested = gradients(lambda *a, **o: tiled_attention(*a, block=32, **o), inputs)
    base = gradients(naive_attention, inputs)
    golden = gradients(reference, [x.double() for x in inputs])
    for t, b, g in zip(tested, base, golden, strict=True):
        assert_judged(t, b, g, factor=3.0)


@pytest.mark.parametrize(
    "q_len, k_len, causal, window, runs",
    [
        (1024, 1024, True, 0, 4),  # early runs see few keys: 2.5 buffers of every key
        (1024, 1024, False, 0, 2),  # every run sees every key
        (256, 1024, True, 0, 2),  # a chunk after a cache: every run sees nearly every key
        (1024, 1024, True, 128, 4),  # a window: every run sees few keys
    ],
)
def test_the_backward_takes_more_runs_only_where_their_buffers_are_small(
    two_threads, q_len, k_len, causal, window, runs
):
    """Twice as many runs as threads when their key-gradient buffers add up to at most 1.25
    buffers of every key per thread, else one run per thread; the widest run first."""
    query = torch.zeros(1, 1, q_len, 1, 4)  # folded (B, Hkv, Q, G, D)
    keys = torch.zeros(1, 1, k_len, 4)
    rules = Rules(past=k_len - q_len, scale=1.0, causal=causal, window=window, block=(64, 64))
    walk = BlockWalk(query, keys, rules, Units(1.0))
    groups = walk.groups()
    assert len(groups) == runs
    assert sorted((rows for run in groups for rows in run), key=lambda rows: rows.start) == list(
        walk.query_blocks()
    )
    spans = [len(walk.key_span(range(run[0].start, run[-1].stop))) for run in groups]
    assert spans == sorted(spans, reverse=True)


def _child(queue):
    queue.put(parallel_map(lambda x: x * 2, [1, 2, 3], CPU))


def test_a_forked_child_starts_its_own_pool(two_threads):
    parallel_map(lambda x: x, [1, 2, 3], CPU)  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    assert queue.get(timeout=60) == [2, 4, 6]
    child.join(timeout=60)
    assert child.exitcode == 0


@pytest.mark.parametrize(
    "options",
    [
        {"document_ids": torch.tensor([[0] * 30 + [1] * 50 + [2] * 16, [0] * 70 + [1] * 26])},
        {"key_lengths": torch.tensor([96, 41]), "window": 24},
        {"mask": torch.randn(2, 1, 96, 96, generator=torch.Generator().manual_seed(1))},
    ],
    ids=["documents", "padding-window", "float-mask"],
)
def test_whole_tile_pieces_on_threads_match_the_reference_and_one_thread(two_threads, options):
    """A call computed whole (one tile per head) hands its pieces, each building its own part
    of the rules, to two threads: output and gradients are judged against the float64
    reference, and are the single-threaded run's to the last bit (a piece's work does not
    depend on the thread that runs it)."""
    inputs = make_qkv(batch=2, heads=4, kv_heads=2, q_len=96, head_size=16)
    grad_out = torch.randn(inputs[0].shape, dtype=torch.float64)

    def run(function, tensors):
        leaves = [x.detach().clone().requires_grad_() for x in tensors]
        out = function(*leaves, **options)
        out.backward(grad_out.to(out.dtype))
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    threaded = run(tiled_attention, inputs)
    base = run(naive_attention, inputs)
    golden = run(reference, [x.double() for x in inputs])
    for factor, t, b, g in zip((2.0, 3.0, 3.0, 3.0), threaded, base, golden, strict=True):
        assert_judged(t, b, g, factor=factor)
    torch.set_num_threads(1)
    for t, alone in zip(threaded, run(tiled_attention, inputs), strict=True):
        assert torch.equal(t, alone)
