"""Spawn one worker per measurement and append one record per measurement, whatever happens.

A worker that is killed, that runs out of memory, that fails or that passes its timeout still
gives a record (``killed`` with the signal, ``oom``, ``timeout``, ``error``, with a reason), and
the run goes on. A SIGKILL is called ``oom`` only when the kernel's OOM-kill count rose while
the worker ran. MATH and naive sizes whose score matrices cannot fit in the memory available
are ``skipped`` without launching them, so the machine never swaps or dies. Ctrl-C, SIGTERM
and SIGHUP kill the running worker and stop with every finished line kept (exit code 130, or
128 + the signal); a worker also dies with its driver if the driver is killed outright.

The grid runs in rounds: every measurement once per round, each in a fresh process, the
backends of one shape one after another (in reverse order every other round), so a change in
the machine's load reaches every backend alike and each round gives its own ratios. Each run
starts with a ``peak`` record, the machine's float32 matrix-multiply rate. With ``busy``
measurements (``--busy``) one CPU-bound competing process runs beside them, started and
stopped by the driver.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from octlm import memory, records, signals
from octlm.attention.tiled.options import parse_block
from octlm.lab.bench import guard
from octlm.lab.bench.score_memory import score_bytes
from octlm.lab.bench.suites import Measurement, key_of, suite, suite_name
from octlm.lab.bench.worker import make_record

WORKER = (sys.executable, "-m", "octlm.lab.bench.worker")
# Statuses that a rerun would only repeat; ``--resume`` skips them.
SETTLED = ("ok", "skipped", "unsupported")


def bench(
    name: str = "baseline",
    *,
    output: str | os.PathLike | None = None,
    timeout: float = 600.0,
    resume: bool = False,
    rounds: int = 1,
    peak: bool = True,
    **overrides,
) -> int:
    """Measure suite ``name`` (or its alias) with grid ``overrides`` into ``output``.

    ``output`` defaults to ``runs/local/bench-<suite>-<device>.jsonl``, out of the committed
    reference records. Returns the exit code:
    0 when every measurement has a record, 130 (or 128 + signal) when stopped.
    """
    name = suite_name(name)
    overrides = {
        option: tuple(value) if isinstance(value, list) else value
        for option, value in overrides.items()
    }
    block = overrides.get("block")
    if isinstance(block, tuple) and len(block) == 1:  # --block 128
        block = block[0]
    if block is not None:
        overrides["block"] = parse_block(block)
    measurements = suite(name, **overrides)
    if output is None:
        devices = sorted({torch.device(m.device).type for m in measurements})
        output = records.LOCAL / f"bench-{name}-{'-'.join(devices)}.jsonl"
    return run(
        measurements,
        output,
        experiment=f"bench-{name}",
        timeout=timeout,
        resume=resume,
        rounds=rounds,
        peak=peak,
    )


def run(
    measurements: list[Measurement],
    output: str | os.PathLike,
    *,
    experiment: str = "bench",
    timeout: float = 600.0,
    resume: bool = False,
    rounds: int = 1,
    peak: bool = True,
) -> int:
    """Run each measurement ``rounds`` times, each in its own worker, appending its record to
    ``output`` at once; with ``peak``, first time the machine's matrix multiply."""
    if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"timeout (--timeout) must be a finite number of seconds > 0, got {timeout}"
        )
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds (--rounds) must be an integer >= 1, got {rounds!r}")
    records.check_writable(output, "output (--output)")
    probes = {device: _probe(device) for device in sorted({m.device for m in measurements})}
    done, previous = recorded(output) if resume else (set(), None)
    todo = [
        (round, m)
        for round in range(1, rounds + 1)
        for m in _alternate(measurements, round)
        if (probes[m.device]["device"], m.key(), round) not in done
    ]
    total = len(measurements) * rounds
    print(
        f"octlm bench: {len(todo)} measurements -> {output}"
        + (f" ({total - len(todo)} already recorded)" if resume else ""),
        file=sys.stderr,
    )
    # A resume goes on with the run it resumes, so that its rounds pair with what that run
    # measured before the interruption.
    run_id = previous or records.new_run()
    competitor = Competitor()
    try:
        with signals.stop_on_signals(), competitor:
            if peak and todo and any(m.device == "cpu" for _, m in todo):
                for busy in sorted({m.busy for _, m in todo}):
                    competitor.set(busy)
                    records.append(output, _peak(experiment, run_id, busy, timeout))
            with tqdm(todo, file=sys.stderr, unit="run", dynamic_ncols=True) as progress:
                for round, measurement in progress:
                    progress.set_description(f"round {round}: {measurement.label()}")
                    probe = probes[measurement.device]
                    competitor.set(measurement.busy)
                    where = dict(experiment=experiment, run=run_id, round=round)
                    record = _guard(measurement, probe, **where) or _spawn(
                        measurement, probe, timeout, **where
                    )
                    records.append(output, record)
                    if record["status"] == "unsupported":  # a fact of this machine's torch
                        progress.write(
                            f"{measurement.label()}: not supported by this torch (recorded)"
                        )
                    elif record["status"] != "ok":
                        progress.write(
                            f"{measurement.label()}: {record['status']}: {record['reason']}"
                        )
    except KeyboardInterrupt as stop:  # Ctrl-C, or signals.Stopped
        code = 128 + signals.signal_number(stop)
        print(
            f"octlm bench: {str(stop) or 'interrupted'}; finished records kept in {output}",
            file=sys.stderr,
        )
        return code
    return 0


def _alternate(measurements: list[Measurement], round: int) -> list[Measurement]:
    """``measurements`` in grid order; in even rounds the backends of each shape reversed."""
    if round % 2:
        return list(measurements)
    groups = itertools.groupby(measurements, lambda m: replace(m, backend="", block=None))
    return [m for _, group in groups for m in [*group][::-1]]


def recorded(output: str | os.PathLike) -> tuple[set[tuple], str | None]:
    """``(device, measurement key, round)`` of the settled records already in ``output``, and
    the run id of its last benchmark record (``None`` if it has none)."""
    if not Path(output).exists():
        return set(), None
    skipped: list[records.Skipped] = []
    found = [r for r in records.read(output, skipped) if r["kind"] == "bench"]
    for note in skipped:
        print(f"octlm bench: {note}", file=sys.stderr)
    done = {
        (record.get("device"), key_of(record), record.get("round", 1))
        for record in found
        if record["status"] in SETTLED
    }
    return done, found[-1].get("run") if found else None


def _probe(device: str) -> dict:
    """Context and free memory of ``device``, asked of a child so the driver holds no CUDA
    context."""
    done = subprocess.run(
        [*WORKER, "--probe", device, "--parent", str(os.getpid())], capture_output=True, text=True
    )
    if done.returncode != 0:
        why = _last_line(done.stderr) or f"exit code {done.returncode}"
        raise ValueError(f"device (--device) {device!r} cannot be used here: {why}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peak(experiment: str, run: str, busy: bool, timeout: float) -> dict:
    """The ``peak`` record of this run, from a fresh worker."""
    command = [*WORKER, "--peak", "--experiment", experiment, "--run", run]
    command += ["--parent", str(os.getpid())] + ["--busy"] * busy
    worker = start(command)
    try:
        stdout, stderr = worker.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(worker)
        raise RuntimeError(
            f"the matmul probe took longer than --timeout {timeout:g} s: raise --timeout, or "
            "leave the probe out with --no-peak"
        ) from None
    except BaseException:
        _kill(worker)
        raise
    if worker.returncode != 0:
        raise RuntimeError(f"the matmul probe failed: {_last_line(stderr) or worker.returncode}")
    return json.loads(stdout.strip().splitlines()[-1])


def _guard(m: Measurement, probe: dict, **where) -> dict | None:
    """A ``skipped`` record when the score matrices cannot fit; ``None`` to go ahead."""
    need = score_bytes(
        m.backend, m.mode, m.batch, m.heads, m.q_len, m.length, getattr(torch, m.dtype)
    )
    if not need:
        return None
    cuda = torch.device(m.device).type == "cuda"
    # Free GPU memory as a fresh process saw it; free host memory as it is now.
    available = probe["available_bytes"] if cuda else memory.available(m.device)
    if available is None or need <= available:
        return None
    source = "free on the GPU" if cuda else "MemAvailable"
    reason = (
        f"score matrices need about {need / 2**30:.1f} GiB ({m.backend} {m.mode}); "
        f"{available / 2**30:.1f} GiB {source}"
    )
    return make_record(
        m,
        where["experiment"],
        probe,
        run=where["run"],
        round=where["round"],
        status="skipped",
        reason=reason,
    )


def _spawn(m: Measurement, probe: dict, timeout: float, **where) -> dict:
    """Run ``m`` in a fresh worker; a worker that dies or hangs becomes a failure record."""
    command = [*WORKER, "--json", json.dumps(asdict(m)), "--experiment", where["experiment"]]
    command += ["--run", where["run"], "--round", str(where["round"])]
    command += ["--parent", str(os.getpid())]
    oom_kills = _oom_kills()
    worker = start(command)

    def failure(status: str, reason: str, **more) -> dict:
        return _failure(m, probe, worker.pid, status, reason, **where, **more)

    try:
        stdout, stderr = worker.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(worker)
        return failure("timeout", f"no result within {timeout:g} s; worker killed")
    except BaseException:  # KeyboardInterrupt, Stopped: leave no worker behind
        _kill(worker)
        raise
    code = worker.returncode
    if code < 0:
        return failure(*_killed(-code, oom_kills), signal=signal.Signals(-code).name)
    if code == 0:
        try:
            return json.loads(stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            return failure(
                "error", f"worker printed no record: {_last_line(stderr) or 'no output'}"
            )
    return failure("error", f"worker exited with code {code}: {_last_line(stderr) or 'no output'}")


def start(command: list[str], output: bool = True) -> subprocess.Popen:
    """Start a child in its own session (Ctrl-C reaches only the driver, which then ends the
    child's whole group), bound to die with the driver before it runs a line of its own."""
    pipe = subprocess.PIPE if output else None
    return subprocess.Popen(
        command,
        stdout=pipe,
        stderr=pipe,
        text=True,
        start_new_session=True,
        preexec_fn=guard.bind_to_parent(),
    )


def _killed(signum: int, oom_kills_before: int | None) -> tuple[str, str]:
    """Status and reason for a worker ended by signal ``signum``: ``oom`` only when the
    kernel's count of OOM kills rose while it ran, ``killed`` otherwise."""
    name = signal.Signals(signum).name
    if signum != signal.SIGKILL:
        return "killed", f"worker killed by {name}"
    after = _oom_kills()
    if oom_kills_before is None or after is None:
        return "killed", "worker killed by SIGKILL; the system does not say if by the OOM killer"
    if after > oom_kills_before:
        kills = after - oom_kills_before
        return "oom", f"worker killed by SIGKILL as the OOM killer acted ({kills} in /proc/vmstat)"
    return "killed", "worker killed by SIGKILL, not by the OOM killer (/proc/vmstat: no new kill)"


def _oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (Linux >= 4.13), or ``None``."""
    try:
        with open("/proc/vmstat") as vmstat:
            for line in vmstat:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _failure(
    m: Measurement,
    probe: dict,
    pid: int,
    status: str,
    reason: str,
    *,
    experiment: str,
    run: str | None = None,
    round: int = 1,
    **more,
) -> dict:
    """The record of a measurement whose worker gave none."""
    return make_record(
        m, experiment, probe, run=run, round=round, status=status, reason=reason, pid=pid, **more
    )


def _kill(worker: subprocess.Popen) -> None:
    """SIGKILL the worker and anything it started (its session), then reap it."""
    with contextlib.suppress(ProcessLookupError):  # it may have just exited
        os.killpg(worker.pid, signal.SIGKILL)
    worker.communicate()


class Competitor:
    """One CPU-bound process beside the busy measurements (``--busy``); it dies with the driver."""

    def __init__(self):
        self.process: subprocess.Popen | None = None

    def set(self, busy: bool) -> None:
        """Start the competing process, or stop it."""
        if busy and self.process is None:
            command = [sys.executable, guard.__file__, "--compete", str(os.getpid())]
            self.process = start(command, output=False)
        elif not busy and self.process is not None:
            _kill(self.process)
            self.process = None

    def __enter__(self) -> Competitor:
        return self

    def __exit__(self, *exc) -> None:
        self.set(False)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""
