"""What the score matrices of MATH and naive would need, so the driver skips a size that cannot
fit (the memory probes are :mod:`octlm.memory`'s)."""

from __future__ import annotations

import torch

# Score-sized (batch, heads, q_len, k_len) tensors alive at the peak: scores, mask,
# probabilities, and in training their gradients; counts rounded up from the peaks measured
# on CPU (docs/benchmarks.md, memory guard).
SCORE_MATRICES = {
    ("math", "forward"): 3,
    ("math", "train"): 4,
    ("naive", "forward"): 4,
    ("naive", "train"): 5,
}


def score_bytes(
    backend: str, mode: str, batch: int, heads: int, q_len: int, k_len: int, dtype: torch.dtype
) -> int:
    """Estimated bytes of the score matrices that ``backend`` materialises (0 for the rest)."""
    matrices = SCORE_MATRICES.get((backend, mode), 0)
    # MATH upcasts half-precision inputs and softmaxes in float32 (PyTorch >= 2.5); naive
    # stays in the input dtype.
    element = torch.finfo(dtype).bits // 8
    if backend == "math":
        element = max(element, 4)
    return matrices * batch * heads * q_len * k_len * element
