"""The benchmark figures: each call timed on its own between fences, and the rates of the records
equal an operation count made independently of octlm (PyTorch's FLOP counter) over the time."""

import types
from dataclasses import replace

import pytest
import torch

from octlm.lab.bench import timing, worker
from octlm.lab.bench.suites import Grid

TICK = 0.25  # seconds the fake clock moves at every reading


@pytest.fixture
def clock(monkeypatch):
    """A clock that moves TICK at every reading, so a call timed between two readings lasts
    exactly TICK, whatever the machine does meanwhile."""
    now = {"wall": 0.0, "cpu": 0.0}

    def reading(name):
        def read():
            now[name] += TICK
            return now[name]

        return read

    fake = types.SimpleNamespace(perf_counter=reading("wall"), process_time=reading("cpu"))
    monkeypatch.setattr(timing, "time", fake)


def test_each_call_is_timed_alone_between_fences_after_untimed_warmups(clock):
    events = []
    timed = timing.time_calls(
        lambda: events.append("call"), 3, warmup=2, fence=lambda: events.append("fence")
    )
    assert events == ["call"] * 2 + ["fence", "call", "fence"] * 3
    assert timed.seconds == [TICK] * 3
    assert timed.wall_seconds >= sum(timed.seconds)


def test_the_matmul_peak_is_the_counted_operations_over_the_median_time(clock):
    # Imported here: torch's FLOP counter imports Triton, which must wait for test_triton.py
    # to switch its CPU interpreter on.
    from torch.utils.flop_counter import FlopCounterMode

    size = 64
    a, b = torch.ones(size, size), torch.ones(size, size)
    with FlopCounterMode(display=False) as counter:
        torch.mm(a, b)
    record = worker.matmul_peak("test", run="r", size=size)
    assert record["kind"] == "peak" and record["run"] == "r" and record["size"] == size
    assert record["seconds"] == [TICK] * worker.PEAK_REPEATS
    assert record["gflops"] == pytest.approx(counter.get_total_flops() / TICK / 1e9)


def shapes(measurement):
    """Query, key and value shapes of a measurement."""
    m = measurement
    return (
        (m.batch, m.heads, m.q_len, m.head_size),
        (m.batch, m.kv_heads, m.length, m.head_size),
        (m.batch, m.kv_heads, m.length, m.head_size),
    )


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_a_measurements_rate_counts_what_pytorch_counts_for_attention(mode, clock):
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    """Full (non-causal) attention: SDPA's forward, and in training its backward too, as
    PyTorch's FLOP counter counts them; the record's tflops is that count over the time."""
    [m] = replace(
        Grid(backends=("math",), lengths=(32,), heads=4, kv_heads=2, head_sizes=(16,)),
        causal=False, modes=(mode,), repeats=1,
    ).measurements()  # fmt: skip
    counted = sdpa_flop_count(*shapes(m))
    if mode == "train":
        counted += sdpa_backward_flop_count(shapes(m)[0], *shapes(m))
    assert worker.flops(m) == counted
    record = worker.measure(m)
    assert record["status"] == "ok" and record["seconds_median"] == TICK
    assert record["tflops"] == pytest.approx(counted / TICK / 1e12)


def test_causal_attention_counts_at_most_the_pairs_a_row_sees():
    """Square causal attention computes only the visible (query, key) pairs: between half of
    the full count and the visible share, (T + 1) / 2T."""
    grid = Grid(backends=("math",), lengths=(8,), heads=2, head_sizes=(4,))
    [causal] = grid.measurements()
    full = worker.flops(replace(causal, causal=False))
    length = causal.length
    assert full / 2 <= worker.flops(causal) <= full * (length + 1) / (2 * length)
    [chunk] = replace(grid, q_lens=(1,)).measurements()  # one query: it sees every key
    assert worker.flops(chunk) == worker.flops(replace(chunk, causal=False))
