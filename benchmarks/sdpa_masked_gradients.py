"""How often ``sdpa_attention`` with a dense mask meets the equality rule (docs/design.md, 'When are
two results equal'), against the plain method and the float64 reference, over random inputs: the
probe behind ``attention="auto"`` keeping structured calls on tiled however small they are.

    .venv/bin/python benchmarks/sdpa_masked_gradients.py > runs/checks/sdpa-masked-gradients.txt

40 tokens, 4 heads on 2 KV heads of 32, float32, one thread; for each structure, 30 seeds, and
for each the output and the three input gradients are judged (120 verdicts a structure).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests.helpers holds the reference

from octlm.attention import naive_attention, sdpa_attention
from octlm.equality import GRADIENT_FACTOR, OUTPUT_FACTOR, judge
from tests.helpers import make_qkv, reference

LENGTH, SEEDS = 40, 30


def _documents() -> torch.Tensor:
    ids = torch.zeros(2, LENGTH, dtype=torch.long)  # (B, T): three documents, then two
    ids[0, LENGTH // 3 :], ids[0, 2 * LENGTH // 3 :], ids[1, LENGTH // 2 :] = 1, 2, 1
    return ids


STRUCTURES = {
    "no mask": {},
    "window 3": {"window": 3},
    "window 9": {"window": 9},
    "documents": {"document_ids": _documents()},
    "right padding": {"key_lengths": torch.tensor([LENGTH, 17])},
    "softcap 2": {"softcap": 2.0},
}


def _run(function, tensors, grad_out, keywords, double=False) -> list[torch.Tensor]:
    leaves = [(x.double() if double else x).detach().clone().requires_grad_() for x in tensors]
    out = function(*leaves, **keywords)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def main() -> None:
    torch.set_num_threads(1)
    for name, keywords in STRUCTURES.items():
        misses = []
        for seed in range(SEEDS):
            tensors = make_qkv(heads=4, kv_heads=2, q_len=LENGTH, seed=seed)
            generator = torch.Generator().manual_seed(seed)
            grad_out = torch.randn(tensors[0].shape, dtype=torch.float64, generator=generator)
            golden = _run(reference, tensors, grad_out, keywords, double=True)
            base = _run(naive_attention, tensors, grad_out, keywords)
            tested = _run(sdpa_attention, tensors, grad_out, keywords)
            for part, mine, theirs, gold in zip(("out", "dq", "dk", "dv"), tested, base, golden,
                                                strict=True):  # fmt: skip
                factor = OUTPUT_FACTOR if part == "out" else GRADIENT_FACTOR
                verdict = judge(mine, theirs, gold, factor=factor)
                if not verdict.passed:
                    misses.append(f"seed {seed} {part}: {verdict}")
        print(f"{name}: {len(misses)} of {4 * SEEDS} verdicts miss the rule")
        for miss in misses:
            print(f"  {miss}")


if __name__ == "__main__":
    main()
