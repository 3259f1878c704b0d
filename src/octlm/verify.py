"""Equivalence experiments: every attention implementation against the float64 reference.

Each experiment is a generator of DESIGN §5 verification records. :func:`run` appends every
record to ``<out>/<date>-<experiment>.jsonl`` the moment it is computed, so a run that is
killed keeps every finished line. Outputs are judged by the DESIGN §4 rule (against naive
attention in float64, relative to naive attention in the tested dtype); pairwise differences,
the figures the seed quotes (4.8e-7 tiled vs sdpa, 1.1e-6 for the model), go in
``max_abs_diff``.

=================  ==========================================================================
tiled-sdpa         tiled vs sdpa, and sdpa vs naive, over the seed's lengths and blocks
model-equivalence  the whole model's logits and parameter gradients at 8, 4, 2, 1 KV heads
block-invariance   tiled's output is the same for every block size, pairs included
partial-outputs    after each key block, the partial result is attention over the keys so far
gradients          tiled's backward: causal, non-causal, GQA, window, q_len < k_len, strided
decoding           KV-cache decoding gives full-forward logits; greedy tokens agree everywhere
training           20 training steps from one seed give one loss curve for every attention
=================  ==========================================================================
"""

from __future__ import annotations

import datetime as _dt
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from octlm import records
from octlm.attention import (
    IMPLEMENTATIONS,
    implementation,
    naive_attention,
    sdpa_attention,
    tiled_attention,
)
from octlm.attention.blocks import attend_forward, merge, parse_block
from octlm.attention.masks import allowed
from octlm.equality import GRADIENT_FACTOR, Verdict, judge, max_abs_diff
from octlm.model import KVCache, ModelConfig, OctLM
from octlm.train import train

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
QKV = ("query", "key", "value")
# The implementations one process can run; ring is checked in its own distributed tests.
SINGLE_PROCESS = tuple(name for name, impl in IMPLEMENTATIONS.items() if not impl.distributed)
# Two float32 loss curves are "the same" when they differ by what float32 rounding explains.
# Over 20 steps that is ~1e-6 relative (naive in float32 vs float64 differ by 2e-6 on a 2-core
# CPU); 1e-4 leaves room for other machines, while a wrong gradient shows at 1e-2 (a tiled
# backward that ignored strided values moved the curve by 2e-2).
TRAINING_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Plan:
    """The sizes one run covers: :data:`FULL`, :data:`QUICK` (``--quick``), or smaller."""

    lengths: tuple[int, ...]  # tiled vs sdpa, the seed's table
    blocks: tuple[int, ...]
    invariance_length: int
    invariance_blocks: tuple[int | tuple[int, int], ...]
    partial_length: int
    partial_blocks: tuple[int, ...]
    gradient_length: int
    gradient_blocks: tuple[int | tuple[int, int], ...]
    model: dict  # ModelConfig fields shared by the model-level experiments
    model_batch: int
    model_length: int
    kv_heads: tuple[int, ...]
    prompt_length: int
    new_tokens: int
    train_steps: int
    train_batch: int
    train_length: int


FULL = Plan(
    lengths=(128, 512, 1024),
    blocks=(64, 128, 256),
    invariance_length=1024,
    invariance_blocks=(16, 32, 64, 128, 256, 512, 1024, (64, 256), (256, 64), (32, 512)),
    partial_length=1024,
    partial_blocks=(64, 256),
    gradient_length=512,
    gradient_blocks=(64, (128, 32)),
    model=dict(vocab_size=256, width=256, n_layers=4, n_heads=8, max_length=512, block=64),
    model_batch=2,
    model_length=256,
    kv_heads=(8, 4, 2, 1),
    prompt_length=32,
    new_tokens=64,
    train_steps=20,
    train_batch=4,
    train_length=64,
)
QUICK = Plan(
    lengths=(128, 512, 1024),
    blocks=(64, 128, 256),
    invariance_length=512,
    invariance_blocks=(32, 64, 128, 512, (64, 128), (128, 32)),
    partial_length=256,
    partial_blocks=(64,),
    gradient_length=256,
    gradient_blocks=(64,),
    model=dict(vocab_size=256, width=128, n_layers=2, n_heads=8, max_length=256, block=32),
    model_batch=2,
    model_length=128,
    kv_heads=(8, 4, 2, 1),
    prompt_length=16,
    new_tokens=24,
    train_steps=20,
    train_batch=4,
    train_length=64,
)


@dataclass(frozen=True)
class Case:
    """The attention shape a record is about: the DESIGN §5 fields and the inputs' sizes."""

    length: int  # keys (and queries, unless q_len is given)
    kv_heads: int = 8
    heads: int = 8
    head_size: int = 32
    batch: int = 1
    causal: bool = True
    window: int = 0
    block: int | tuple[int, int] | None = None
    q_len: int | None = None
    strided: bool = False  # inputs laid out (B, L, heads, D) and transposed, as a model's are

    @property
    def queries(self) -> int:
        return self.length if self.q_len is None else self.q_len

    def options(self) -> dict:
        return {"causal": self.causal, "window": self.window}


def default_dtypes(device: str) -> tuple[str, ...]:
    """float32 and bfloat16 on CPU; on CUDA also float16, the GPU's other half precision."""
    if device.startswith("cuda"):
        return ("float32", "float16", "bfloat16")
    return ("float32", "bfloat16")


def _record(
    check: str,
    left: str,
    right: str,
    case: Case,
    dtype: torch.dtype,
    verdict: Verdict,
    diff: float,
    **extra,
) -> dict:
    """One verification record (DESIGN §5), without the context fields :func:`run` adds."""
    return {
        "check": check,
        "left": left,
        "right": right,
        "dtype": str(dtype).removeprefix("torch."),
        "length": case.length,
        "q_len": case.queries,
        "block": case.block,
        "kv_heads": case.kv_heads,
        "head_size": case.head_size,
        "causal": case.causal,
        "window": case.window,
        "error": verdict.error,
        "base_error": verdict.base_error,
        "tolerance": verdict.tolerance,
        "max_abs_diff": diff,
        "passed": verdict.passed,
        **extra,
    }


def _inputs(case: Case, dtype: torch.dtype, device: str, seed: int = 0) -> list[Tensor]:
    """Query, key, value ``(B, heads, L, D)`` drawn in float64 then rounded to ``dtype``: every
    dtype sees the same numbers, and ``x.double()`` is the reference's input. They are drawn
    ``(B, L, heads, D)`` and transposed; ``case.strided`` keeps that layout, as in a model."""
    generator = torch.Generator().manual_seed(seed)
    query = (case.batch, case.queries, case.heads, case.head_size)
    key = (case.batch, case.length, case.kv_heads, case.head_size)
    drawn = [torch.randn(s, generator=generator, dtype=torch.float64) for s in (query, key, key)]
    inputs = [x.to(device, dtype).transpose(1, 2) for x in drawn]
    return inputs if case.strided else [x.contiguous() for x in inputs]


def _attend(name: str, query: Tensor, key: Tensor, value: Tensor, case: Case) -> Tensor:
    impl = implementation(name)
    tuning = {"block": case.block, "kernel": "pytorch"} if "block" in impl.tuning else {}
    return impl.function(query, key, value, **case.options(), **tuning)


def tiled_vs_sdpa(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """The seed's table (batch 1, 8 heads of 32, causal): tiled vs sdpa for each length and
    block, and sdpa vs naive, each judged against float64 naive attention."""
    for dtype in dtypes:
        for length in plan.lengths:
            case = Case(length)
            query, key, value = _inputs(case, dtype, device)
            reference = naive_attention(query.double(), key.double(), value.double())
            base = naive_attention(query, key, value)
            sdpa = sdpa_attention(query, key, value)
            verdict = judge(sdpa, base, reference)
            diff = max_abs_diff(sdpa, base)
            yield _record("sdpa vs naive output", "sdpa", "naive", case, dtype, verdict, diff)
            for block in plan.blocks:
                case = replace(case, block=block)
                tiled = tiled_attention(query, key, value, block=block)
                verdict, diff = judge(tiled, base, reference), max_abs_diff(tiled, sdpa)
                yield _record("tiled vs sdpa output", "tiled", "sdpa", case, dtype, verdict, diff)


def block_invariance(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """Tiled's output for every block size (pairs too) against the first block's output; the
    seed found them "the same to about 1e-7"."""
    length = plan.invariance_length
    cases = (
        Case(length),
        Case(length, kv_heads=2, window=length // 5),
        Case(length, kv_heads=1, causal=False),
    )
    first = plan.invariance_blocks[0]
    for dtype in dtypes:
        for shape in cases:
            query, key, value = _inputs(shape, dtype, device)
            reference = naive_attention(
                query.double(), key.double(), value.double(), **shape.options()
            )
            base = naive_attention(query, key, value, **shape.options())
            outputs = {}
            for block in plan.invariance_blocks:
                case = replace(shape, block=block)
                outputs[block] = _attend("tiled", query, key, value, case)
                verdict = judge(outputs[block], base, reference)
                diff = max_abs_diff(outputs[block], outputs[first])
                yield _record(
                    "tiled output across block sizes", "tiled", f"tiled block {first}", case,
                    dtype, verdict, diff,
                )  # fmt: skip


def partial_outputs(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """After each key block, the partial result is already attention over the keys read so far.

    Built from the public block steps: ``attend_forward`` over keys ``[0, stop)`` ("prefix"),
    and the per-block results folded together with ``merge`` ("merged"). Each is compared with
    naive attention over the keys read so far (causal rows see only keys up to themselves).
    The log-sum-exp is judged too; it must never fall as keys are added and must stay within
    ``[max, max + log(keys seen)]`` of the running maximum of the float64 scores, which itself
    never falls. The tiled loop's own running maximum is internal and not observed.
    """
    for dtype in dtypes:
        for causal, kv_heads in ((True, 8), (False, 2)):
            shape = Case(plan.partial_length, kv_heads=kv_heads, causal=causal)
            inputs = _inputs(shape, dtype, device)
            for block in plan.partial_blocks:
                yield from _partial_case(replace(shape, block=block), *inputs)


_PARTIAL = {
    "prefix": "attend_forward over keys [0, stop)",
    "merged": "attend_forward per key block, folded by merge",
}


def _partial_case(case: Case, query: Tensor, key: Tensor, value: Tensor) -> Iterator[dict]:
    dtype = query.dtype
    visible = allowed(range(case.length), range(case.length), 0, case.causal, 0, query.device)
    # One score matrix per precision, sliced at each stop: recomputing it per stop would
    # change its rounding (the matmul blocks differently), and the maximum could seem to fall.
    base_scores, ref_scores = (
        _scores(query.to(precision), key.to(precision), visible)
        for precision in (dtype, torch.float64)
    )  # (B, H, Q, K) each, -inf where hidden
    previous = {}  # last stop's running maximum and each method's lse
    for stop, results in _partial_steps(query, key, value, case):
        seen = visible[:, :stop]  # (Q, stop)
        read = key[:, :, :stop], value[:, :, :stop]
        base_out, ref_out = (
            naive_attention(*(x.to(precision) for x in (query, *read)), causal=False, mask=seen)
            for precision in (dtype, torch.float64)
        )  # (B, H, Q, D) each
        base_lse, ref_lse = (s[..., :stop].logsumexp(dim=-1) for s in (base_scores, ref_scores))
        running_max = ref_scores[..., :stop].amax(dim=-1)  # (B, H, Q)
        max_rises = bool((running_max >= previous.get("max", running_max)).all())
        previous["max"] = running_max
        for method, (out, lse) in results.items():
            verdict = judge(out.to(dtype), base_out, ref_out)
            lse_verdict = judge(lse.to(dtype), base_lse, ref_lse)
            slack, lse = lse_verdict.tolerance, lse.double()  # (B, H, Q)
            bounded = bool(
                (running_max <= lse + slack).all()
                and (lse <= running_max + seen.sum(dim=-1).log() + slack).all()
            )
            lse_rises = bool((lse >= previous.get(method, lse) - slack).all())
            previous[method] = lse
            passed = all((verdict.passed, lse_verdict.passed, bounded, lse_rises, max_rises))
            yield _record(
                f"partial output and lse vs naive over keys read so far ({_PARTIAL[method]}); "
                "lse never falls; max <= lse <= max + log(keys); fp64 running max never falls",
                f"tiled {method}", "naive over keys read so far", case, dtype,
                replace(verdict, passed=passed), max_abs_diff(out.to(dtype), base_out),
                keys_read=stop, lse_error=lse_verdict.error, lse_tolerance=slack,
                lse_bounded=bounded, lse_never_falls=lse_rises, running_max_never_falls=max_rises,
            )  # fmt: skip


def _scores(query: Tensor, key: Tensor, visible: Tensor) -> Tensor:
    """Scaled scores ``(B, H, Q, K)``, -inf where ``visible (Q, K)`` is False."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # (B, H, K, D)
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])  # (B, H, Q, K)
    return scores.masked_fill(~visible, float("-inf"))


def _partial_steps(query: Tensor, key: Tensor, value: Tensor, case: Case):
    """``(stop, {"prefix": (out, lse), "merged": (out, lse)})`` after each key block."""
    block = parse_block(case.block)
    options = dict(causal=case.causal, scale=1.0 / math.sqrt(case.head_size), block=block)
    merged = None
    for start in range(0, case.length, block[1]):
        stop = min(start + block[1], case.length)
        prefix = attend_forward(query, key[:, :, :stop], value[:, :, :stop], past=0, **options)
        # Query row i sits at key position i: in this chunk's own numbering, i - start.
        chunk = attend_forward(
            query, key[:, :, start:stop], value[:, :, start:stop], past=-start, **options
        )
        merged = chunk if merged is None else merge(*merged, *chunk)
        yield stop, {"prefix": prefix, "merged": merged}


def gradients(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """dq, dk, dv of tiled against float64 autograd through naive (DESIGN §4, factor 3):
    causal, non-causal, GQA, window, fewer queries than keys, and strided inputs."""
    length = plan.gradient_length
    shapes = (
        Case(length),
        Case(length, causal=False),
        Case(length, kv_heads=2),
        Case(length, kv_heads=2, window=length // 4),
        Case(length, kv_heads=1, q_len=length // 4),
        Case(length, kv_heads=2, batch=2, strided=True),
    )
    for dtype in dtypes:
        for shape in shapes:
            inputs = _inputs(shape, dtype, device)
            generator = torch.Generator().manual_seed(1)
            grad_out = torch.randn(inputs[0].shape, generator=generator, dtype=torch.float64)
            grad_out = grad_out.to(device, dtype)
            reference = _input_grads("naive", [x.double() for x in inputs], grad_out, shape)
            base = _input_grads("naive", inputs, grad_out, shape)
            for block in plan.gradient_blocks:
                case = replace(shape, block=block)
                tested = _input_grads("tiled", inputs, grad_out, case)
                for which, *grads in zip(QKV, tested, base, reference, strict=True):
                    verdict = judge(*grads, factor=GRADIENT_FACTOR)
                    diff = max_abs_diff(*grads[:2])
                    yield _record(
                        f"gradient of {which}", "tiled", "naive", case, dtype, verdict, diff,
                        strided=case.strided,
                    )  # fmt: skip


def _input_grads(name: str, inputs: list[Tensor], grad_out: Tensor, case: Case) -> list[Tensor]:
    leaves = [x.detach().requires_grad_() for x in inputs]
    _attend(name, *leaves, case).backward(grad_out.to(leaves[0].dtype))
    return [leaf.grad for leaf in leaves]


def _weights(config: ModelConfig) -> dict:
    """A fresh model's state dict from seed 0, leaving the caller's random state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return OctLM(config).state_dict()


def _model(config: ModelConfig, attention: str, state: dict, device: str, dtype: torch.dtype):
    """``OctLM`` with ``state``'s weights, running ``attention``, in eval mode."""
    model = OctLM(replace(config, attention=attention))
    model.load_state_dict(state)
    return model.to(device, dtype).eval()


def _model_case(plan: Plan, config: ModelConfig, length: int) -> Case:
    return Case(
        length, kv_heads=config.n_kv_heads, heads=config.n_heads, head_size=config.head_size,
        batch=plan.model_batch, window=config.window, block=config.block,
    )  # fmt: skip


def model_equivalence(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """The whole model, identical weights, through sdpa and tiled vs naive: logits and every
    parameter's gradient of the cross-entropy, at each number of KV heads (the seed's 1.1e-6).
    Gradients are judged parameter by parameter; the record names the worst one."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(256, (plan.model_batch, plan.model_length + 1), generator=generator)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    for kv_heads in plan.kv_heads:
        config = ModelConfig(**plan.model, n_kv_heads=kv_heads, attention="naive")
        state = _weights(config)
        case = _model_case(plan, config, plan.model_length)
        reference = _logits_and_grads(
            _model(config, "naive", state, device, torch.float64), inputs, targets
        )
        for dtype in dtypes:
            base = _logits_and_grads(_model(config, "naive", state, device, dtype), inputs, targets)
            for name in ("sdpa", "tiled"):
                model = _model(config, name, state, device, dtype)
                logits, grads = _logits_and_grads(model, inputs, targets)
                verdict = judge(logits, base[0], reference[0])
                diff = max_abs_diff(logits, base[0])
                yield _record("model logits", name, "naive", case, dtype, verdict, diff)
                verdicts = {
                    parameter: judge(
                        grad, base[1][parameter], reference[1][parameter], factor=GRADIENT_FACTOR
                    )
                    for parameter, grad in grads.items()
                }
                worst = max(verdicts, key=lambda p: verdicts[p].error / verdicts[p].tolerance)
                passed = all(v.passed for v in verdicts.values())
                diff = max(max_abs_diff(grad, base[1][p]) for p, grad in grads.items())
                yield _record(
                    "model parameter gradients (worst parameter)", name, "naive", case, dtype,
                    replace(verdicts[worst], passed=passed), diff, parameter=worst,
                    parameters=len(verdicts),
                )  # fmt: skip


def _logits_and_grads(model: OctLM, inputs: Tensor, targets: Tensor):
    logits = model(inputs)  # (B, T, V)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def decoding(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """KV-cache decoding (a prompt, then one token per call) gives the logits of one full
    forward, for each implementation; and greedy generation picks the same tokens in every
    implementation, each the argmax of a full forward over the sequence so far (float32)."""
    length = plan.prompt_length + plan.new_tokens
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(256, (plan.model_batch, length), generator=generator).to(device)
    prompt = tokens[:, : plan.prompt_length]
    for window in (0, plan.prompt_length // 2 + 1):
        config = ModelConfig(**plan.model, n_kv_heads=2, window=window, attention="naive")
        state = _weights(config)
        case = _model_case(plan, config, length)
        with torch.no_grad():
            reference = _model(config, "naive", state, device, torch.float64)(tokens)
            for dtype in dtypes:
                base = _model(config, "naive", state, device, dtype)(tokens)
                for name in SINGLE_PROCESS:
                    model = _model(config, name, state, device, dtype)
                    full = model(tokens)  # (B, T, V)
                    cached = _cached_logits(model, tokens, plan.prompt_length)
                    verdict = judge(cached, base, reference)
                    yield _record(
                        "cached decoding logits vs one full forward", f"{name} cached",
                        f"{name} full forward", case, dtype, verdict, max_abs_diff(cached, full),
                        prompt_length=plan.prompt_length,
                    )  # fmt: skip
            yield from _greedy(plan, config, state, prompt, device, case)


def _cached_logits(model: OctLM, tokens: Tensor, prompt_length: int) -> Tensor:
    """Logits ``(B, T, V)`` from a prefill of the prompt, then one token per call."""
    cache = KVCache(model.config)
    logits = [model(tokens[:, :prompt_length], cache=cache)]
    for position in range(prompt_length, tokens.shape[1]):
        logits.append(model(tokens[:, position : position + 1], cache=cache))
    return torch.cat(logits, dim=1)


def _greedy(
    plan: Plan, config: ModelConfig, state: dict, prompt: Tensor, device: str, case: Case
) -> Iterator[dict]:
    """Greedy tokens in float32: equal across implementations and to full-forward argmaxes."""
    generated = {}
    for name in SINGLE_PROCESS:
        model = _model(config, name, state, device, torch.float32)
        sequence = model.generate(prompt, plan.new_tokens)  # (B, P + N)
        argmax = model(sequence[:, :-1])[:, plan.prompt_length - 1 :].argmax(dim=-1)  # (B, N)
        generated[name] = (sequence, int((argmax != sequence[:, plan.prompt_length :]).sum()))
    for name, (sequence, mismatched) in generated.items():
        differing = int((sequence != generated["naive"][0]).sum())
        verdict = Verdict(mismatched, generated["naive"][1], 0, mismatched == 0 and differing == 0)
        yield _record(
            "greedy tokens: generate == full-forward argmax (error), == naive's (max_abs_diff)",
            f"{name} generate", "naive generate", case, torch.float32, verdict, differing,
            unit="tokens", new_tokens=plan.new_tokens,
        )  # fmt: skip


def training(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """The same seed, weights and batches give the same float32 loss curve through every
    attention. ``train`` runs on the CPU, whatever ``device`` is."""
    config = ModelConfig(**plan.model, n_kv_heads=2, attention="naive")
    case = replace(_model_case(plan, config, plan.train_length), batch=plan.train_batch)
    options = dict(steps=plan.train_steps, batch=plan.train_batch, length=plan.train_length)
    reference = train(config, dtype=torch.float64, **options)
    curves = {name: train(replace(config, attention=name), **options) for name in SINGLE_PROCESS}
    base_error = _relative(curves["naive"], reference)
    for name, curve in curves.items():
        error = _relative(curve, curves["naive"])
        verdict = Verdict(error, base_error, TRAINING_TOLERANCE, error <= TRAINING_TOLERANCE)
        diff = max(abs(a - b) for a, b in zip(curve, curves["naive"], strict=True))
        yield _record(
            f"loss curve, {plan.train_steps} steps: max relative difference from naive float32 "
            f"<= {TRAINING_TOLERANCE:g} (float32 rounding; base_error: naive float32 vs float64)",
            name, "naive", case, torch.float32, verdict, diff, device="cpu", steps=plan.train_steps,
            losses=curve, reference_losses=reference,
        )  # fmt: skip


def _relative(curve: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))


EXPERIMENTS: dict[str, Callable[[Plan, str, Sequence[torch.dtype]], Iterator[dict]]] = {
    "tiled-sdpa": tiled_vs_sdpa,
    "model-equivalence": model_equivalence,
    "block-invariance": block_invariance,
    "partial-outputs": partial_outputs,
    "gradients": gradients,
    "decoding": decoding,
    "training": training,
}


def check_options(device: str, dtypes: Sequence[str], experiments: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the option that :func:`run` cannot use."""
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:index], got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this PyTorch sees no CUDA device")
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"dtype must be among {list(DTYPES)}, got {name!r}")
    for name in experiments:
        if name not in EXPERIMENTS:
            raise ValueError(f"experiment must be among {list(EXPERIMENTS)}, got {name!r}")


def run(
    out: str | Path = "runs",
    *,
    plan: Plan = FULL,
    device: str = "cpu",
    dtypes: Sequence[str] | None = None,
    experiments: Sequence[str] | None = None,
    progress: bool = True,
) -> tuple[list[dict], list[Path]]:
    """Run the experiments, appending each record to ``out/<date>-<experiment>.jsonl`` (UTC
    date) as soon as it is computed; a progress bar per experiment goes to stderr.

    Returns every record and the files written. ``dtypes`` (names in :data:`DTYPES`) default
    to :func:`default_dtypes`; ``experiments`` to all of :data:`EXPERIMENTS`, in order.
    """
    check_options(device, dtypes or (), experiments or ())
    dtypes = default_dtypes(device) if dtypes is None else tuple(dtypes)
    experiments = list(EXPERIMENTS) if experiments is None else list(experiments)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    found, paths = [], []
    for experiment in experiments:
        path = Path(out) / f"{date}-{experiment}.jsonl"
        paths.append(path)
        failed = 0
        # disable=None: a bar on a terminal, none in a log file.
        bar = tqdm(
            desc=experiment, unit=" checks", file=sys.stderr, disable=None if progress else True
        )
        with bar:
            for fields in EXPERIMENTS[experiment](plan, device, [DTYPES[d] for d in dtypes]):
                record = {**records.context(experiment, device), **fields}
                records.append(path, record)
                found.append(record)
                failed += not record["passed"]
                bar.update()
                bar.set_postfix_str(f"{failed} failed" if failed else "all passed")
    return found, paths


def summary(found: Sequence[dict]) -> str:
    """A compact table: per experiment, check, left side and dtype, the worst error (largest
    against its tolerance) beside the plain method's error and the tolerance they give, the
    largest pairwise difference, and the verdict."""
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for record in found:
        key = (record["experiment"], record["check"], record["left"], record["dtype"])
        groups.setdefault(key, []).append(record)
    rows = [
        ("experiment", "check", "left", "dtype", "n", "worst error", "naive's error", "tolerance",
         "max diff", "result"),
    ]  # fmt: skip
    for (experiment, check, left, dtype), group in groups.items():
        worst = max(
            group, key=lambda r: r["error"] / r["tolerance"] if r["tolerance"] else r["error"]
        )
        failed = sum(not r["passed"] for r in group)
        rows.append((
            experiment,
            check if len(check) <= 40 else check[:39] + "…",
            left,
            dtype,
            str(len(group)),
            f"{worst['error']:.3g}",
            f"{worst['base_error']:.3g}",
            f"{worst['tolerance']:.3g}",
            f"{max(r['max_abs_diff'] for r in group):.3g}",
            f"FAIL ({failed})" if failed else "pass",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
