"""The Triton FlashAttention kernels against the float64 reference (docs/design.md, 'When are two
results equal').

Without a GPU the kernels run on CPU tensors under Triton's interpreter, which has to be on
when Triton is first imported and again when a kernel first runs, so this module switches it on
for its import and its own tests only (processes that other tests spawn must not inherit it).
The interpreter is slow: shapes are tiny, and its blocks are 16 x 16 so that they still make
several blocks, partial blocks and skipped blocks. On a GPU the same tests run compiled, and
the CUDA-only ones add bfloat16 and larger shapes. The interpreter computes bfloat16 wrongly,
so bfloat16 is tested on CUDA only.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from octlm.attention import naive_attention, tiled_attention
from octlm.attention.inputs import Call
from octlm.attention.masks import dense_mask
from octlm.equality import judge
from tests.helpers import assert_judged, make_qkv, reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
_PREVIOUS = os.environ.get("TRITON_INTERPRET")


def _interpret(on: bool) -> None:
    """Switch Triton's CPU interpreter on, or back to how the environment had it."""
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    elif _PREVIOUS is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS


if not CUDA and sys.modules.get("triton") is not None and _PREVIOUS != "1":
    pytest.skip(
        "Triton was imported for a GPU before this module could switch its CPU interpreter on; "
        "run `pytest tests/attention/test_triton.py` on its own, or set TRITON_INTERPRET=1",
        allow_module_level=True,
    )
_interpret(not CUDA)
try:
    pytest.importorskip("triton", reason="Triton is not installed (pip install octlm[triton])")
    from octlm.attention.tiled import triton_flash, triton_kernels
finally:
    _interpret(False)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_while_testing():
    """Triton reads the switch again at the first launch, so it is on for this module's tests
    (and only for them: processes that other tests spawn must not inherit it)."""
    _interpret(not CUDA)
    yield
    _interpret(False)


triton_attention = triton_flash.triton_attention
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# id: (batch, heads, kv_heads, q_len, k_len, head_size, causal, window). Against 16 x 16 blocks,
# past = 33 and window - past = 18, 50 put a causal or window edge on a block's first or last row,
# where an off-by-one in the block skipping would drop a block that is needed.
CASES = {
    "causal": (1, 2, 2, 17, 17, 16, True, 0),
    "causal-gqa-q<k": (1, 2, 1, 17, 50, 40, True, 0),
    "causal-q>k-empty-rows": (1, 2, 2, 50, 17, 16, True, 0),
    "causal-mqa": (1, 4, 1, 70, 70, 64, True, 0),
    "decode-one-query": (1, 4, 2, 1, 50, 64, True, 0),
    "window-gqa": (1, 2, 1, 70, 70, 16, True, 18),
    "noncausal-gqa-batch": (2, 4, 2, 33, 33, 40, False, 0),
    "noncausal-q<k": (1, 2, 2, 33, 70, 64, False, 0),
    "noncausal-mqa-q>k": (1, 2, 1, 50, 17, 40, False, 0),
    "noncausal-window-q>k": (1, 2, 2, 70, 33, 40, False, 13),
}


def run(function, inputs, grad_out, **options):
    """Output and ``[dq, dk, dv]`` of ``function`` on fresh leaves of ``inputs``; with
    ``return_lse``, the output is ``(out, lse)`` and the gradients are of ``out``."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    result = function(*leaves, **options)
    out = result[0] if isinstance(result, tuple) else result
    out.backward(grad_out.to(out.dtype))
    if isinstance(result, tuple):
        return tuple(x.detach() for x in result), [x.grad for x in leaves]
    return out.detach(), [x.grad for x in leaves]


def reference_lse(query, key, causal, window):
    """fp64 log-sum-exp of the visible scaled scores, -inf for rows that see no key."""
    query, key = query.double(), key.double()
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # (B, H, K, D)
    scores = query @ key.transpose(-2, -1) * query.shape[-1] ** -0.5  # (B, H, Q, K)
    visible = dense_mask(Call(query, key, key, causal=causal, window=window))  # (Q, K) or None
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.logsumexp(dim=-1)  # (B, H, Q)


def check_against_reference(batch, heads, kv_heads, q_len, k_len, head_size, causal, window,
                            dtype):  # fmt: skip
    """Output, lse and gradients of the kernels against naive fp64, relative to naive in dtype;
    output and lse of one call, as ``return_lse`` only chooses what is returned."""
    inputs = make_qkv(batch, heads, kv_heads, q_len, k_len, head_size, dtype=torch.float64)
    inputs = [x.to(DEVICE, dtype) for x in inputs]
    grad_out = torch.randn(batch, heads, q_len, head_size, dtype=torch.float64).to(DEVICE)
    options = dict(causal=causal, window=window)
    (out, lse), grads = run(triton_attention, inputs, grad_out, **options, return_lse=True)
    base, base_grads = run(naive_attention, inputs, grad_out, **options)
    golden, golden_grads = run(naive_attention, [x.double() for x in inputs], grad_out, **options)

    assert out.dtype == dtype and out.shape == inputs[0].shape
    assert_judged(out, base, golden)
    for name, tested, plain, exact in zip("qkv", grads, base_grads, golden_grads, strict=True):
        assert tested.dtype == dtype and torch.isfinite(tested).all(), f"d{name}"
        assert_judged(tested, plain, exact, factor=3.0)

    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, q_len)
    expected = reference_lse(inputs[0], inputs[1], causal, window).float()
    torch.testing.assert_close(lse, expected, atol=1e-4, rtol=1e-5)  # -inf must match -inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_and_backward_match_reference(case, dtype):
    check_against_reference(*case, dtype=dtype)


@pytest.mark.parametrize("head_size", [8, 24, 100])
def test_head_sizes_padded_to_a_power_of_two(head_size):
    check_against_reference(1, 2, 1, 20, 20, head_size, True, 0, dtype=torch.float32)


def test_non_causal_backward_reaches_keys_after_the_query():
    """A widely copied tutorial kernel sums dK/dV over the causal triangle even when asked for
    full attention; here the last key gets gradient from every row, not from the last only."""
    inputs = make_qkv(1, 2, 2, 40, 40, 16)
    inputs = [x.to(DEVICE) for x in inputs]
    grad_out = torch.ones(inputs[0].shape, device=DEVICE)
    _, full = run(triton_attention, inputs, grad_out, causal=False)
    _, golden = run(naive_attention, [x.double() for x in inputs], grad_out, causal=False)
    _, causal = run(triton_attention, inputs, grad_out, causal=True)
    torch.testing.assert_close(full[1].double(), golden[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full[2].double(), golden[2], atol=1e-5, rtol=1e-5)
    assert (full[2][:, :, -1] - causal[2][:, :, -1]).abs().max() > 1e-2


@pytest.mark.parametrize("q_len, k_len", [(20, 5), (6, 0)])
def test_rows_that_see_no_key_give_zeros_and_zero_gradients(q_len, k_len):
    """Causal with q_len > k_len: the first q_len - k_len rows come before every key."""
    query, key, value = (x.to(DEVICE) for x in make_qkv(1, 2, 1, q_len, k_len, 16))
    leaves = [x.requires_grad_() for x in (query, key, value)]
    out, lse = triton_attention(*leaves, return_lse=True)
    out.backward(torch.randn_like(out))
    empty = q_len - k_len
    assert torch.isfinite(out).all() and not query.grad.isnan().any()
    assert (out[:, :, :empty] == 0).all() and (query.grad[:, :, :empty] == 0).all()
    assert (lse[:, :, :empty] == float("-inf")).all() and torch.isfinite(lse[:, :, empty:]).all()


def test_strided_inputs_give_the_same_result():
    """Layouts the model produces, (B, L, H, D) transposed, and a head dim that is not
    contiguous (copied), give bit-for-bit what contiguous inputs give."""
    inputs = [x.to(DEVICE) for x in make_qkv(2, 2, 1, 30, 30, 16)]
    grad_out = torch.randn(inputs[0].shape, device=DEVICE)
    out, grads = run(triton_attention, inputs, grad_out)
    rows_major = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in inputs]
    dims_strided = [x.transpose(2, 3).contiguous().transpose(2, 3) for x in inputs]
    for layout in (rows_major, dims_strided):
        strided_grad = grad_out.transpose(1, 2).contiguous().transpose(1, 2)
        strided_out, strided_grads = run(triton_attention, layout, strided_grad)
        assert torch.equal(strided_out, out)
        assert all(torch.equal(a, b) for a, b in zip(strided_grads, grads, strict=True))


def kv_packed(batch, heads, kv_heads, q_len, k_len, head_size):
    """Float32 query, key and value laid out as flash-attn's kvpacked tests lay them out: ``q (B,
    Q, H, D)`` and one ``kv (B, K, 2, Hkv, D)`` buffer, seen heads first (key and value are
    strided views of that one buffer)."""
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(batch, q_len, heads, head_size, generator=generator, dtype=torch.float64)
    kv = torch.randn(batch, k_len, 2, kv_heads, head_size, generator=generator, dtype=torch.float64)
    query, kv = query.float().to(DEVICE), kv.float().to(DEVICE)
    return [x.transpose(1, 2) for x in (query, kv[:, :, 0], kv[:, :, 1])]


def test_flash_attns_case_causal_window_mqa_kvpacked_meets_the_rule():
    """flash-attn's own test case ``80x40-d96-causal-window-mqa-kvpacked`` (at a smaller batch
    and head count): 80 queries after 40 keys, so the first 40 rows see nothing and row 40 sees
    key 0 alone; output and every gradient within docs/design.md, 'When are two results equal' of
    float64."""
    inputs = kv_packed(2, 4, 1, 80, 40, 96)
    generator = torch.Generator().manual_seed(4)
    grad_out = torch.randn(inputs[0].shape, generator=generator, dtype=torch.float64).to(DEVICE)
    options = dict(causal=True, window=13)
    out, grads = run(triton_attention, inputs, grad_out, **options)
    base, base_grads = run(naive_attention, inputs, grad_out, **options)
    golden, golden_grads = run(reference, [x.double() for x in inputs], grad_out, **options)
    assert_judged(out, base, golden)
    for name, tested, plain, exact in zip("qkv", grads, base_grads, golden_grads, strict=True):
        verdict = judge(tested, plain, exact, factor=3.0)
        assert verdict.passed, f"d{name}: {verdict}"


# id: (batch, heads, kv_heads, q_len, k_len, head_size, scale). With window 1 each row sees one
# key (or none), so its probability is exactly 1 in the forward; a backward that recomputes it
# exactly hands each key, as dv, exactly the sum of the dO of the rows that see it.
ONE_KEY_CASES = {
    "gqa": (2, 4, 2, 37, 37, 32, None),
    "mqa-q<k-scale-40": (1, 4, 1, 20, 45, 16, 40.0),
    "80x40-d96-mqa-kvpacked": (2, 4, 1, 80, 40, 96, None),
    "one-key-seen-by-the-last-row": (2, 6, 2, 50, 1, 64, None),
}


@pytest.mark.parametrize("case", ONE_KEY_CASES.values(), ids=ONE_KEY_CASES.keys())
def test_rows_that_see_one_key_pass_their_output_gradient_through_exactly(case):
    batch, heads, kv_heads, q_len, k_len, head_size, scale = case
    inputs = kv_packed(batch, heads, kv_heads, q_len, k_len, head_size)
    generator = torch.Generator().manual_seed(5)
    grad_out = torch.randn(inputs[0].shape, generator=generator).to(DEVICE)  # (B, H, Q, D)
    options = dict(causal=True, window=1, scale=scale)
    out, (_, _, grad_value) = run(triton_attention, inputs, grad_out, **options)
    base = naive_attention(*inputs, **options)
    assert_judged(out, base, reference(*[x.double() for x in inputs], **options))

    # Row i sees key past + i alone (if it exists); each kv head sums its group's query heads
    # in order, as the kernel does.
    group, past = heads // kv_heads, k_len - q_len
    rows = torch.arange(max(0, -past), q_len, device=DEVICE)  # rows that see a key
    grouped = grad_out.view(batch, kv_heads, group, q_len, head_size)
    expected = torch.zeros_like(inputs[2])  # (B, Hkv, K, D)
    for member in range(group):
        expected[:, :, past + rows] += grouped[:, :, member, rows]
    assert torch.equal(grad_value, expected)


def test_the_returned_lse_is_the_callers_to_change():
    """The backward keeps its own row statistics: an in-place change to the returned lse
    leaves the gradients as they were. Asking for the lse changes nothing else: the output is
    the one returned without it."""
    inputs = [x.to(DEVICE) for x in make_qkv(1, 2, 1, 20, 20, 16)]
    grad_out = torch.randn(inputs[0].shape, device=DEVICE)
    plain, expected = run(triton_attention, inputs, grad_out)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, lse = triton_attention(*leaves, return_lse=True)
    assert torch.equal(out.detach(), plain)
    lse.zero_()
    out.backward(grad_out)
    assert all(torch.equal(x.grad, g) for x, g in zip(leaves, expected, strict=True))


def test_explicit_scale():
    query, key, value = (x.to(DEVICE) for x in make_qkv(1, 2, 2, 20, 20, 16))
    out = triton_attention(query, key, value, scale=0.3)
    golden = naive_attention(query.double(), key.double(), value.double(), scale=0.3)
    assert_judged(out, naive_attention(query, key, value, scale=0.3), golden)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(mask=torch.ones(4, 4, dtype=torch.bool)), ValueError, "mask"),
        (dict(key_lengths=torch.tensor([5])), ValueError, "key_lengths must lie in"),
        (dict(document_ids=torch.zeros(1, 3, dtype=torch.long)), ValueError, "document_ids"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape"),
        (dict(sinks=torch.ones(1, 2)), ValueError, "sinks must have shape"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(dropout_p=0.1), ValueError, "dropout_p"),
        (dict(window=-1), ValueError, "window"),
        (dict(dtype=torch.float64), TypeError, "float64"),
        (dict(head_size=264), ValueError, "head_size <= 256"),
        (dict(kv_heads=3), ValueError, "multiple of key/value heads"),
    ],
)
def test_rejects_what_it_does_not_support(change, error, words):
    shape = {"dtype": torch.float32, "head_size": 16, "kv_heads": 2}
    options = {name: _on_device(value) for name, value in change.items() if name not in shape}
    shape.update({name: value for name, value in change.items() if name in shape})
    query, key, value = make_qkv(1, 2, q_len=4, **shape)
    with pytest.raises(error, match=words):
        triton_attention(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), **options)


@pytest.mark.skipif(CUDA, reason="the interpreter's bfloat16 limitation; CUDA runs bfloat16")
def test_interpreter_refuses_bfloat16():
    query, key, value = make_qkv(1, 2, 2, 4, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        triton_attention(query, key, value)


def test_is_available():
    assert triton_flash.is_available(DEVICE) is True
    assert triton_flash.is_available(torch.device(DEVICE)) is True


def _on_device(value):
    return value.to(DEVICE) if isinstance(value, torch.Tensor) else value


# Packed documents, padding and score modifiers (docs/design.md, 'Tensor conventions') against the
# float64 reference. Documents: ids per batch row, from run lengths; 16-key blocks see documents of
# length 1, documents crossing block edges and, in "unsorted", ids that come back later.
def documents(*rows):
    """``(batch, k_len)`` ids from each row's document lengths (or its ids, if a tensor)."""
    return torch.stack([
        row if isinstance(row, torch.Tensor) else torch.arange(len(row)).repeat_interleave(
            torch.tensor(row)
        )
        for row in rows
    ])  # fmt: skip


SLOPES = torch.tensor([0.5, 0.125])  # ALiBi slopes of two heads
STRUCTURE_CASES = {
    # id: ((batch, heads, kv_heads, q_len, k_len, head_size), options)
    "documents": (
        (2, 2, 1, 50, 50, 16),
        dict(document_ids=documents([7, 1, 20, 12, 10], [17, 33])),
    ),
    "documents-q<k-noncausal": (
        (2, 2, 2, 23, 50, 16),
        dict(causal=False, document_ids=documents([1, 15, 1, 16, 17], [30, 1, 19])),
    ),
    "documents-window": ((1, 2, 1, 50, 50, 16), dict(window=9, document_ids=documents([25, 25]))),
    "documents-unsorted": (
        (2, 2, 1, 40, 40, 16),
        dict(document_ids=torch.randint(0, 3, (2, 40), generator=torch.Generator().manual_seed(1))),
    ),
    "left-and-right-padding": (
        (2, 2, 1, 50, 50, 16),
        dict(key_starts=torch.tensor([5, 20]), key_lengths=torch.tensor([50, 33])),
    ),
    "left-padding-q>k-noncausal": (
        (2, 2, 2, 40, 17, 16),
        dict(causal=False, key_starts=torch.tensor([0, 17])),
    ),
    "softcap": ((1, 2, 1, 40, 40, 16), dict(softcap=1.0)),
    "alibi-q<k": ((1, 2, 2, 23, 50, 16), dict(alibi_slopes=SLOPES)),
    "alibi-per-row-noncausal": (
        (2, 2, 1, 30, 30, 16),
        dict(causal=False, alibi_slopes=torch.stack([SLOPES, 2 * SLOPES])),
    ),
    "sinks": ((1, 2, 1, 40, 40, 16), dict(sinks=torch.tensor([-1.0, 2.0]))),
    "sinks-empty-rows": ((1, 2, 2, 40, 17, 16), dict(sinks=torch.tensor([0.5, 3.0]))),
    "everything": (
        (2, 4, 2, 33, 50, 24),
        dict(
            window=20,
            document_ids=documents([9, 1, 25, 15], [16, 16, 18]),
            key_starts=torch.tensor([3, 0]),
            key_lengths=torch.tensor([50, 41]),
            softcap=2.0,
            alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
            sinks=torch.tensor([0.0, 1.0, -1.0, 2.0]),
        ),
    ),
}
LEARNED = ("alibi_slopes", "sinks")  # the options that receive gradients


def check_structure(shape, options, dtype):
    """Output, lse and every gradient (slopes and sinks included) of the kernels against the
    float64 reference, relative to naive in ``dtype``."""
    batch, heads, kv_heads, q_len, k_len, head_size = shape
    inputs = make_qkv(batch, heads, kv_heads, q_len, k_len, head_size, dtype=torch.float64)
    inputs = [x.to(DEVICE, dtype) for x in inputs]
    learned = [name for name in LEARNED if name in options]
    inputs += [options[name].to(DEVICE) for name in learned]
    fixed = {name: _on_device(value) for name, value in options.items() if name not in LEARNED}
    generator = torch.Generator().manual_seed(2)
    grad_out = torch.randn(inputs[0].shape, generator=generator, dtype=torch.float64).to(DEVICE)

    def attend(function, tensors, **extra):
        """Output, lse (if asked) and the gradients of fresh leaves of ``tensors``."""
        leaves = [x.detach().clone().requires_grad_() for x in tensors]
        query, key, value, *modifiers = leaves
        result = function(query, key, value, **fixed, **dict(zip(learned, modifiers, strict=True)),
                          **extra)  # fmt: skip
        out, lse = result if isinstance(result, tuple) else (result, None)
        out.backward(grad_out.to(out.dtype))
        return out.detach(), lse, [x.grad for x in leaves]

    out, lse, grads = attend(triton_attention, inputs, return_lse=True)
    base, _, base_grads = attend(naive_attention, inputs)
    golden, golden_lse, golden_grads = attend(
        reference, [x.double() for x in inputs], return_lse=True
    )

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_judged(out, base, golden)
    torch.testing.assert_close(lse.double(), golden_lse, atol=1e-4, rtol=1e-5)  # -inf == -inf
    names = ["dq", "dk", "dv", *learned]
    for name, tested, plain, exact in zip(names, grads, base_grads, golden_grads, strict=True):
        assert torch.isfinite(tested).all(), name
        if name == "alibi_slopes" and dtype == torch.float32:
            # A sum of dS * distance over every visible pair: the recomputed probabilities'
            # rounding (docs/design.md, 'The numerics of the tiled core'), times distances of tens,
            # can outgrow 3x naive's (tiled's does too); held to fp32 rounding of the sum's size
            # instead.
            torch.testing.assert_close(tested.double(), exact, rtol=1e-5, atol=5e-5)
        else:
            assert_judged(tested, plain, exact, factor=3.0)


@pytest.mark.parametrize("case", STRUCTURE_CASES.values(), ids=STRUCTURE_CASES.keys())
def test_structure_and_modifiers_match_reference(case):
    check_structure(*case, dtype=torch.float32)


def test_structure_and_modifiers_in_float16():
    check_structure(*STRUCTURE_CASES["everything"], dtype=torch.float16)


def test_document_spans_name_each_document_by_its_first_and_last_position():
    """Any ids, sorted or not: a key's document as its first position and one past its last."""
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 1, 3, 3, 2, 1]])
    first = [[0, 0, 2, 2, 2, 5], [0, 1, 0, 0, 4, 1]]
    end = [[2, 2, 5, 5, 5, 6], [4, 6, 4, 4, 5, 6]]
    assert triton_flash._document_spans(ids).tolist() == [
        [f, e] for f, e in zip(first, end, strict=True)
    ]


# Blocks of DOCUMENT keys: 16 under the interpreter, a multiple of every compiled tile on CUDA.
DOCUMENT = 128 if CUDA else 16


def test_blocks_of_other_documents_are_never_read():
    """Three documents of one block each, non-causal: a NaN in the middle document's values
    (forward, dQ) or in its rows' output gradient (dK/dV) would reach a row or key of the
    documents before and after it through a zero weight if that block pair were visited; it
    reaches only the middle one."""
    query, key, value = (x.to(DEVICE) for x in make_qkv(1, 2, 1, 3 * DOCUMENT, 3 * DOCUMENT, 16))
    ids = documents([DOCUMENT] * 3).to(DEVICE)
    middle = slice(DOCUMENT, 2 * DOCUMENT)
    value[:, :, middle] = float("nan")
    leaves = [x.requires_grad_() for x in (query, key, value)]
    out = triton_attention(*leaves, causal=False, document_ids=ids)
    grad_out = torch.randn_like(out)
    grad_out[:, :, middle] = float("nan")
    out.backward(grad_out)
    for tensor in (out, query.grad, key.grad, value.grad):
        assert tensor[:, :, middle].isnan().all()
        assert tensor[:, :, :DOCUMENT].isfinite().all()
        assert tensor[:, :, 2 * DOCUMENT :].isfinite().all()


def test_padding_is_never_read():
    """Left and right padding: NaN keys and values there change nothing, and get zero grads."""
    query, key, value = (x.to(DEVICE) for x in make_qkv(2, 2, 1, 20, 40, 16))
    starts, lengths = torch.tensor([5, 0], device=DEVICE), torch.tensor([40, 27], device=DEVICE)
    clean = triton_attention(query, key, value, key_starts=starts, key_lengths=lengths)
    for tensor in (key, value):
        tensor[0, :, :5] = tensor[1, :, 27:] = float("nan")
    leaves = [x.requires_grad_() for x in (query, key, value)]
    out = triton_attention(*leaves, key_starts=starts, key_lengths=lengths)
    out.backward(torch.randn_like(out))
    assert torch.equal(out, clean)
    for grad in (key.grad, value.grad):
        assert grad.isfinite().all() and not grad[0, :, :5].any() and not grad[1, :, 27:].any()


def test_tiled_routes_all_but_block_masks_to_the_kernel(monkeypatch):
    """``tiled_attention(kernel="triton")`` takes documents, padding and the modifiers, and
    ``kernel="auto"`` hands them over where Triton fits; a block mask stays PyTorch-only."""
    import octlm.attention.tiled.attention as tiled_module
    from octlm.attention.block_masks import block_mask, causal_mod

    query, key, value = (x.to(DEVICE) for x in make_qkv(1, 2, 1, 20, 20, 16))
    options = dict(
        document_ids=documents([7, 13]).to(DEVICE), key_starts=torch.tensor([2], device=DEVICE),
        softcap=3.0, alibi_slopes=SLOPES.to(DEVICE), sinks=torch.tensor([0.5, 1.0], device=DEVICE),
    )  # fmt: skip
    direct = triton_attention(query, key, value, **options)
    assert torch.equal(tiled_attention(query, key, value, kernel="triton", **options), direct)
    monkeypatch.setattr(tiled_module, "_triton_fits", lambda *a: True)
    assert torch.equal(tiled_attention(query, key, value, **options), direct)
    blocks = block_mask(causal_mod(20, 20), 1, 2, 20, 20, block=16, device=DEVICE)
    with pytest.raises(ValueError, match="kernel='triton' does not take block_mask"):
        tiled_attention(query, key, value, block_mask=blocks, kernel="triton")


# CUDA: compiled kernels at the block sizes they are meant for.

CUDA_CASES = {
    "causal": (2, 8, 2, 1024, 1024, 64, True, 0),
    "causal-q<k": (2, 8, 8, 512, 1024, 128, True, 0),
    "noncausal-odd-length": (1, 8, 2, 1000, 1000, 128, False, 0),
    "window-d256": (1, 4, 1, 777, 777, 256, True, 256),
    "decode-d40": (2, 8, 2, 1, 1030, 40, True, 0),
    "empty-rows-d96": (1, 4, 4, 300, 200, 96, True, 0),
    "noncausal-window-q>k-d80": (1, 6, 3, 700, 333, 80, False, 100),
}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CUDA_CASES.values(), ids=CUDA_CASES.keys())
def test_cuda_matches_reference(case, dtype):
    check_against_reference(*case, dtype=dtype)


@needs_cuda
@pytest.mark.parametrize("case", ["causal", "noncausal-odd-length", "window-d256"])
def test_cuda_float32_uses_full_precision_products(case):
    check_against_reference(*CUDA_CASES[case], dtype=torch.float32)


CUDA_STRUCTURE_CASES = {
    "documents": (
        (2, 8, 2, 1000, 1000, 64),
        dict(document_ids=documents([300, 1, 129, 570], [1000])),
    ),
    "everything-q<k": (
        (2, 8, 2, 700, 1030, 128),
        dict(
            window=400,
            document_ids=documents([5, 600, 425], [1030]),
            key_starts=torch.tensor([0, 77]),
            key_lengths=torch.tensor([1030, 1000]),
            softcap=20.0,
            alibi_slopes=2.0 ** -torch.arange(1.0, 9.0),
            sinks=torch.linspace(-2.0, 2.0, 8),
        ),
    ),
}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CUDA_STRUCTURE_CASES.values(), ids=CUDA_STRUCTURE_CASES.keys())
def test_cuda_structure_matches_reference(case, dtype):
    check_structure(*case, dtype=dtype)


@needs_cuda
def test_cuda_backward_is_deterministic():
    inputs = [x.to(DEVICE, torch.bfloat16) for x in make_qkv(2, 8, 2, 1000, 1000, 128)]
    grad_out = torch.randn(inputs[0].shape, device=DEVICE, dtype=torch.bfloat16)
    first = run(triton_attention, inputs, grad_out)[1]
    for _ in range(3):
        again = run(triton_attention, inputs, grad_out)[1]
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def _ranges_kernel():
    """A kernel returning both block-range helpers per case: (key lo, key hi, row lo, row hi).
    Built inside a test, so it is made while the interpreter is on."""
    tl = triton_kernels.tl

    @triton_kernels.triton.jit
    def kernel(starts, pasts, lengths, windows, out, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
        case = tl.program_id(0)
        start, past = tl.load(starts + case), tl.load(pasts + case)
        k_len, window = tl.load(lengths + case), tl.load(windows + case)
        q_len = k_len - past
        key_lo, key_hi = triton_kernels._key_range(start, past, 0, k_len, window, BLOCK_M,
                                                 BLOCK_N, CAUSAL)  # fmt: skip
        row_lo, row_hi = triton_kernels._query_range(start, past, q_len, window, BLOCK_M,
                                                   BLOCK_N, CAUSAL)  # fmt: skip
        tl.store(out + 4 * case, key_lo)
        tl.store(out + 4 * case + 1, key_hi)
        tl.store(out + 4 * case + 2, row_lo)
        tl.store(out + 4 * case + 3, row_hi)

    return kernel


@pytest.mark.parametrize("causal", [True, False])
def test_kernel_block_ranges_agree_with_the_pytorch_rule(causal):
    """The kernels' block skipping against the one PyTorch source of truth, ``masks``: the keys a
    query block visits are ``key_range`` (its start rounded down to a block), and the rows a key
    block visits include every row that ``allowed`` lets see one of its keys."""
    from octlm.attention.masks import allowed, key_range

    block = 16
    cases = [
        (start, past, q_len + past, window)
        for q_len in (1, 17, 50)
        for past in (0, 16, 33)
        for window in (0, 1, 18, 50)
        for start in range(0, max(q_len, q_len + past), block)
    ]
    starts, pasts, lengths, windows = (
        torch.tensor(c, dtype=torch.int32) for c in zip(*cases, strict=True)
    )
    kernel_windows = torch.where(windows == 0, lengths + 1, windows)  # as _sizes passes "none"
    starts, pasts, lengths, kernel_windows = (
        x.to(DEVICE) for x in (starts, pasts, lengths, kernel_windows)
    )
    out = torch.zeros(len(cases), 4, dtype=torch.int32, device=DEVICE)
    _ranges_kernel()[(len(cases),)](starts, pasts, lengths, kernel_windows, out, BLOCK_M=block,
                                  BLOCK_N=block, CAUSAL=causal)  # fmt: skip
    for (start, past, k_len, window), (key_lo, key_hi, row_lo, row_hi) in zip(
        cases, out.cpu().tolist(), strict=True
    ):
        q_len = k_len - past
        if start < q_len:  # the query block [start, start + block) against key_range
            rows = range(start, min(start + block, q_len))
            keys = key_range(rows, k_len, past, causal, window)
            if len(keys):
                assert key_lo == keys.start // block * block and key_hi == keys.stop
            else:
                assert key_hi <= key_lo or not allowed(rows, range(key_lo, key_hi), past,
                                                       causal, window).any()  # fmt: skip
        if start < k_len:  # the key block [start, start + block): rows that see any of it
            columns = range(start, min(start + block, k_len))
            seen = allowed(range(q_len), columns, past, causal, window).any(dim=1)
            needed = seen.nonzero().flatten().tolist()
            assert all(row_lo <= row < row_hi for row in needed)
