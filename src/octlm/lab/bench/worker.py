"""Exactly one measurement in this process: ``python -m octlm.lab.bench.worker --json '{...}'``.

Builds the inputs, takes the memory baseline just before the measured call, warms up, times the
repeats, reads the peak, and prints one JSON line: the whole benchmark record (docs/design.md,
'Records'). A backend that cannot run is an ``unsupported`` record with torch's reason, never a
silent fallback: each SDPA backend is forced alone with ``sdpa_kernel``.

Beside the times, the record says how busy the machine was: the load average before and after,
and the CPU time this process got while the repeats ran against their wall time (a process
that shares its cores gets less CPU than its threads could use). ``--peak`` instead times a
large float32 ``torch.mm``: the machine's matrix-multiply rate, which the report divides into.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from octlm import memory, records
from octlm.attention import IMPLEMENTATIONS, route, sdpa_attention
from octlm.lab.bench.guard import die_with_parent
from octlm.lab.bench.suites import Measurement
from octlm.lab.bench.timing import device_fence, time_calls

RESULT_FIELDS = (
    "status",
    "reason",
    "signal",
    "seconds_median",
    "seconds_iqr",
    "seconds",
    "tflops",
    "memory_metric",
    "peak_bytes",
    "baseline_bytes",
    "extra_bytes",
    "load_before",
    "load_after",
    "cpu_seconds",
    "wall_seconds",
    "others_seconds",
    "pid",
)  # the CPU count is the machine's, in every record's context
# The fixed forms of the structure features (see suites.FEATURES).
DOCUMENTS = 8
SOFTCAP = 50.0
# The matrix-multiply probe: C = A @ B with A, B (PEAK_SIZE, PEAK_SIZE) float32.
PEAK_SIZE = 4096
PEAK_REPEATS = 3
SDPA = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
# What torch says when the one allowed SDPA backend cannot take the call.
NO_KERNEL = ("No available kernel", "No viable backend")
# Test hook, for tests/lab/test_bench.py only: OCTLM_BENCH_FAULT="kill:naive,sleep:tiled" makes
# every measurement of a named backend ("peak" for the matmul probe) fail that way (kill,
# sleep, raise or oom); a worker about to fail first appends its pid to the file named by
# OCTLM_BENCH_FAULT_READY, so a test can wait for that moment instead of guessing it.
FAULT_ENV = "OCTLM_BENCH_FAULT"
FAULT_READY_ENV = "OCTLM_BENCH_FAULT_READY"


class Unsupported(Exception):
    """The backend cannot run this measurement here; the message says why."""


def make_record(
    measurement: Measurement,
    experiment: str,
    where: str | dict,
    *,
    run: str | None = None,
    round: int = 1,
    **results,
) -> dict:
    """One benchmark record: the measurement, its round, then ``results`` (others None).

    ``where`` is the device, or :func:`octlm.records.machine`'s dict as a child reported it.
    """
    spec = asdict(measurement)
    del spec["device"]  # the record's ``device`` is the context's: ``cpu`` or the GPU's name
    results = {
        **dict.fromkeys(RESULT_FIELDS),
        "memory_metric": memory.metric(measurement.device),
        **results,
    }
    return records.make("bench", experiment, where, run=run, **spec, round=round, **results)


def flops(measurement: Measurement) -> float:
    """Floating-point operations of one step, by FlashAttention's count.

    4·B·Tq·Tk·D·H per forward, halved when causal and square; backward adds 2.5 forwards.
    Window and padding do not change the count, so ``tflops`` compares like with like.
    """
    m = measurement
    count = 4.0 * m.batch * m.heads * m.q_len * m.length * m.head_size
    if m.causal and m.q_len == m.length:
        count /= 2
    return count * (3.5 if m.mode == "train" else 1.0)


def structure(measurement: Measurement, device: torch.device) -> dict:
    """The padding, document and score keywords of a measurement (see ``FEATURES``)."""
    m, keywords = measurement, {}
    kept = round(m.length * (1 - m.padding))
    if m.feature == "left padding":  # the same number of keys hidden, at the start
        start = m.length - kept
        keywords["key_starts"] = torch.full((m.batch,), start, dtype=torch.long, device=device)
    elif m.padding:
        keywords["key_lengths"] = torch.full((m.batch,), kept, dtype=torch.long, device=device)
    if m.feature == "documents":  # 8 documents of equal length, in order
        ids = torch.arange(m.length, device=device) * DOCUMENTS // m.length  # (T,)
        keywords["document_ids"] = ids.expand(m.batch, -1)  # (B, T)
    elif m.feature == "softcap":
        keywords["softcap"] = SOFTCAP
    elif m.feature == "alibi":
        exponents = torch.arange(1, m.heads + 1, device=device) * (-8.0 / m.heads)
        keywords["alibi_slopes"] = torch.exp2(exponents)  # (H,)
    elif m.feature == "sinks":  # learned: their gradient is part of a training step
        keywords["sinks"] = torch.zeros(m.heads, device=device, requires_grad=m.mode == "train")
    return keywords


def attention_call(measurement: Measurement, query, key, value, keywords: dict) -> Callable:
    """The measured attention call, with the backend and the :func:`structure` keywords
    bound."""
    m = measurement
    options = {"causal": m.causal, "window": m.window}
    if m.backend in IMPLEMENTATIONS and not IMPLEMENTATIONS[m.backend].distributed:
        impl = IMPLEMENTATIONS[m.backend]
        unknown = sorted(set(keywords) - {"key_lengths", *impl.features})
        if unknown:
            raise Unsupported(f"{m.backend} takes no {', '.join(unknown)}")
        # The Triton kernel is its own backend: tiled is timed as plain PyTorch. A backend
        # measured without a block (auto) runs with its own defaults.
        tuning = {"block": tuple(m.block), "kernel": "pytorch"} if m.block is not None else {}
        return lambda: impl.function(query, key, value, **keywords, **options, **tuning)
    if m.backend in SDPA:

        def call():
            with sdpa_kernel(SDPA[m.backend]):
                return sdpa_attention(query, key, value, **keywords, **options)

        return call
    if m.backend == "sketch":
        plain = m.causal and not m.window and not keywords and m.q_len == m.length
        if not plain or m.mode != "forward" or m.kv_heads != m.heads:
            raise Unsupported("the sketch is square causal MHA, forward only")
        from octlm.lab.bench.sketch import sketch_attention

        return lambda: sketch_attention(query, key, value)
    if m.backend == "triton":
        if query.device.type != "cuda":
            raise Unsupported(f"triton runs on CUDA only, not on {query.device.type}")
        try:
            from octlm.attention.tiled import triton_flash
        except ImportError as error:
            raise Unsupported(
                f"cannot import octlm.attention.tiled.triton_flash: {error}"
            ) from error
        unknown = sorted(set(keywords) - set(triton_flash.TRITON_KEYWORDS))
        if unknown:
            raise Unsupported(f"triton_attention takes no {', '.join(unknown)}")
        if not triton_flash.is_available(query.device):
            raise Unsupported("triton is not installed (pip install 'octlm[triton]')")
        return lambda: triton_flash.triton_attention(query, key, value, **options, **keywords)
    raise ValueError(f"backend must be one of {[*SDPA, *IMPLEMENTATIONS, 'sketch', 'triton']}")


def measure(
    measurement: Measurement, experiment: str = "bench", run: str | None = None, round: int = 1
) -> dict:
    """Run one measurement and return its record; failures become a status and a reason."""
    m = measurement
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            results = _run(m)
        except Unsupported as error:
            results = {"status": "unsupported", "reason": str(error)}
        except (MemoryError, torch.OutOfMemoryError) as error:
            results = {"status": "oom", "reason": _describe(error)}
        except RuntimeError as error:
            if any(text in str(error) for text in NO_KERNEL):
                told = list(dict.fromkeys(str(w.message) for w in caught))  # CUDA says why here
                meaning = (  # torch's own words blame the backends the benchmark turned off
                    "torch has no CPU kernel for this backend (CUDA only); torch says: "
                    if m.device == "cpu" and m.backend == "efficient"
                    else ""
                )
                reason = "; ".join([f"{m.backend} on {m.device}: {meaning}{error}", *told])
                results = {"status": "unsupported", "reason": reason[:2000]}
            elif "can't allocate memory" in str(error):  # the CPU allocator's out-of-memory
                results = {"status": "oom", "reason": _describe(error)}
            else:
                results = {"status": "error", "reason": _describe(error)}
        except Exception as error:
            results = {"status": "error", "reason": _describe(error)}
    return make_record(m, experiment, m.device, run=run, round=round, pid=os.getpid(), **results)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def _run(m: Measurement) -> dict:
    device, dtype = torch.device(m.device), getattr(torch, m.dtype)
    torch.manual_seed(0)
    train = m.mode == "train"

    def tensor(heads: int, length: int) -> torch.Tensor:
        shape = (m.batch, heads, length, m.head_size)
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=train)

    query = tensor(m.heads, m.q_len)  # (B, H, Q, D)
    key, value = tensor(m.kv_heads, m.length), tensor(m.kv_heads, m.length)  # (B, Hkv, K, D)
    keywords = structure(m, device)
    learned = [x for x in keywords.values() if isinstance(x, torch.Tensor) and x.requires_grad]
    grad_out = torch.randn_like(query, requires_grad=False) if train else None
    call = attention_call(m, query, key, value, keywords)
    chosen = {}
    if m.backend == "auto":  # its record says which path it took and why
        chosen["route"] = route(query, key, value, causal=m.causal, window=m.window, **keywords)[1]

    def step() -> None:
        out = call()
        if train:
            out.backward(grad_out)
            for leaf in (query, key, value, *learned):
                leaf.grad = None

    baseline = memory.baseline(m.device)
    _test_fault(m.backend)
    timed = time_calls(step, m.repeats, warmup=m.warmup, fence=device_fence(device))
    peak = memory.peak(m.device)
    timing = records.timing(timed.seconds)
    median = timing["seconds_median"]
    return {
        "status": "ok",
        **chosen,
        **timing,
        "tflops": flops(m) / median / 1e12 if median > 0 else None,
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        "extra_bytes": peak - baseline,
        "load_before": timed.load_before,
        "load_after": timed.load_after,
        "cpu_seconds": timed.cpu_seconds,
        "wall_seconds": timed.wall_seconds,
        "others_seconds": timed.others_seconds,
    }


def matmul_peak(
    experiment: str = "bench", run: str | None = None, busy: bool = False, size: int = PEAK_SIZE
) -> dict:
    """A ``peak`` record: GFLOP/s of a ``(size, size)`` float32 ``torch.mm`` on the CPU, the
    median of :data:`PEAK_REPEATS` calls after one warm-up (2·size³ operations each)."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator) for _ in range(2))  # (N, N) each
    timed = time_calls(lambda: torch.mm(a, b), PEAK_REPEATS, warmup=1)
    timing = records.timing(timed.seconds)
    gflops = 2 * size**3 / timing["seconds_median"] / 1e9
    return records.make(
        "peak",
        experiment,
        "cpu",
        run=run,
        size=size,
        dtype="float32",
        busy=busy,
        gflops=gflops,
        **timing,
        load_before=timed.load_before,
        load_after=timed.load_after,
        others_seconds=timed.others_seconds,
        wall_seconds=timed.wall_seconds,
        pid=os.getpid(),
    )


def _test_fault(backend: str) -> None:
    """Test hook (see ``FAULT_ENV``): fail the way a real worker can, for one backend."""
    faults = [item.partition(":") for item in os.environ.get(FAULT_ENV, "").split(",")]
    fault = next((fault for fault, _, target in faults if target == backend), None)
    ready = os.environ.get(FAULT_READY_ENV)
    if fault and ready:
        with open(ready, "a") as file:
            file.write(f"{os.getpid()}\n")
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "sleep":
        time.sleep(3600)
    elif fault == "raise":
        raise RuntimeError("test fault")
    elif fault == "oom":
        raise MemoryError("test fault")


def probe(device: str) -> dict:
    """The common record fields for ``device`` and the bytes free on it, for the driver.

    The driver asks a child process so that it never holds a CUDA context of its own.
    """
    return {**records.machine(device), "available_bytes": memory.available(device)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--json", help="the Measurement's fields, as JSON")
    task.add_argument("--probe", metavar="DEVICE", help="print the device's context instead")
    task.add_argument("--peak", action="store_true", help="time a large float32 torch.mm")
    parser.add_argument("--experiment", default="bench", help="the record's experiment name")
    parser.add_argument("--run", help="the run id the record belongs to")
    parser.add_argument("--round", type=int, default=1, help="the round of the run")
    parser.add_argument("--busy", action="store_true", help="a competing process is running")
    parser.add_argument("--parent", type=int, help="die when this process (the driver) does")
    args = parser.parse_args(argv)
    if args.parent:
        die_with_parent(args.parent)
    if args.probe:
        print(json.dumps(probe(args.probe)), flush=True)
        return
    if args.peak:
        _test_fault("peak")
        print(json.dumps(matmul_peak(args.experiment, args.run, args.busy)), flush=True)
        return
    spec = json.loads(args.json)
    if spec.get("block") is not None:
        spec["block"] = tuple(spec["block"])
    record = measure(Measurement(**spec), args.experiment, args.run, args.round)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
