"""Exactly one measurement in this process: ``python -m octlm.bench.worker --json '{...}'``.

Builds the inputs, takes the memory baseline just before the measured call, warms up, times the
repeats, reads the peak, and prints one JSON line: the whole benchmark record (DESIGN §5). A
backend that cannot run is an ``unsupported`` record with torch's reason, never a silent
fallback: each SDPA backend is forced alone with ``sdpa_kernel``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from octlm import records
from octlm.attention import naive_attention, sdpa_attention, tiled_attention
from octlm.bench import memory
from octlm.bench.suites import Measurement

RESULT_FIELDS = (
    "status",
    "reason",
    "seconds_median",
    "seconds_iqr",
    "seconds",
    "tflops",
    "memory_metric",
    "peak_bytes",
    "baseline_bytes",
    "extra_bytes",
    "pid",
)
SDPA = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
# What torch says when the one allowed SDPA backend cannot take the call.
NO_KERNEL = ("No available kernel", "No viable backend")
# Test hook, for tests/test_bench.py only: OCTLM_BENCH_FAULT="kill:naive,sleep:tiled" makes
# every measurement of a named backend fail that way (kill, sleep, raise or oom).
FAULT_ENV = "OCTLM_BENCH_FAULT"


class Unsupported(Exception):
    """The backend cannot run this measurement here; the message says why."""


def make_record(measurement: Measurement, context: dict, **results) -> dict:
    """One benchmark record: common fields, the measurement, then ``results`` (others None)."""
    spec = asdict(measurement)
    del spec["device"]  # the record's ``device`` is the context's: ``cpu`` or the GPU's name
    record = {**context, **spec, **dict.fromkeys(RESULT_FIELDS)}
    record["memory_metric"] = memory.metric(measurement.device)
    record.update(results)
    return record


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


def attention_call(measurement: Measurement, query, key, value, key_lengths) -> Callable:
    """The measured attention call, with the backend bound."""
    m = measurement
    options = {"causal": m.causal, "window": m.window}
    if m.backend == "naive":
        return lambda: naive_attention(query, key, value, key_lengths=key_lengths, **options)
    if m.backend == "tiled":
        block = tuple(m.block)
        return lambda: tiled_attention(
            query, key, value, block=block, key_lengths=key_lengths, kernel="pytorch", **options
        )  # the Triton kernel is its own backend
    if m.backend in SDPA:

        def call():
            with sdpa_kernel(SDPA[m.backend]):
                return sdpa_attention(query, key, value, key_lengths=key_lengths, **options)

        return call
    if m.backend == "sketch":
        plain = m.causal and not m.window and not m.padding and m.q_len == m.length
        if not plain or m.mode != "forward" or m.kv_heads != m.heads:
            raise Unsupported("the seed's sketch is square causal MHA, forward only")
        from octlm.bench.sketch import seed_sketch

        return lambda: seed_sketch(query, key, value)
    if m.backend == "triton":
        if query.device.type != "cuda":
            raise Unsupported(f"triton runs on CUDA only, not on {query.device.type}")
        if key_lengths is not None:
            raise Unsupported("triton_attention takes no key_lengths (padding)")
        try:
            from octlm.attention import triton_flash
        except ImportError as error:
            raise Unsupported(f"cannot import octlm.attention.triton_flash: {error}") from error
        if not triton_flash.is_available(query.device):
            raise Unsupported("triton is not installed (pip install 'octlm[triton]')")
        return lambda: triton_flash.triton_attention(query, key, value, **options)
    raise ValueError(f"backend must be one of {[*SDPA, 'naive', 'tiled', 'sketch', 'triton']}")


def measure(measurement: Measurement, experiment: str = "bench") -> dict:
    """Run one measurement and return its record; failures become a status and a reason."""
    m = measurement
    context = records.context(experiment, m.device)
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
                reason = "; ".join([f"{m.backend} on {m.device}: {error}", *told])
                results = {"status": "unsupported", "reason": reason[:2000]}
            elif "can't allocate memory" in str(error):  # the CPU allocator's out-of-memory
                results = {"status": "oom", "reason": _describe(error)}
            else:
                results = {"status": "error", "reason": _describe(error)}
        except Exception as error:
            results = {"status": "error", "reason": _describe(error)}
    return make_record(m, context, pid=os.getpid(), **results)


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
    key_lengths = None
    if m.padding:
        kept = round(m.length * (1 - m.padding))
        key_lengths = torch.full((m.batch,), kept, dtype=torch.long, device=device)
    grad_out = torch.randn_like(query, requires_grad=False) if train else None
    call = attention_call(m, query, key, value, key_lengths)

    def step() -> None:
        out = call()
        if train:
            out.backward(grad_out)
            query.grad = key.grad = value.grad = None

    baseline = memory.baseline(m.device)
    _test_fault(m.backend)
    for _ in range(m.warmup):
        step()
    seconds = [_timed(step, device) for _ in range(m.repeats)]
    peak = memory.peak(m.device)
    median = statistics.median(seconds)
    quartiles = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else []
    return {
        "status": "ok",
        "seconds_median": median,
        "seconds_iqr": quartiles[2] - quartiles[0] if quartiles else 0.0,
        "seconds": seconds,
        "tflops": flops(m) / median / 1e12 if median > 0 else None,
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        "extra_bytes": peak - baseline,
    }


def _timed(step: Callable[[], None], device: torch.device) -> float:
    """Wall seconds of one step; CUDA is synchronised on both sides so kernels are counted."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _test_fault(backend: str) -> None:
    """Test hook (see ``FAULT_ENV``): fail the way a real worker can, for one backend."""
    faults = [item.partition(":") for item in os.environ.get(FAULT_ENV, "").split(",")]
    fault = next((fault for fault, _, target in faults if target == backend), None)
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
    return {**records.context("probe", device), "available_bytes": memory.available(device)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--json", help="the Measurement's fields, as JSON")
    task.add_argument("--probe", metavar="DEVICE", help="print the device's context instead")
    parser.add_argument("--experiment", default="bench", help="the record's experiment name")
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe)), flush=True)
        return
    spec = json.loads(args.json)
    if spec.get("block") is not None:
        spec["block"] = tuple(spec["block"])
    print(json.dumps(measure(Measurement(**spec), args.experiment)), flush=True)


if __name__ == "__main__":
    main()
