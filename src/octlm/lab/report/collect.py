"""Read every records file once and sort its records by kind, for the report's sections.

Benchmark records are reduced to the latest record of each measurement, device and round (a
rerun replaces what it measures again, ``--resume`` fills in what is missing); an ``ok`` record
is never hidden by a later failure. A measurement's figure over several rounds is the median of
its rounds. Verification records are those of each experiment's latest run, so running
``octlm verify`` twice into one folder counts every check once.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from octlm import records
from octlm.attention.tiled.options import DEFAULT_BLOCK
from octlm.lab.bench.suites import key_of


@dataclass
class Collected:
    """The records of some files, by kind."""

    paths: list[Path]
    rounds: dict[tuple, dict] = field(default_factory=dict)  # (machine, key, round) -> bench
    ring: list[dict] = field(default_factory=list)
    peaks: list[dict] = field(default_factory=list)
    verify: list[dict] = field(default_factory=list)
    train: list[dict] = field(default_factory=list)  # train_step and eval
    train_attention: list[dict] = field(default_factory=list)  # octlm bench training
    skipped: list[records.Skipped] = field(default_factory=list)

    @property
    def bench(self) -> list[dict]:
        """One idle record per measurement and device; see :func:`measurements`."""
        return measurements(self.rounds.values())

    @property
    def count(self) -> int:
        parts = (self.rounds, self.ring, self.peaks, self.verify, self.train, self.train_attention)
        return sum(len(part) for part in parts)


def collect(paths: Iterable[str | os.PathLike]) -> Collected:
    """Read each of ``paths`` once, every machine's records together. ``FileNotFoundError``
    names a missing file."""
    found, read = _read(paths)
    return _sorted(found, read)


def by_machine(paths: Iterable[str | os.PathLike]) -> tuple[Collected, list[Collected]]:
    """All of ``paths``' records, and the same split by machine (:func:`records.identity`):
    the machine with the most records first. Figures of two machines are never paired."""
    found, read = _read(paths)
    machines: dict[tuple, list[tuple[Path, dict]]] = {}
    for path, record in read:
        machines.setdefault(records.identity(record), []).append((path, record))
    parts = [
        _sorted(Collected(found.paths), group)
        for group in sorted(machines.values(), key=lambda group: (-len(group), str(group[0])))
    ]
    return _sorted(found, read), parts


def _read(paths: Iterable[str | os.PathLike]) -> tuple[Collected, list[tuple[Path, dict]]]:
    given = {Path(p).resolve(): Path(p) for p in reversed(list(paths))}  # each file once
    found = Collected(list(reversed(given.values())))
    read = [(path, record) for path in found.paths for record in records.read(path, found.skipped)]
    return found, read


def _sorted(found: Collected, read: list[tuple[Path, dict]]) -> Collected:
    """``found`` with ``read``'s records sorted in by kind."""
    verify: list[dict] = []
    for path, record in read:
        kind = record["kind"]
        if kind == "bench":
            place = (machine_of(record), key_of(record), record.get("round", 1))
            if place not in found.rounds or _replaces(record, found.rounds[place]):
                found.rounds[place] = record
        elif kind == "ring":
            found.ring.append(record)
        elif kind == "peak":
            found.peaks.append(record)
        elif kind == "verify":
            verify.append(record)
        elif kind == "check" and record.get("experiment") == "train-attention":
            found.train_attention.append(record)
        elif kind in ("train_step", "eval"):
            found.train.append({**record, "source": str(path)})
    found.verify = latest_runs(verify)
    return found


def where(record: dict) -> str:
    """Where a measurement ran, as the report's tables name it: the device, and on CPU its
    threads (``cpu ×2``). Two thread counts are two measurements, never one that replaces the
    other, nor a pair; :func:`machine_of` also keeps apart other CPUs and torch versions."""
    device, threads = str(record.get("device")), record.get("threads")
    return f"{device} ×{threads}" if device == "cpu" and threads else device


def machine_of(record: dict) -> tuple:
    """A record's machine: :func:`where` and :func:`records.identity` (CPU, torch, ...)."""
    return where(record), *records.identity(record)


def _replaces(new: dict, old: dict) -> bool:
    return new["status"] == "ok" or old["status"] != "ok"


def latest_runs(checks: list[dict]) -> list[dict]:
    """The records of each experiment's latest run, per device and dtype (a run of one dtype
    leaves another's figures standing; records without a run id count as one run, older than
    any with one)."""
    latest: dict[tuple, str] = {}

    def group(record: dict) -> tuple:
        return record["experiment"], record.get("device"), record.get("dtype")

    for record in checks:
        latest[group(record)] = max(latest.get(group(record), ""), record.get("run") or "")
    return [r for r in checks if (r.get("run") or "") == latest[group(r)]]


def measurements(found: Iterable[dict]) -> list[dict]:
    """One idle (not ``busy``) record per measurement and device: over several rounds, the
    latest record with the median of the rounds' medians and every round's times."""
    groups: dict[tuple, list[dict]] = {}
    for record in found:
        if not record.get("busy"):
            groups.setdefault((machine_of(record), key_of(record)), []).append(record)
    out = []
    for group in groups.values():
        ok = [r for r in group if r["status"] == "ok"]
        if len(ok) < 2:
            out.append(ok[0] if ok else group[-1])
            continue
        crowded = next((r for r in ok if busy(r)), None)  # a busy round marks the median
        out.append(
            {
                **ok[-1],
                **({name: crowded.get(name) for name in LOAD_FIELDS} if crowded else {}),
                "seconds_median": statistics.median(r["seconds_median"] for r in ok),
                "seconds": [s for r in ok for s in r.get("seconds") or []],
                "extra_bytes": int(statistics.median(r["extra_bytes"] for r in ok)),
                "rounds": len(ok),
            }
        )
    return out


def plain(record: dict) -> bool:
    """Square attention without window, padding or a score feature: the baseline's kind of
    record."""
    return (
        not record.get("window")
        and not record.get("padding")
        and not record.get("feature")
        and record.get("q_len", record["length"]) == record["length"]
    )


def backend_label(record: dict) -> str:
    """The backend, with tiled's tiles when they are not the default: two tilings are two
    series, never one."""
    block = record.get("block")
    if not block or tuple(block) == DEFAULT_BLOCK:
        return record["backend"]
    return f"{record['backend']} {block[0]}×{block[1]}"


# A measurement was taken on a busy machine when other processes used more than MAX_OTHERS
# CPUs on average while it was timed (``others_seconds`` over its wall time). A process's own
# share of its threads' time is no such sign: a kernel that runs on one thread of two gets half
# on an idle machine. Records without that field (older ones) fall back on that share falling
# under MIN_CPU_SHARE, and those without CPU times on the one-minute load average before them
# exceeding the CPU count by more than BUSY_LOAD: a trailing average, which still counts a
# competing process for a minute after it stopped, so it is not used where better is known.
MAX_OTHERS = 0.25
BUSY_LOAD = 0.5
MIN_CPU_SHARE = 0.75
# What a record says of the load it was measured under.
LOAD_FIELDS = (
    "cpu_seconds",
    "wall_seconds",
    "others_seconds",
    "threads",
    "load_before",
    "load_after",
)


def busy(record: dict) -> str | None:
    """Why ``record`` was measured on a busy machine, or ``None`` (also when it does not say)."""
    others, wall = record.get("others_seconds"), record.get("wall_seconds")
    if others is not None and wall:
        if others / wall > MAX_OTHERS:
            return f"other processes used {others / wall:.2f} CPUs meanwhile"
        return None
    cpu, threads = record.get("cpu_seconds"), record.get("threads")
    if cpu is not None and wall and threads:
        share = cpu / (wall * threads)
        if share < MIN_CPU_SHARE:
            return f"got {share:.0%} of its {threads} threads' CPU time"
        return None
    load, cpus = record.get("load_before"), record.get("cpus")
    if load is not None and cpus and load > cpus + BUSY_LOAD:
        return f"load {load:.2f} on {cpus} CPUs"
    return None
