"""Forward outputs of all three implementations against an independent float64 reference.

Each case is judged by docs/design.md, 'When are two results equal': the tested output's error
against the float64 reference must be within twice the error that plain (naive) attention makes in
the same dtype, plus atol.
"""

from __future__ import annotations

import pytest
import torch

from octlm.attention import IMPLEMENTATIONS as REGISTRY
from octlm.attention import naive_attention, tiled_attention
from tests.helpers import assert_judged, make_qkv, reference


def _bound(name):
    """The registered function, with small tiles where it takes them (several blocks here)."""
    impl = REGISTRY[name]
    if "block" not in impl.tuning:
        return impl.function
    return lambda *args, **kw: impl.function(*args, block=(64, 32), **kw)


# Every implementation one process can run; ring has its own distributed tests.
IMPLEMENTATIONS = {name: _bound(name) for name, impl in REGISTRY.items() if not impl.distributed}
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def check(name, query, key, value, **options):
    """Run one implementation and judge it against the reference (fp64 inputs: to 1e-12)."""
    tested = IMPLEMENTATIONS[name](query, key, value, **options)
    assert tested.dtype == query.dtype and tested.shape == query.shape
    assert not tested.isnan().any()
    golden = reference(query, key, value, **options)
    base = naive_attention(query, key, value, **options)
    assert_judged(tested, base, golden)
    if query.dtype == torch.float64:
        assert (tested - golden).abs().max() < 1e-12


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", [1, 7, 97, 128, 1000, 1025])
def test_matches_reference_across_lengths(name, dtype, length):
    heads = 2 if length >= 1000 else 4
    check(name, *make_qkv(batch=1, heads=heads, kv_heads=heads // 2, q_len=length, dtype=dtype))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len, k_len", [(113, 203), (512, 256), (1, 147), (5, 300)])
def test_matches_reference_when_q_len_differs(name, causal, q_len, k_len):
    """Bottom-right alignment: row i sits at key position k_len - q_len + i."""
    check(name, *make_qkv(q_len=q_len, k_len=k_len), causal=causal)


@pytest.mark.parametrize("block", [1, 16, 64, 100, 128, 256, (16, 64), (100, 7), (256, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_tiled_matches_reference_for_any_block(block, dtype):
    length = 40 if block == 1 else 300
    query, key, value = make_qkv(q_len=length, dtype=dtype)
    tested = tiled_attention(query, key, value, block=block)
    assert_judged(tested, naive_attention(query, key, value), reference(query, key, value))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("head_size", [16, 32, 40, 64, 128])
def test_matches_reference_for_head_sizes(name, head_size):
    check(name, *make_qkv(q_len=70, head_size=head_size))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_query_attention(name, kv_heads, dtype):
    check(name, *make_qkv(heads=8, kv_heads=kv_heads, q_len=90, dtype=dtype))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 5, 64])
@pytest.mark.parametrize("q_len, k_len", [(150, 150), (40, 170)])
def test_sliding_window(name, causal, window, q_len, k_len):
    check(name, *make_qkv(q_len=q_len, k_len=k_len), causal=causal, window=window)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padding_as_bool_mask_and_as_key_lengths(name, dtype):
    query, key, value = make_qkv(batch=3, q_len=60, k_len=80, dtype=dtype)
    key_lengths = torch.tensor([80, 37, 5])
    padding = (torch.arange(80) < key_lengths[:, None])[:, None, None, :]  # (B, 1, 1, K)
    check(name, query, key, value, mask=padding)
    check(name, query, key, value, key_lengths=key_lengths)
    by_mask = IMPLEMENTATIONS[name](query, key, value, mask=padding)
    by_lengths = IMPLEMENTATIONS[name](query, key, value, key_lengths=key_lengths)
    torch.testing.assert_close(by_mask, by_lengths, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", [(1, 1, 1, 70), (1, 4, 50, 70), (50, 70)])
def test_float_mask_is_added_to_scores(name, shape):
    query, key, value = make_qkv(q_len=50, k_len=70)
    bias = torch.randn(shape) * 3
    check(name, query, key, value, mask=bias, causal=False)
    check(name, query, key, value, mask=bias, causal=True, window=20)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_float_mask_of_another_dtype_is_accepted(name):
    query, key, value = make_qkv(q_len=20, dtype=torch.bfloat16)
    bias = torch.randn(20, 20, dtype=torch.float64)
    check(name, query, key, value, mask=bias, causal=False)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_rows_that_see_no_key_are_zero(name):
    query, key, value = make_qkv(q_len=30, k_len=20)  # causal: rows 0..9 see no key
    mask = torch.ones(30, 20, dtype=torch.bool)
    mask[15] = False
    out = IMPLEMENTATIONS[name](query, key, value, mask=mask)
    assert not out.isnan().any()
    assert out[:, :, :10].abs().max() == 0 and out[:, :, 15].abs().max() == 0
    seeing = torch.cat([out[:, :, 10:15], out[:, :, 16:]], dim=2)  # rows that see some key
    assert (seeing.abs().amax(dim=-1) > 0).all()
    check(name, query, key, value, mask=mask)
    empty = IMPLEMENTATIONS[name](query, key, value, key_lengths=torch.tensor([0, 20]))
    assert empty[0].abs().max() == 0 and not empty.isnan().any()


def test_tiled_lse_is_fp32_and_minus_inf_for_empty_rows():
    query, key, value = make_qkv(q_len=30, k_len=20, dtype=torch.bfloat16)
    _, lse = tiled_attention(query, key, value, block=8, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 30)
    assert lse[:, :, :10].eq(float("-inf")).all() and lse[:, :, 10:].isfinite().all()
    group = torch.arange(4) // 2
    scores = torch.einsum("bhqd,bhkd->bhqk", query.double(), key.double()[:, group]) / 32**0.5
    position = torch.arange(20).view(-1, 1)  # rows 10.. sit at key positions 0..
    scores = scores[:, :, 10:].masked_fill(torch.arange(20) > position, float("-inf"))
    torch.testing.assert_close(lse[:, :, 10:].double(), scores.logsumexp(-1), atol=1e-2, rtol=0)


def test_scale_is_honoured():
    query, key, value = make_qkv(q_len=40)
    for name in IMPLEMENTATIONS:
        check(name, query, key, value, scale=0.3)


@pytest.mark.parametrize("block", [(8, 16), (256, 64)], ids=["shift-outside", "shift-in-matmul"])
def test_extreme_scores_do_not_overflow_the_running_sum(block):
    """Scores spanning hundreds of units: the running shift must follow the maximum, and a
    float mask of -1e4 must not underflow rows whose every key carries it."""
    query, key, value = make_qkv(q_len=300, head_size=16)
    for dtype in (torch.float32, torch.float64):
        q, k, v = (x.to(dtype) for x in (query * 40, key, value))
        golden, base = reference(q, k, v), naive_attention(q, k, v)
        assert_judged(tiled_attention(q, k, v, block=block), base, golden)
    bias = torch.zeros(300, 300)
    bias[:, :150] = -1e4  # rows before 150 see only heavily penalised keys
    golden = reference(query, key, value, mask=bias)
    tested = tiled_attention(query, key, value, block=block, mask=bias)
    assert_judged(tested, naive_attention(query, key, value, mask=bias), golden)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_rows_that_see_no_key_get_zero_gradient(name):
    query, key, value = make_qkv(q_len=30, k_len=20, requires_grad=True)  # rows 0..9: no key
    IMPLEMENTATIONS[name](query, key, value).sum().backward()
    for grad in (query.grad, key.grad, value.grad):
        assert not grad.isnan().any()
    assert query.grad[:, :, :10].abs().max() == 0 and query.grad[:, :, 10:].abs().max() > 0


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("options", [{}, {"causal": False}, {"window": 600}], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_row_that_sees_every_key_matches_the_reference(kv_heads, options, dtype):
    """Decoding a token against every key takes a single softmax, not the block loop: the
    same numbers, forward and backward, for MHA, GQA and MQA; and a NaN it sees is NaN."""
    query, key, value = make_qkv(heads=4, kv_heads=kv_heads, q_len=1, k_len=513, dtype=dtype)
    grad_out = torch.randn(query.shape, dtype=torch.float64)
    inputs = [x.clone().requires_grad_() for x in (query, key, value)]
    plain = [x.clone().requires_grad_() for x in (query, key, value)]
    golden = [x.double().requires_grad_() for x in (query, key, value)]
    tested, base = tiled_attention(*inputs, **options), naive_attention(*plain, **options)
    gold = reference(*golden, **options)
    assert_judged(tested, base, gold)
    for out in (tested, base, gold):
        out.backward(grad_out.to(out.dtype))
    for mine, theirs, gold in zip(inputs, plain, golden, strict=True):
        assert_judged(mine.grad, theirs.grad, gold.grad, factor=3.0)
    value[0, :, 200, 3] = float("nan")
    broken = tiled_attention(query, key, value, **options)
    assert broken[0, :, :, 3].isnan().all() and not broken[1].isnan().any()
