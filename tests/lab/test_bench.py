"""``octlm bench``: one process and one record per measurement, whatever the worker does.

Tiny sizes only; each worker costs a Python start with torch. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from octlm import records
from octlm.attention.tiled.options import DEFAULT_BLOCK
from octlm.cli import main
from octlm.lab.bench import driver, ring, worker
from octlm.lab.bench.suites import FEATURES, Grid, Measurement, suite
from octlm.lab.bench.worker import FAULT_ENV, FAULT_READY_ENV

# docs/design.md, 'Records': the common fields, the benchmark record, and the fields added since.
COMMON = ["kind", "run", "experiment", "time", "torch", "device", "threads", "host_cpu", "cpus"]
COMMON += ["cpu_flags", "memory_bytes"]  # the machine, so that reports keep machines apart
BENCHMARK = [
    "backend", "mode", "dtype", "batch", "heads", "kv_heads", "head_size", "length", "causal",
    "window", "block", "status", "reason", "repeats", "seconds_median", "seconds_iqr",
    "memory_metric", "peak_bytes", "baseline_bytes", "extra_bytes", "pid",
]  # fmt: skip
ADDED = ["q_len", "padding", "tflops", "busy", "round", "signal", "load_before", "cpu_seconds"]
TINY = Grid(backends=("flash",), lengths=(32,), heads=2, head_sizes=(16,), repeats=1)


def tiny(*backends: str, **changes):
    """Measurements of a tiny grid: float32, 2 heads of 16, 32 tokens."""
    return replace(TINY, backends=backends, **changes).measurements()


# What the driver's device probe reports, made up: tests that are not about the probe take it
# without the child process (a Python start with torch) that asks the device.
PROBED = {"torch": "x", "device": "cpu", "threads": 1, "host_cpu": "test", "available_bytes": 2**30}


@pytest.fixture
def fake_probe(monkeypatch):
    """The driver's device probe without a child process."""
    monkeypatch.setattr(driver, "_probe", lambda device: dict(PROBED))


@pytest.fixture
def fake_spawn(monkeypatch):
    """Workers that record an ok measurement at once; the list holds (round, measurement)."""
    ran = []

    def spawn(m, probe, timeout, **where):
        ran.append((where["round"], m))
        return measured(m, probe, **where)

    monkeypatch.setattr(driver, "_spawn", spawn)
    return ran


def measured(m, probe, **where) -> dict:
    """An ok record with made-up figures, as a worker would print it."""
    figures = dict(seconds_median=0.1, extra_bytes=1, peak_bytes=2)
    return driver._failure(m, probe, 2, "ok", None, **figures, **{"experiment": "x", **where})


def children(pid: int) -> dict[int, str]:
    """Living child processes of ``pid``: their command lines, by pid (Linux /proc). A child
    just started may not show its command line yet: poll, or wait on a signal of its own."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's reaping is left


def test_each_measurement_has_its_own_worker_and_a_full_record(tmp_path):
    output = tmp_path / "bench.jsonl"
    argv = [
        "bench", "baseline", "--backends", "math", "tiled", "efficient", "triton",
        "--lengths", "64", "--dtypes", "float32", "--heads", "2", "--head-size", "16",
        "--repeats", "2", "--q-len", "16", "--window", "8", "--padding", "0.25",
        "--output", str(output), "--no-peak",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = [r for r in records.read(output) if r["kind"] == "bench"]
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
        assert row["kind"] == "bench" and row["round"] == 1 and row["busy"] is False
        # the process's own clocks span the timed calls; the load average is the system's
        assert row["wall_seconds"] >= sum(row["seconds"]) and row["cpu_seconds"] > 0
        assert row["load_before"] >= 0 and row["cpus"] == os.cpu_count()
    peak = [r for r in records.read(output) if r["kind"] == "peak"]
    assert peak == [] and len({r["run"] for r in rows}) == 1  # --no-peak; one run id
    assert tiled_row["block"] == list(DEFAULT_BLOCK) and math_row["block"] is None
    assert efficient["status"] == "unsupported"
    assert "efficient" in efficient["reason"] and "backend" in efficient["reason"]
    assert triton["status"] == "unsupported" and "CUDA" in triton["reason"]


def test_crashing_workers_become_records_and_the_run_goes_on(tmp_path, fake_probe, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill:naive,raise:math,oom:tiled")
    monkeypatch.setattr(driver, "_oom_kills", lambda: 7)  # the OOM killer does nothing
    output = tmp_path / "bench.jsonl"
    assert driver.run(tiny("naive", "math", "tiled"), output, timeout=120, peak=False) == 0
    status = {r["backend"]: (r["status"], r["reason"], r["signal"]) for r in records.read(output)}
    assert status == {
        "naive": (
            "killed",
            "worker killed by SIGKILL, not by the OOM killer (/proc/vmstat: no new kill)",
            "SIGKILL",
        ),
        "math": ("error", "RuntimeError: test fault", None),
        "tiled": ("oom", "MemoryError: test fault", None),
    }


def test_a_sigkill_is_called_oom_only_when_the_oom_killer_acted(monkeypatch):
    counts = iter([3, 5])
    monkeypatch.setattr(driver, "_oom_kills", lambda: next(counts))
    before = driver._oom_kills()
    status, reason = driver._killed(signal.SIGKILL, before)
    assert status == "oom" and "2 in /proc/vmstat" in reason
    monkeypatch.setattr(driver, "_oom_kills", lambda: None)
    status, reason = driver._killed(signal.SIGKILL, None)
    assert status == "killed" and "does not say" in reason
    assert driver._killed(signal.SIGTERM, 3) == ("killed", "worker killed by SIGTERM")


def test_a_worker_past_its_timeout_is_killed_and_recorded(tmp_path, fake_probe, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "sleep:flash,sleep:tiled")  # neither ever finishes
    output = tmp_path / "bench.jsonl"
    assert driver.run(tiny("flash", "tiled"), output, timeout=0.1, peak=False) == 0
    rows = list(records.read(output))
    assert [r["status"] for r in rows] == ["timeout", "timeout"]
    assert all("0.1 s" in r["reason"] and r["pid"] for r in rows)


def test_memory_guard_skips_math_that_cannot_fit_without_launching(
    tmp_path, fake_probe, monkeypatch
):
    monkeypatch.setattr(driver, "_spawn", launched)
    output = tmp_path / "bench.jsonl"
    huge = tiny("math", "naive", lengths=(2**20,), modes=("forward", "train"))
    assert driver.run(huge, output, peak=False) == 0
    rows = list(records.read(output))
    assert len(rows) == 4
    for row in rows:
        assert row["status"] == "skipped" and row["pid"] is None
        assert "GiB" in row["reason"] and "MemAvailable" in row["reason"]


def test_resume_skips_settled_measurements_and_reruns_failed_ones(tmp_path, fake_probe, fake_spawn):
    measurements = tiny("math", "flash", "efficient", "tiled")
    output = tmp_path / "bench.jsonl"
    probe = driver._probe("cpu")
    records.append(output, measured(measurements[0], probe))
    for m, status in zip(measurements[1:], ("skipped", "unsupported", "timeout"), strict=True):
        records.append(output, driver._failure(m, probe, 1, status, "earlier", experiment="x"))
    assert driver.run(measurements, output, resume=True, peak=False) == 0
    assert fake_spawn == [(1, measurements[3])]
    assert len(records.read(output)) == 5
    fake_spawn.clear()
    assert driver.run(measurements, output, resume=True, peak=False) == 0
    assert fake_spawn == []


def test_an_output_is_checked_by_opening_it(tmp_path):
    """os.access says yes to root where writing fails (/proc); opening the file does not."""
    with pytest.raises(ValueError, match="cannot be written"):
        records.check_writable("/proc/octlm-check.jsonl", "output (--output)")
    fresh = tmp_path / "new.jsonl"
    assert records.check_writable(fresh, "output (--output)") == fresh
    assert not fresh.exists()  # the check leaves nothing behind


def test_a_peak_probe_past_the_timeout_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "sleep:peak")  # the probe never finishes
    with pytest.raises(RuntimeError, match=r"took longer than --timeout 0\.01 s"):
        driver._peak("x", "r", False, 0.01)


def test_a_resume_goes_on_with_the_run_it_resumes(tmp_path, fake_probe, fake_spawn):
    """Its records take the interrupted run's id, so the report pairs them with that run's."""
    output = tmp_path / "bench.jsonl"
    assert driver.run(tiny("flash"), output, peak=False) == 0
    assert driver.run(tiny("flash", "tiled"), output, resume=True, peak=False) == 0
    assert [m.backend for _, m in fake_spawn] == ["flash", "tiled"]
    runs = [record["run"] for record in records.read(output)]
    assert len(runs) == 2 and runs[0] == runs[1] and runs[0]
    assert driver.run(tiny("flash"), output, peak=False) == 0  # a fresh run: a fresh id
    assert records.read(output)[-1]["run"] != runs[0]


def test_resume_after_a_torn_last_line_keeps_the_next_record(tmp_path, fake_probe, fake_spawn):
    """A run killed mid-write leaves half a line; the resumed run's first record must start on
    a line of its own (glued to the fragment, it would be lost), and reading says what
    it skipped."""
    flash, tiled = tiny("flash", "tiled")
    output = tmp_path / "bench.jsonl"
    probe = driver._probe("cpu")
    records.append(output, measured(flash, probe))
    with output.open("a") as out:
        out.write('{"kind": "bench", "backend": "tiled", "mo')  # the killed run's last write
    assert driver.run([flash, tiled], output, resume=True, peak=False) == 0
    assert fake_spawn == [(1, tiled)]
    skipped = []
    found = records.read(output, skipped)
    assert [r["backend"] for r in found] == ["flash", "tiled"]
    assert skipped[0].count == 1 and "line 2: not JSON" in str(skipped[0])
    with pytest.warns(records.RecordsWarning, match="skipped 1 line"):
        records.read(output)


def test_read_skips_and_counts_every_line_that_is_not_a_record(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = {"kind": "bench", "backend": "flash", "mode": "forward", "length": 8, "status": "ok",
            "seconds_median": 0.5, "extra_bytes": 10, "peak_bytes": 20}  # fmt: skip
    lines = [
        json_line(good),
        b"\xff\xfe not utf-8\n",
        b"[1, 2, 3]\n",
        json_line({**good, "length": "8"}),
        json_line({**good, "extra_bytes": None}),
        json_line({**good, "kind": "mystery"}),
        json_line({"note": "no kind, and no field that tells one"}),
        json_line({**good, "seconds_median": float("nan")}),
        json_line({**good, "status": "timeout", "extra_bytes": None, "seconds_median": None}),
    ]
    path.write_bytes(b"".join(lines))
    skipped = []
    found = records.read(path, skipped)
    assert [r["status"] for r in found] == ["ok", "timeout"]
    [note] = skipped
    assert note.count == 7
    text = str(note)
    for why in ("line 2: not UTF-8", "line 3: a JSON list", "'length' must be int, got '8'",
                "'extra_bytes' must be int, got None", "kind 'mystery'"):  # fmt: skip
        assert why in text
    with pytest.raises(FileNotFoundError, match="no records file"):
        records.read(tmp_path / "missing.jsonl")


def json_line(record: dict) -> bytes:
    return (json.dumps(record) + "\n").encode()


def test_rounds_alternate_the_backends_and_resume_counts_rounds(tmp_path, fake_probe, fake_spawn):
    flash, tiled = tiny("flash", "tiled")
    output = tmp_path / "bench.jsonl"
    assert driver.run([flash, tiled], output, rounds=2, peak=False) == 0
    assert fake_spawn == [(1, flash), (1, tiled), (2, tiled), (2, flash)]
    found = records.read(output)
    assert [r["round"] for r in found] == [1, 1, 2, 2] and len({r["run"] for r in found}) == 1
    fake_spawn.clear()
    assert driver.run([flash, tiled], output, rounds=3, resume=True, peak=False) == 0
    assert fake_spawn == [(3, flash), (3, tiled)]


def test_busy_measurements_run_beside_a_competitor_that_is_stopped_after(
    tmp_path, fake_probe, monkeypatch
):
    started = []

    class Recorded(driver.Competitor):
        def set(self, busy: bool) -> None:
            super().set(busy)
            if self.process is not None and self.process not in started:
                started.append(self.process)

    seen = []

    def spawn(m, probe, timeout, **where):
        running = [p for p in started if p.poll() is None and "--compete" in p.args]
        seen.append((m.busy, len(running)))
        return measured(m, probe, **where)

    monkeypatch.setattr(driver, "Competitor", Recorded)
    monkeypatch.setattr(driver, "_spawn", spawn)
    measurements = tiny("flash", "tiled", busy=(False, True))
    assert driver.run(measurements, tmp_path / "bench.jsonl", peak=False) == 0
    assert seen == [(False, 0), (False, 0), (True, 1), (True, 1)]
    assert len(started) == 1 and started[0].returncode == -signal.SIGKILL


def wait_for_fault(ready: Path, process: subprocess.Popen | None = None) -> int:
    """The pid of the first worker that reached its test fault (it writes it to ``ready``)."""
    deadline = time.monotonic() + 300  # a hang guard, not a measurement
    while not (ready.exists() and ready.read_text().endswith("\n")):
        assert process is None or process.poll() is None, "the driver ended first"
        assert time.monotonic() < deadline, "no worker reached its fault"
        time.sleep(0.05)
    return int(ready.read_text().split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_is_bound_to_its_driver_before_it_runs_a_line():
    """The parent-death signal is set between fork and exec, so a worker that is still
    importing torch dies with a SIGKILLed driver: the child reads it as its first act."""
    read = (
        "import ctypes, signal; state = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(state)); "  # PR_GET_PDEATHSIG
        "print(signal.Signals(state.value).name if state.value else 'none')"
    )
    child = driver.start([sys.executable, "-S", "-c", read])
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr
    assert stdout.strip() == "SIGKILL"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_a_worker_dies_with_its_driver(stop, tmp_path):
    """SIGTERM and SIGHUP reach the driver's handlers, which kill the worker and keep the
    records; after a SIGKILL the kernel ends the worker (parent-death signal), and no record
    is read, so no finished measurement comes before it."""
    output = tmp_path / "bench.jsonl"
    backends = ("tiled",) if stop == signal.SIGKILL else ("flash", "tiled")
    script = (
        "import sys; from dataclasses import replace; from octlm.lab.bench import driver; "
        f"from octlm.lab.bench.suites import Grid; driver._probe = lambda device: {PROBED!r}; "
        f"grid = Grid(backends={backends!r}, lengths=(32,), heads=2, head_sizes=(16,), "
        "repeats=1); "
        f"sys.exit(driver.run(grid.measurements(), {str(output)!r}, peak=False))"
    )
    ready = tmp_path / "ready"
    env = {**os.environ, FAULT_ENV: "sleep:tiled", FAULT_READY_ENV: str(ready)}
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    try:
        worker = wait_for_fault(ready, process)
        process.send_signal(stop)
        process.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker), f"the worker outlived its driver's {stop.name}"
    finally:
        process.kill()
    if stop != signal.SIGKILL:
        assert process.returncode == 128 + stop
        assert [r["backend"] for r in records.read(output)] == ["flash"]


def test_ctrl_c_kills_the_worker_and_keeps_finished_lines(tmp_path, fake_probe, monkeypatch):
    ready = tmp_path / "ready"
    monkeypatch.setenv(FAULT_ENV, "sleep:tiled")
    monkeypatch.setenv(FAULT_READY_ENV, str(ready))
    workers = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            workers.append(self)

    returned = threading.Event()

    def press_ctrl_c():
        wait_for_fault(ready)  # flash is done; tiled sleeps, its driver waiting on it
        if not returned.is_set():  # never interrupt pytest itself
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(driver.subprocess, "Popen", Recorded)
    output = tmp_path / "bench.jsonl"
    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        code = driver.run(tiny("flash", "tiled"), output, peak=False)
    finally:
        returned.set()
    assert code == 130
    assert [r["backend"] for r in records.read(output)] == ["flash"]
    assert workers[1].poll() == -signal.SIGKILL


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_reaches_tiled_and_sdpa_and_both_agree(feature):
    """The worker's call gives tiled and SDPA (with its dense mask) the feature's keywords:
    the two outputs agree, and differ from the call without the feature."""
    m = replace(
        Measurement("tiled", "forward", "float32", 2, 4, 2, 16, 64, 64, True, 0, 0.25,
                    (16, 16), 1, 0, "cpu"),
        feature=feature,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 64, 16, generator=generator) * 3  # scores of a few units
    key, value = (torch.randn(2, 2, 64, 16, generator=generator) for _ in range(2))
    keywords = worker.structure(m, torch.device("cpu"))
    tiled = worker.attention_call(m, query, key, value, keywords)()
    sdpa = worker.attention_call(replace(m, backend="math"), query, key, value, keywords)()
    plain = replace(m, feature=None)  # right padding instead of left, for "left padding"
    keywords = worker.structure(plain, torch.device("cpu"))
    without = worker.attention_call(plain, query, key, value, keywords)()
    assert (tiled - sdpa).abs().max() < 1e-5
    assert (tiled - without).abs().max() > 1e-2


def test_overrides_replace_the_suite_values_and_bad_ones_name_the_option():
    measurements = suite("baseline", lengths=(64,), dtypes=("float32",), repeats=1)
    assert {(m.length, m.dtype, m.repeats) for m in measurements} == {(64, "float32", 1)}
    with pytest.raises(ValueError, match="backends"):
        suite("baseline", backends=("fast",))
    with pytest.raises(ValueError, match="paddings"):
        suite("baseline", paddings=(1.0,))
    with pytest.raises(ValueError, match="suite"):
        suite("nightly")


def test_options_that_would_make_a_record_lie_are_refused():
    """--kv-heads 0 (which would run as 8 heads) and a --q-len above every length (which would
    run nothing) are refused."""
    with pytest.raises(ValueError, match=r"--kv-heads \(0\)"):
        suite("baseline", kv_heads=0)
    with pytest.raises(ValueError, match=r"nothing to measure.*--q-len"):
        suite("baseline", q_lens=(16,), lengths=(8,))
    assert {m.kv_heads for m in suite("baseline", kv_heads=2, lengths=(64,))} == {2}


def test_command_line_fills_the_suite_and_names_the_default_output(monkeypatch):
    calls = []

    def run(measurements, output, **options):
        calls.append((measurements, output, options))
        return 0

    monkeypatch.setattr(driver, "run", run)
    assert main(["bench", "structure", "--lengths", "512", "--block", "64"]) == 0
    [(measurements, output, options)] = calls
    assert str(output) == os.path.join("runs", "local", "bench-structure-cpu.jsonl")
    assert options == {
        "experiment": "bench-structure", "timeout": 600.0, "resume": False, "rounds": 1,
        "peak": True,
    }  # fmt: skip
    assert {m.block for m in measurements if m.backend == "tiled"} == {(64, 64)}
    assert {m.length for m in measurements} == {512}
    calls.clear()
    assert main(["bench", "seed", "--lengths", "64", "--busy", "--rounds", "3"]) == 0
    [(measurements, output, options)] = calls
    assert str(output) == os.path.join("runs", "local", "bench-baseline-cpu.jsonl")
    assert options["rounds"] == 3 and {m.busy for m in measurements} == {False, True}


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--padding", "1.5"], "--padding"),
        (["--block", "0"], "block"),
        (["--kv-heads", "0"], "--kv-heads"),
        (["--q-len", "16", "--lengths", "8"], "nothing to measure"),
        (["--timeout", "inf"], "--timeout"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "0"], "--timeout"),
        (["--rounds", "0"], "--rounds"),
    ],
)
def test_bad_options_exit_2_and_name_the_option(argv, named, capsys, monkeypatch):
    monkeypatch.setattr(driver, "_spawn", launched)
    assert main(["bench", "baseline", "--lengths", "32", *argv]) == 2
    assert named in capsys.readouterr().err


def launched(*args, **kwargs):
    raise AssertionError("a worker was launched")


def test_an_output_that_cannot_be_written_is_refused_before_any_measurement(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(driver, "_spawn", launched)
    monkeypatch.setattr(driver, "_probe", launched)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["bench", "baseline", "--lengths", "32", "--output", str(blocker / "bench.jsonl")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--output" in err and "cannot be written" in err and "Traceback" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_is_a_clear_error(fake_probe, fake_spawn):
    with pytest.raises(OSError, match="cannot write a record to /dev/full: No space left"):
        driver.run(tiny("flash"), "/dev/full", peak=False)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--length", "100", "--worlds", "3", "--layout", "plain"], "--length (100)"),
        (["--length", "102", "--worlds", "2"], "multiple of 4"),  # zigzag: 2 chunks per rank
        (["--worlds", "0"], "--worlds"),
        (["--repeats", "0"], "--repeats"),
        (["--kv-heads", "0"], "--kv-heads"),
        (["--kv-heads", "3"], "--kv-heads"),
        (["--timeout", "inf"], "--timeout"),
    ],
)
def test_ring_bench_refuses_what_it_would_not_measure(argv, named, tmp_path, capsys):
    assert ring.main([*argv, "--output", str(tmp_path / "ring.jsonl")]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "ring.jsonl").exists()


@pytest.mark.parametrize("argv", [["bench", "train", "--modes", "sideways"], ["report", "--nope"]])
def test_unknown_choices_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2


def test_ring_modes_are_checked_by_name(capsys):
    with pytest.raises(SystemExit):
        ring.main(["--modes", "sideways"])
    assert "sideways" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_any_measurement(tmp_path, capsys):
    output = tmp_path / "bench.jsonl"
    assert main(["bench", "cuda", "--lengths", "64", "--output", str(output)]) == 2
    assert "--device" in capsys.readouterr().err
    assert not output.exists()


def test_the_sketch_runs_forward_only_and_matches_the_reference():
    from octlm.attention import naive_attention
    from octlm.lab.bench.sketch import sketch_attention
    from octlm.lab.bench.worker import measure

    forward, train = tiny("sketch", modes=("forward", "train"))
    assert measure(forward)["status"] == "ok"
    assert measure(train)["status"] == "unsupported"
    query, key, value = torch.randn(3, 1, 2, 70, 16, dtype=torch.float64)
    torch.testing.assert_close(
        sketch_attention(query, key, value, block=16), naive_attention(query, key, value)
    )


def test_cuda_memory_and_timing_use_the_allocator_and_synchronise(monkeypatch):
    """The CUDA path's logic, on a machine without one: torch.cuda stands in, and the probes
    must reset the peak before the call, read max_memory_allocated after, never RSS, and the
    timer must synchronise on both sides of the step."""
    from octlm import memory
    from octlm.lab.bench.timing import device_fence, time_calls

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
    time_calls(lambda: calls.append("step"), 1, fence=device_fence(torch.device("cuda")))
    assert calls == ["sync", "step", "sync"]


def test_extra_memory_is_the_workers_own_even_from_a_large_driver(tmp_path, fake_probe):
    """A worker's memory baseline must not start at its driver's peak: the kernel carries
    getrusage's peak across exec, and a driver larger than the worker once made every call's
    extra memory 0."""
    ballast = torch.ones(96 * 2**20, dtype=torch.uint8)  # the driver's resident set grows
    output = tmp_path / "bench.jsonl"
    argv = [
        "bench", "baseline", "--backends", "naive", "--lengths", "1024", "--dtypes", "float32",
        "--heads", "4", "--head-size", "16", "--repeats", "1", "--output", str(output),
        "--no-peak",
    ]  # fmt: skip
    assert main(argv) == 0 and ballast.sum() > 0
    [row] = [r for r in records.read(output) if r["kind"] == "bench"]
    scores = 4 * 1024 * 1024 * 4  # one float32 (H, Q, K) score matrix
    assert row["status"] == "ok" and row["extra_bytes"] >= scores
