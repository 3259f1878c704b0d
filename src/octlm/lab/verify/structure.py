"""The structure and score keywords (docs/design.md, 'Tensor conventions') in every implementation
that takes them: packed documents, left padding, softcap, ALiBi, sinks and a block mask, forward and
backward, each judged against float64 naive attention given the same keywords."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from octlm.attention import IMPLEMENTATIONS, block_mask, naive_attention
from octlm.attention.block_masks import prefix_lm_mod
from octlm.equality import GRADIENT_FACTOR, OUTPUT_FACTOR, judge, max_abs_diff
from octlm.lab.verify.cases import QKV, Case, inputs, record
from octlm.lab.verify.plan import Plan

# Slopes and sinks are learned: their gradients are judged beside the inputs'.
LEARNED = ("alibi_slopes", "sinks")


def _documents(case: Case, device: str) -> Tensor:
    """Document ids ``(batch, length)``: a different random packing per row, with documents
    that cross block edges and one of a single token."""
    rows = []
    for row in range(case.batch):
        generator = torch.Generator().manual_seed(row)
        starts = torch.randperm(case.length - 2, generator=generator)[:6] + 1  # (6,)
        starts = torch.cat([starts, starts[:1] + 1])  # a document of one token
        rows.append((torch.arange(case.length)[:, None] >= starts[None, :]).sum(dim=1))
    return torch.stack(rows).to(device)  # (B, T)


def _prefix_lm(case: Case, device: str) -> dict:
    """A prefix-LM block mask on the case's own tiles: a quarter, then half, of each row."""
    prefix = torch.tensor([case.length // 4, case.length // 2], device=device)  # (B,)
    mask = block_mask(
        prefix_lm_mod(prefix),
        case.batch,
        case.heads,
        case.queries,
        case.length,
        block=case.block,
        device=device,
    )
    return {"block_mask": mask}


# name: (what the case changes in the shape, the keywords for a case and device)
STRUCTURES: dict[str, tuple[dict, Callable[[Case, str], dict]]] = {
    "documents": ({}, lambda case, device: {"document_ids": _documents(case, device)}),
    "documents, fewer queries than keys": (
        {"q_len": 48},
        lambda case, device: {"document_ids": _documents(case, device)},
    ),
    "left padding": (
        {"batch": 3},
        lambda case, device: {
            "key_starts": torch.tensor([case.length // 3, 0, case.length - 5], device=device)
        },
    ),
    "softcap": ({}, lambda case, device: {"softcap": 2.0}),
    "alibi": (
        {},
        lambda case, device: {
            "alibi_slopes": 2.0 ** (-8.0 * torch.arange(1.0, case.heads + 1) / case.heads)
        },
    ),
    "sinks": ({}, lambda case, device: {"sinks": torch.linspace(-1.0, 3.0, case.heads)}),
    "block mask (prefix-LM)": ({"causal": False}, lambda case, device: _prefix_lm(case, device)),
}


def structure(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """For each case of :data:`STRUCTURES`, every single-process implementation whose features
    include its keywords: the output and the gradients of query, key, value (and of ALiBi
    slopes and sinks), judged by docs/design.md, 'When are two results equal' against naive
    attention in float64."""
    shape = Case(plan.structure_length, kv_heads=2, batch=2, block=plan.structure_block)
    for dtype in dtypes:
        for name, (changes, keywords) in STRUCTURES.items():
            case = replace(shape, **changes)
            features = keywords(case, device)
            tensors = inputs(case, dtype, device)
            generator = torch.Generator().manual_seed(1)
            grad_out = torch.randn(tensors[0].shape, generator=generator, dtype=torch.float64)
            plain = replace(case, block=None)  # naive takes no tiles
            reference = _results(naive_attention, plain, tensors, features, grad_out, torch.float64)
            base = _results(naive_attention, plain, tensors, features, grad_out, dtype)
            for impl in IMPLEMENTATIONS.values():
                if impl.distributed or impl.function is naive_attention:
                    continue  # ring runs in its own process tests; naive is the base
                if not set(features) <= set(impl.features):
                    continue
                tuned = case if "block" in impl.tuning else plain
                tested = _results(impl.function, tuned, tensors, features, grad_out, dtype)
                for which, *results in zip(
                    tested, tested.values(), base.values(), reference.values(), strict=True
                ):
                    factor = OUTPUT_FACTOR if which == "output" else GRADIENT_FACTOR
                    verdict = judge(*results, factor=factor)
                    diff = max_abs_diff(*results[:2])
                    yield record(
                        f"{name}: {which}",
                        impl.name,
                        "naive",
                        tuned,
                        dtype,
                        verdict,
                        diff,
                        structure=name,
                        keywords=sorted(features),
                    )


def _results(function, case: Case, tensors, features: dict, grad_out, dtype) -> dict:
    """``{"output": ..., "gradient of query": ..., ...}`` of one call in ``dtype``; learned
    keywords (slopes, sinks) are leaves too, so their gradients are included. A case with a
    block runs in the plain-PyTorch tiles of that size."""
    leaves = {
        which: t.detach().to(dtype).requires_grad_() for which, t in zip(QKV, tensors, strict=True)
    }
    given = dict(features)
    for name in LEARNED:
        if name in given:
            learned = given[name].to(tensors[0].device, dtype).requires_grad_()
            given[name] = leaves[name] = learned
    tuning = {"block": case.block, "kernel": "pytorch"} if case.block is not None else {}
    out = function(*(leaves[which] for which in QKV), **case.options(), **given, **tuning)
    out.backward(grad_out.to(out.dtype))
    return {"output": out.detach()} | {
        f"gradient of {which}": leaf.grad for which, leaf in leaves.items()
    }
