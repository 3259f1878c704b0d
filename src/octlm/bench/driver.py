"""Spawn one worker per measurement and append one record per measurement, whatever happens.

A worker that the OOM killer ends (SIGKILL), that runs out of memory, that fails or that
passes its timeout still gives a record (``oom``, ``timeout``, ``error``, with a reason), and
the run goes on. MATH and naive sizes whose score matrices cannot fit in the memory available
are ``skipped`` without launching them, so the machine never swaps or dies. Ctrl-C kills the
running worker and stops with every finished line kept (exit code 130).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from octlm import records
from octlm.attention.tiled import parse_block
from octlm.bench import memory
from octlm.bench.suites import Measurement, key_of, suite
from octlm.bench.worker import make_record

WORKER = (sys.executable, "-m", "octlm.bench.worker")
# Statuses that a rerun would only repeat; ``--resume`` skips them.
SETTLED = ("ok", "skipped", "unsupported")
INTERRUPTED = 130


def bench(
    suite_name: str = "seed",
    *,
    output: str | os.PathLike | None = None,
    timeout: float = 600.0,
    resume: bool = False,
    **overrides,
) -> int:
    """Measure suite ``suite_name`` with grid ``overrides`` into ``output``.

    ``output`` defaults to ``runs/bench-<suite>-<device>.jsonl``. Returns the exit code:
    0 when every measurement has a record, 130 when interrupted.
    """
    overrides = {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in overrides.items()
    }
    block = overrides.get("block")
    if isinstance(block, tuple) and len(block) == 1:  # --block 128
        block = block[0]
    if block is not None:
        overrides["block"] = parse_block(block)
    measurements = suite(suite_name, **overrides)
    if output is None:
        devices = sorted({torch.device(m.device).type for m in measurements})
        output = Path("runs") / f"bench-{suite_name}-{'-'.join(devices)}.jsonl"
    return run(
        measurements, output, experiment=f"bench-{suite_name}", timeout=timeout, resume=resume
    )


def run(
    measurements: list[Measurement],
    output: str | os.PathLike,
    *,
    experiment: str = "bench",
    timeout: float = 600.0,
    resume: bool = False,
) -> int:
    """Run each measurement in its own worker, appending its record to ``output`` at once."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    probes = {device: _probe(device) for device in sorted({m.device for m in measurements})}
    done = recorded(output) if resume else set()
    todo = [m for m in measurements if (probes[m.device]["device"], m.key()) not in done]
    print(
        f"octlm bench: {len(todo)} measurements -> {output}"
        + (f" ({len(measurements) - len(todo)} already recorded)" if resume else ""),
        file=sys.stderr,
    )
    try:
        with tqdm(todo, file=sys.stderr, unit="run", dynamic_ncols=True) as progress:
            for measurement in progress:
                progress.set_description(measurement.label())
                probe = probes[measurement.device]
                record = _guard(measurement, probe, experiment) or _spawn(
                    measurement, probe, experiment, timeout
                )
                records.append(output, record)
                if record["status"] != "ok":
                    progress.write(f"{measurement.label()}: {record['status']}: {record['reason']}")
    except KeyboardInterrupt:
        print(f"octlm bench: interrupted; finished records kept in {output}", file=sys.stderr)
        return INTERRUPTED
    return 0


def recorded(output: str | os.PathLike) -> set[tuple]:
    """``(device, measurement key)`` of the settled records already in ``output``."""
    if not Path(output).exists():
        return set()
    return {
        (record.get("device"), key_of(record))
        for record in records.read(output)
        if record.get("status") in SETTLED and "backend" in record
    }


def _probe(device: str) -> dict:
    """Context and free memory of ``device``, asked of a child so we never hold a CUDA context."""
    done = subprocess.run([*WORKER, "--probe", device], capture_output=True, text=True)
    if done.returncode != 0:
        why = _last_line(done.stderr) or f"exit code {done.returncode}"
        raise ValueError(f"device (--device) {device!r} cannot be used here: {why}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _context(probe: dict, experiment: str) -> dict:
    """The common fields, for a record that no worker wrote."""
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    names = ("torch", "device", "threads", "host_cpu")
    return {"experiment": experiment, "time": now, **{name: probe[name] for name in names}}


def _guard(m: Measurement, probe: dict, experiment: str) -> dict | None:
    """A ``skipped`` record when the score matrices cannot fit; ``None`` to go ahead."""
    need = memory.score_bytes(
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
    return make_record(m, _context(probe, experiment), status="skipped", reason=reason)


def _spawn(m: Measurement, probe: dict, experiment: str, timeout: float) -> dict:
    """Run ``m`` in a fresh worker; a worker that dies or hangs becomes a failure record."""
    spec = json.dumps(asdict(m))
    # Its own session: Ctrl-C reaches only the driver, which then ends the whole worker group.
    worker = subprocess.Popen(
        [*WORKER, "--json", spec, "--experiment", experiment],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = worker.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(worker)
        reason = f"no result within {timeout:g} s; worker killed"
        return _failure(m, probe, experiment, worker.pid, "timeout", reason)
    except BaseException:  # KeyboardInterrupt above all: leave no worker behind
        _kill(worker)
        raise
    code = worker.returncode
    if code == -signal.SIGKILL:
        reason = "worker killed by SIGKILL, as the kernel's OOM killer does"
        return _failure(m, probe, experiment, worker.pid, "oom", reason)
    if code == 0:
        try:
            return json.loads(stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            reason = f"worker printed no record: {_last_line(stderr) or 'no output'}"
    elif code < 0:
        reason = f"worker killed by {signal.Signals(-code).name}"
    else:
        reason = f"worker exited with code {code}: {_last_line(stderr) or 'no output'}"
    return _failure(m, probe, experiment, worker.pid, "error", reason)


def _failure(
    m: Measurement, probe: dict, experiment: str, pid: int, status: str, reason: str
) -> dict:
    """The record of a measurement whose worker gave none."""
    return make_record(m, _context(probe, experiment), status=status, reason=reason, pid=pid)


def _kill(worker: subprocess.Popen) -> None:
    """SIGKILL the worker and anything it started (its session), then reap it."""
    with contextlib.suppress(ProcessLookupError):  # it may have just exited
        os.killpg(worker.pid, signal.SIGKILL)
    worker.communicate()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""
