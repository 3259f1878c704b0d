"""Attention-level experiments: tiled against sdpa and naive, across block sizes, its partial
results block by block, and its backward."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from octlm.attention import naive_attention, sdpa_attention, tiled_attention
from octlm.attention.masks import allowed
from octlm.attention.tiled.core import Rules, merge
from octlm.attention.tiled.engine import attend_forward
from octlm.attention.tiled.options import parse_block
from octlm.equality import GRADIENT_FACTOR, judge, max_abs_diff
from octlm.lab.verify.cases import QKV, Case, attend, inputs, record
from octlm.lab.verify.plan import Plan


def tiled_vs_sdpa(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """The reference shape (batch 1, 8 heads of 32, causal): tiled vs sdpa for each length and
    block, and sdpa vs naive, each judged against float64 naive attention."""
    for dtype in dtypes:
        for length in plan.lengths:
            case = Case(length)
            query, key, value = inputs(case, dtype, device)
            reference = naive_attention(query.double(), key.double(), value.double())
            base = naive_attention(query, key, value)
            sdpa = sdpa_attention(query, key, value)
            verdict = judge(sdpa, base, reference)
            diff = max_abs_diff(sdpa, base)
            yield record("sdpa vs naive output", "sdpa", "naive", case, dtype, verdict, diff)
            for block in plan.blocks:
                case = replace(case, block=block)
                tiled = tiled_attention(query, key, value, block=block)
                verdict, diff = judge(tiled, base, reference), max_abs_diff(tiled, sdpa)
                yield record("tiled vs sdpa output", "tiled", "sdpa", case, dtype, verdict, diff)


def block_invariance(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """Tiled's output for every block size (pairs too) against the first block's output: block
    sizes change the result by float32 rounding only."""
    length = plan.invariance_length
    cases = (
        Case(length),
        Case(length, kv_heads=2, window=length // 5),
        Case(length, kv_heads=1, causal=False),
    )
    first = plan.invariance_blocks[0]
    for dtype in dtypes:
        for shape in cases:
            query, key, value = inputs(shape, dtype, device)
            reference = naive_attention(
                query.double(), key.double(), value.double(), **shape.options()
            )
            base = naive_attention(query, key, value, **shape.options())
            outputs = {}
            for block in plan.invariance_blocks:
                case = replace(shape, block=block)
                outputs[block] = attend("tiled", query, key, value, case)
                verdict = judge(outputs[block], base, reference)
                diff = max_abs_diff(outputs[block], outputs[first])
                yield record(
                    "tiled output across block sizes",
                    "tiled",
                    f"tiled block {first}",
                    case,
                    dtype,
                    verdict,
                    diff,
                )


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
            tensors = inputs(shape, dtype, device)
            for block in plan.partial_blocks:
                yield from _partial_case(replace(shape, block=block), *tensors)


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
            yield record(
                f"partial output and lse vs naive over keys read so far ({_PARTIAL[method]}); "
                "lse never falls; max <= lse <= max + log(keys); fp64 running max never falls",
                f"tiled {method}",
                "naive over keys read so far",
                case,
                dtype,
                replace(verdict, passed=passed),
                max_abs_diff(out.to(dtype), base_out),
                keys_read=stop,
                lse_error=lse_verdict.error,
                lse_tolerance=slack,
                lse_bounded=bounded,
                lse_never_falls=lse_rises,
                running_max_never_falls=max_rises,
            )


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
        prefix = attend_forward(
            query, key[:, :, :stop], value[:, :, :stop], Rules(past=0, **options)
        )
        # Query row i sits at key position i: in this chunk's own numbering, i - start.
        chunk = attend_forward(
            query, key[:, :, start:stop], value[:, :, start:stop], Rules(past=-start, **options)
        )
        merged = chunk if merged is None else merge(*merged, *chunk)
        yield stop, {"prefix": prefix, "merged": merged}


def gradients(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """dq, dk, dv of tiled against float64 autograd through naive (docs/design.md, 'When are two
    results equal', factor 3): causal, non-causal, GQA, window, fewer queries than keys, and strided
    inputs."""
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
            tensors = inputs(shape, dtype, device)
            generator = torch.Generator().manual_seed(1)
            grad_out = torch.randn(tensors[0].shape, generator=generator, dtype=torch.float64)
            grad_out = grad_out.to(device, dtype)
            reference = _input_grads("naive", [x.double() for x in tensors], grad_out, shape)
            base = _input_grads("naive", tensors, grad_out, shape)
            for block in plan.gradient_blocks:
                case = replace(shape, block=block)
                tested = _input_grads("tiled", tensors, grad_out, case)
                for which, *grads in zip(QKV, tested, base, reference, strict=True):
                    verdict = judge(*grads, factor=GRADIENT_FACTOR)
                    diff = max_abs_diff(*grads[:2])
                    yield record(
                        f"gradient of {which}",
                        "tiled",
                        "naive",
                        case,
                        dtype,
                        verdict,
                        diff,
                        strided=case.strided,
                    )


def _input_grads(name: str, tensors: list[Tensor], grad_out: Tensor, case: Case) -> list[Tensor]:
    leaves = [x.detach().requires_grad_() for x in tensors]
    attend(name, *leaves, case).backward(grad_out.to(leaves[0].dtype))
    return [leaf.grad for leaf in leaves]
