"""``octlm bench``: one process and one record per measurement, whatever the worker does.

Tiny sizes only; each worker costs a Python start with torch. No timing is asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import replace

import pytest
import torch

from octlm import records
from octlm.attention.tiled import DEFAULT_BLOCK
from octlm.bench import driver
from octlm.bench.suites import SUITES, Grid, suite
from octlm.bench.worker import FAULT_ENV, flops
from octlm.cli import main

# DESIGN §5: the common fields, the benchmark record, and what issues 6 and 8 add.
COMMON = ["experiment", "time", "torch", "device", "threads", "host_cpu"]
BENCHMARK = [
    "backend", "mode", "dtype", "batch", "heads", "kv_heads", "head_size", "length", "causal",
    "window", "block", "status", "reason", "repeats", "seconds_median", "seconds_iqr",
    "memory_metric", "peak_bytes", "baseline_bytes", "extra_bytes", "pid",
]  # fmt: skip
ADDED = ["q_len", "padding", "tflops"]
TINY = Grid(backends=("flash",), lengths=(32,), heads=2, head_sizes=(16,), repeats=1)


def tiny(*backends: str, **changes):
    """Measurements of a tiny grid: float32, 2 heads of 16, 32 tokens."""
    return replace(TINY, backends=backends, **changes).measurements()


@pytest.fixture
def fake_probe(monkeypatch):
    """The driver's device probe without a child process."""
    context = {"torch": "x", "device": "cpu", "threads": 1, "host_cpu": "test", "experiment": "p"}
    monkeypatch.setattr(driver, "_probe", lambda device: {**context, "available_bytes": 2**30})


def test_each_measurement_has_its_own_worker_and_a_full_record(tmp_path):
    output = tmp_path / "bench.jsonl"
    argv = [
        "bench", "--backends", "math", "tiled", "efficient", "triton", "--lengths", "64",
        "--dtypes", "float32", "--heads", "2", "--head-size", "16", "--repeats", "2",
        "--q-len", "16", "--window", "8", "--padding", "0.25", "--output", str(output),
    ]  # fmt: skip
    assert main(argv) == 0
    rows = list(records.read(output))
    assert [r["backend"] for r in rows] == ["math", "tiled", "efficient", "triton"]
    for row in rows:
        assert {*COMMON, *BENCHMARK, *ADDED} <= row.keys()
        assert (row["q_len"], row["length"], row["window"], row["padding"]) == (16, 64, 8, 0.25)
        assert row["memory_metric"] == "ru_maxrss"
    math_row, tiled_row, efficient, triton = rows
    assert len({r["pid"] for r in rows}) == 4 and os.getpid() not in {r["pid"] for r in rows}
    for row in (math_row, tiled_row):
        assert row["status"] == "ok", row["reason"]
        assert row["extra_bytes"] == row["peak_bytes"] - row["baseline_bytes"]
        assert len(row["seconds"]) == 2 and row["tflops"] > 0
    assert tiled_row["block"] == list(DEFAULT_BLOCK) and math_row["block"] is None
    assert efficient["status"] == "unsupported"
    assert "efficient" in efficient["reason"] and "backend" in efficient["reason"]
    assert triton["status"] == "unsupported" and "CUDA" in triton["reason"]


def test_crashing_workers_become_records_and_the_run_goes_on(tmp_path, fake_probe, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill:naive,raise:math,oom:tiled")
    output = tmp_path / "bench.jsonl"
    assert driver.run(tiny("naive", "math", "tiled"), output, timeout=120) == 0
    status = {r["backend"]: (r["status"], r["reason"]) for r in records.read(output)}
    assert status == {
        "naive": ("oom", "worker killed by SIGKILL, as the kernel's OOM killer does"),
        "math": ("error", "RuntimeError: test fault"),
        "tiled": ("oom", "MemoryError: test fault"),
    }


def test_a_worker_past_its_timeout_is_killed_and_recorded(tmp_path, fake_probe):
    output = tmp_path / "bench.jsonl"
    # No worker imports torch in a tenth of a second: both time out, and both are recorded.
    assert driver.run(tiny("flash", "tiled"), output, timeout=0.1) == 0
    rows = list(records.read(output))
    assert [r["status"] for r in rows] == ["timeout", "timeout"]
    assert all("0.1 s" in r["reason"] and r["pid"] for r in rows)


def test_memory_guard_skips_math_that_cannot_fit_without_launching(
    tmp_path, fake_probe, monkeypatch
):
    def launched(*args):
        raise AssertionError("a worker was launched for a measurement that cannot fit")

    monkeypatch.setattr(driver, "_spawn", launched)
    output = tmp_path / "bench.jsonl"
    huge = tiny("math", "naive", lengths=(2**20,), modes=("forward", "train"))
    assert driver.run(huge, output) == 0
    rows = list(records.read(output))
    assert len(rows) == 4
    for row in rows:
        assert row["status"] == "skipped" and row["pid"] is None
        assert "GiB" in row["reason"] and "MemAvailable" in row["reason"]


def test_resume_skips_settled_measurements_and_reruns_failed_ones(
    tmp_path, fake_probe, monkeypatch
):
    measurements = tiny("math", "flash", "efficient", "tiled")
    output = tmp_path / "bench.jsonl"
    probe = driver._probe("cpu")
    for m, status in zip(measurements, ("ok", "skipped", "unsupported", "timeout"), strict=True):
        records.append(output, driver._failure(m, probe, "earlier", 1, status, "earlier"))
    ran = []

    def spawn(m, *args):
        ran.append(m)
        return driver._failure(m, probe, "later", 2, "ok", None)

    monkeypatch.setattr(driver, "_spawn", spawn)
    assert driver.run(measurements, output, resume=True) == 0
    assert ran == measurements[3:]
    assert len(list(records.read(output))) == 5
    ran.clear()
    assert driver.run(measurements, output, resume=True) == 0
    assert ran == []


def test_ctrl_c_kills_the_worker_and_keeps_finished_lines(tmp_path, fake_probe, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "sleep:tiled")
    workers = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            workers.append(self)

    returned = threading.Event()

    def press_ctrl_c():
        while len(workers) < 2 and not returned.is_set():  # flash is done; tiled sleeps
            time.sleep(0.1)
        time.sleep(0.5)
        if not returned.is_set():  # never interrupt pytest itself
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(driver.subprocess, "Popen", Recorded)
    output = tmp_path / "bench.jsonl"
    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        code = driver.run(tiny("flash", "tiled"), output)
    finally:
        returned.set()
    assert code == 130
    assert [r["backend"] for r in records.read(output)] == ["flash"]
    assert workers[1].poll() == -signal.SIGKILL


def test_suites_expand_to_the_issue_grids():
    seed = suite("seed")
    assert len(seed) == 4 * 2 * 5 + 4  # five backends in two dtypes, and the seed's sketch
    assert {m.dtype for m in seed if m.backend == "sketch"} == {"float32"}
    assert {m.length for m in seed} == {1024, 2048, 4096, 8192}
    assert {(m.batch, m.heads, m.head_size, m.mode, m.causal) for m in seed} == {
        (1, 8, 32, "forward", True)
    }
    train = suite("train")
    assert {m.backend for m in train if m.length == 16384} == {"math", "flash", "tiled"}
    structure = {(m.q_len, m.length, m.window, m.padding, m.mode) for m in suite("structure")}
    assert structure == {
        (8192, 8192, 512, 0.0, "forward"), (8192, 8192, 512, 0.0, "train"),
        (1024, 8192, 0, 0.0, "forward"), (1, 8192, 0, 0.0, "forward"),
        (8192, 8192, 0, 0.5, "forward"),
    }  # fmt: skip
    assert {m.device for m in suite("cuda")} == {"cuda"}
    assert set(SUITES) == {"seed", "train", "structure", "cuda"}


def test_overrides_replace_the_suite_values_and_bad_ones_name_the_option():
    measurements = suite("seed", lengths=(64,), dtypes=("float32",), repeats=1)
    assert {(m.length, m.dtype, m.repeats) for m in measurements} == {(64, "float32", 1)}
    with pytest.raises(ValueError, match="backends"):
        suite("seed", backends=("fast",))
    with pytest.raises(ValueError, match="paddings"):
        suite("seed", paddings=(1.0,))
    with pytest.raises(ValueError, match="suite"):
        suite("nightly")


def test_command_line_fills_the_suite_and_names_the_default_output(monkeypatch):
    calls = []

    def run(measurements, output, **options):
        calls.append((measurements, output, options))
        return 0

    monkeypatch.setattr(driver, "run", run)
    assert main(["bench", "--suite", "structure", "--lengths", "512", "--block", "64"]) == 0
    [(measurements, output, options)] = calls
    assert str(output) == os.path.join("runs", "bench-structure-cpu.jsonl")
    assert options == {"experiment": "bench-structure", "timeout": 600.0, "resume": False}
    assert {m.block for m in measurements if m.backend == "tiled"} == {(64, 64)}
    assert {m.length for m in measurements} == {512}


def test_bad_options_exit_2_and_name_the_option(capsys):
    assert main(["bench", "--padding", "1.5"]) == 2
    assert "--padding" in capsys.readouterr().err
    assert main(["bench", "--block", "0"]) == 2
    assert "block" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_any_measurement(tmp_path, capsys):
    output = tmp_path / "bench.jsonl"
    assert main(["bench", "--suite", "cuda", "--lengths", "64", "--output", str(output)]) == 2
    assert "--device" in capsys.readouterr().err
    assert not output.exists()


def test_flops_follow_flash_attentions_count():
    [square] = tiny("flash", lengths=(64,))
    assert flops(square) == 4 * 1 * 2 * 64 * 64 * 16 / 2
    assert flops(replace(square, mode="train")) == 3.5 * flops(square)
    assert flops(replace(square, q_len=1)) == 4 * 1 * 2 * 1 * 64 * 16


def test_the_seed_sketch_runs_forward_only_and_matches_the_reference():
    from octlm.attention import naive_attention
    from octlm.bench.sketch import seed_sketch
    from octlm.bench.worker import measure

    forward, train = tiny("sketch", modes=("forward", "train"))
    assert measure(forward)["status"] == "ok"
    assert measure(train)["status"] == "unsupported"
    query, key, value = torch.randn(3, 1, 2, 70, 16, dtype=torch.float64)
    torch.testing.assert_close(
        seed_sketch(query, key, value, block=16), naive_attention(query, key, value)
    )


def test_cuda_memory_and_timing_use_the_allocator_and_synchronise(monkeypatch):
    """The CUDA path's logic, on a machine without one: torch.cuda stands in, and the probes
    must reset the peak before the call, read max_memory_allocated after, never RSS, and the
    timer must synchronise on both sides of the step."""
    from octlm.bench import memory
    from octlm.bench.worker import _timed

    calls = []
    fake = {
        "synchronize": lambda device=None: calls.append("sync"),
        "reset_peak_memory_stats": lambda device=None: calls.append("reset"),
        "memory_allocated": lambda device=None: 100,
        "max_memory_allocated": lambda device=None: 350,
        "mem_get_info": lambda device=None: (7 * 2**30, 8 * 2**30),
    }
    for name, function in fake.items():
        monkeypatch.setattr(torch.cuda, name, function)
    assert memory.metric("cuda") == "cuda_max_allocated" and memory.metric("cpu") == "ru_maxrss"
    assert memory.baseline("cuda") == 100 and calls == ["sync", "reset"]
    assert memory.peak("cuda") == 350
    assert memory.available("cuda") == 7 * 2**30
    calls.clear()
    _timed(lambda: calls.append("step"), torch.device("cuda"))
    assert calls == ["sync", "step", "sync"]
