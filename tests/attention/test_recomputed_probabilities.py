"""tiled's backward recomputes the forward's probabilities exactly where the forward's shift is
a row's only score, and its bfloat16 gradients meet flash-attn's own test rule.

A row that sees exactly one key has probability 1: its key's ``dv`` is exactly the ``dO`` of the
rows that see it, and any rounding in the recomputed probability shows up there. flash-attn's
rule for low-precision gradients: ``max|tested - ref| <= 2 * max|low - ref| + 1e-5``, with
``ref`` the float64 reference rounded to the tested dtype and ``low`` the plain method (naive)
run in that dtype.
"""

from __future__ import annotations

import pytest
import torch

from octlm.attention import naive_attention, tiled_attention
from octlm.equality import max_abs_diff
from tests.helpers import make_qkv, reference


def gradients(function, inputs, grad_out, **options):
    """dq, dk, dv of ``function`` at ``inputs`` (the leaves keep their dtype)."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = function(*inputs, **options)
    return torch.autograd.grad(out, inputs, grad_out.to(out.dtype))


def grad_out_for(query):
    generator = torch.Generator().manual_seed(5)
    return torch.randn(query.shape, dtype=torch.float64, generator=generator).to(query.dtype)


# (16, 32): query blocks of fewer than 64 rows, whose forward keeps the shift out of the matmul;
# (512, 256): one block that carries it; (64, 1): one key per block, the shortest tiles.
BLOCKS = [(16, 32), (512, 256), (64, 1)]


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("scale", [None, 40.0], ids=["scale-default", "scale-40"])
def test_rows_that_see_one_key_pass_their_output_gradient_through_exactly(block, kv_heads, scale):
    """With ``window=1`` every row sees only its own key, so each key's ``dv`` is the sum of
    its group's ``dO`` at that row: one addition at most (two heads per group), so exact. A
    scale of 40 puts the shifts past the range where the backward lets them ride in the
    matmul."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=kv_heads, q_len=70, head_size=32)
    grad_out = grad_out_for(query)
    call = dict(causal=True, window=1, scale=scale, block=block)
    _, _, grad_value = gradients(tiled_attention, (query, key, value), grad_out, **call)
    group = 4 // kv_heads
    expected = grad_out.view(2, kv_heads, group, 70, 32).sum(dim=2)  # (B, Hkv, T, D)
    assert torch.equal(grad_value, expected)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_the_issue_case_one_key_seen_by_the_last_row_only(block):
    """239 queries, one key, ``window=1``: the last row alone sees it, with probability 1."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 239, 6, 128, generator=generator).to(torch.bfloat16).transpose(1, 2)
    key, value = (
        torch.randn(2, 1, 2, 128, generator=generator).to(torch.bfloat16).transpose(1, 2)
        for _ in "kv"
    )
    grad_out = torch.randn(2, 6, 239, 128, generator=generator).to(torch.bfloat16)
    call = dict(causal=True, window=1, block=block)
    _, _, grad_value = gradients(tiled_attention, (query, key, value), grad_out, **call)
    exact = grad_out[:, :, -1:].float().unflatten(1, (2, 3)).sum(2).bfloat16()  # (B, Hkv, 1, D)
    assert torch.equal(grad_value, exact)


CASES = {
    "one-key-last-row": dict(heads=6, kv_heads=2, q_len=239, k_len=1, head_size=128, window=1),
    "window-1-gqa": dict(heads=4, kv_heads=2, q_len=70, k_len=70, head_size=32, window=1),
    "window-1-mha": dict(heads=2, kv_heads=2, q_len=8, k_len=8, head_size=16, window=1),
    "decode-one-key": dict(heads=4, kv_heads=2, q_len=1, k_len=1, head_size=32, window=0),
    "causal-mqa": dict(heads=4, kv_heads=1, q_len=70, k_len=70, head_size=32, window=0),
    "window-3-gqa": dict(heads=4, kv_heads=2, q_len=100, k_len=100, head_size=64, window=3),
    "window-40-gqa": dict(heads=8, kv_heads=2, q_len=300, k_len=300, head_size=64, window=40),
    "cache-window-5": dict(heads=4, kv_heads=4, q_len=33, k_len=57, head_size=32, window=5),
}


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_bfloat16_gradients_meet_flash_attns_rule(case, block):
    shape = dict(CASES[case])
    window = shape.pop("window")
    inputs = make_qkv(batch=2, dtype=torch.bfloat16, seed=1, **shape)
    grad_out = grad_out_for(inputs[0])
    call = dict(causal=True, window=window)
    tested = gradients(tiled_attention, inputs, grad_out, block=block, **call)
    low = gradients(naive_attention, inputs, grad_out, **call)
    golden = gradients(reference, inputs, grad_out, **call)  # float64, rounded to bfloat16
    for name, t, b, g in zip("qkv", tested, low, golden, strict=True):
        error, low_error = max_abs_diff(t, g), max_abs_diff(b, g)
        assert error <= 2 * low_error + 1e-5, f"d{name}: {error:.3g} vs naive's {low_error:.3g}"
