"""Small calls are computed whole (tiled/whole.py): the path is taken where the call fits in one
tile and not beyond, and it is exact by the rule of docs/design.md, 'When are two results equal'
(outputs factor 2, gradients factor 3, against the float64 reference of tests/helpers.py) for every
structure and score modifier, for rows that see nothing or one key, a NaN in a hidden key and huge
finite mask values."""

from __future__ import annotations

import pytest
import torch

from octlm.attention import naive_attention, tiled_attention
from octlm.attention.block_masks import block_mask
from octlm.attention.tiled import engine, whole
from tests.helpers import assert_judged, make_qkv, reference

FINFO_MIN = torch.finfo(torch.float32).min
# The parameters drawn at collection come from their own generator: the same in every process.
DRAWS = torch.Generator().manual_seed(1)


@pytest.fixture
def whole_calls(monkeypatch):
    """How many forwards and backwards took the whole-tile path."""
    counts = {"forward": 0, "backward": 0}

    def counted(name, function):
        def run(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(engine, "whole_forward", counted("forward", engine.whole_forward))
    monkeypatch.setattr(engine, "whole_backward", counted("backward", engine.whole_backward))
    return counts


def documents(batch: int, length: int) -> torch.Tensor:
    """Packed rows of a few documents each, cut at different places per batch element."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        for cut in (length // 5 + 3 * b, length // 2 + b, length - 4 - b):
            ids[b, cut:] += 1
    return ids


def check(query, key, value, *, options, extra=(), block=(512, 256)):
    """Output and the gradients of query, key, value and the ``extra`` options named (float
    mask, slopes, sinks) judged against float64 autograd through the reference, naive setting
    the tolerance."""
    grad_out = torch.randn(query.shape, dtype=torch.float64)
    runs = {}
    for name in ("tested", "base", "golden"):
        dtype = torch.float64 if name == "golden" else query.dtype
        inputs = [x.detach().to(dtype).requires_grad_() for x in (query, key, value)]
        kwargs = dict(options)
        for option in extra:
            kwargs[option] = options[option].detach().to(dtype).requires_grad_()
        if name == "tested":
            out = tiled_attention(*inputs, block=block, **kwargs)
        elif name == "base":
            out = naive_attention(*inputs, **kwargs)
        else:
            out = reference(*inputs, **kwargs)
        out.backward(grad_out.to(out.dtype))
        leaves = inputs + [kwargs[option] for option in extra]
        runs[name] = (out, [leaf.grad for leaf in leaves])
    (tested, tested_grads), (base, base_grads), (golden, golden_grads) = runs.values()
    assert_judged(tested, base, golden)
    for mine, theirs, gold in zip(tested_grads, base_grads, golden_grads, strict=True):
        assert_judged(mine, theirs, gold, factor=3.0)
    return tested


STRUCTURES = {
    "causal": lambda batch, length: {},
    "non-causal": lambda batch, length: {"causal": False},
    "window": lambda batch, length: {"window": 9},
    "documents": lambda batch, length: {"document_ids": documents(batch, length)},
    "padding": lambda batch, length: {
        "key_lengths": torch.tensor([length, length - 7]),
        "key_starts": torch.tensor([0, 5]),
    },
    "bool-mask": lambda batch, length: {
        "mask": torch.rand(batch, 1, length, length, generator=torch.Generator().manual_seed(3))
        > 0.3
    },
}


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_each_structure_takes_the_whole_path_and_is_exact(structure, kv_heads, whole_calls):
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=kv_heads, q_len=70)
    check(query, key, value, options=STRUCTURES[structure](2, 70))
    assert whole_calls == {"forward": 1, "backward": 1}


def test_bfloat16_inputs_are_exact(whole_calls):
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=70, dtype=torch.bfloat16)
    check(query, key, value, options={"document_ids": documents(2, 70)})
    assert whole_calls == {"forward": 1, "backward": 1}


def test_the_backward_follows_the_forwards_path_not_the_shapes(whole_calls, monkeypatch):
    """A call that fits one tile but whose forward walked the blocks is walked back too: the
    backward reads the forward's record, so it forms again only tiles the forward formed."""
    monkeypatch.setattr(engine, "fits_whole", lambda *args: False)
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=70)
    check(query, key, value, options={"document_ids": documents(2, 70)})
    assert whole_calls == {"forward": 0, "backward": 0}


def test_queries_after_cached_keys_are_exact(whole_calls):
    """Fewer queries than keys: row ``i`` sits at key ``k_len - q_len + i``."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=20, k_len=70)
    check(query, key, value, options={"window": 30, "document_ids": documents(2, 70)})
    assert whole_calls == {"forward": 1, "backward": 1}


@pytest.mark.parametrize(
    "options, extra",
    [
        ({"softcap": 5.0}, ()),
        ({"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}, ("alibi_slopes",)),
        ({"alibi_slopes": torch.rand(2, 4, generator=DRAWS) / 4}, ("alibi_slopes",)),
        ({"sinks": torch.tensor([0.5, -2.0, 3.0, 0.0])}, ("sinks",)),
        ({"sinks": torch.tensor([100.0, -100.0, 0.0, 1.0])}, ("sinks",)),
        ({"mask": torch.randn(2, 1, 70, 70, generator=DRAWS)}, ("mask",)),
        ({"mask": torch.randn(2, 1, 1, 70, generator=DRAWS)}, ("mask",)),
    ],
    ids=[
        "softcap",
        "alibi",
        "alibi-per-batch",
        "sinks",
        "large-sinks",
        "float-mask",
        "float-mask-per-key",
    ],
)
def test_score_modifiers_and_their_gradients_are_exact(options, extra, whole_calls):
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=70)
    options = {**options, "window": 40, "document_ids": documents(2, 70)}
    check(query, key, value, options=options, extra=extra)
    assert whole_calls == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("seed", [23, 27, 46, 0, 1, 2])
def test_a_float_masks_gradient_is_exact_whatever_the_draw(seed, whole_calls):
    """Each row's delta is summed from its own tile, as naive's softmax backward sums it; from
    rowsum(grad_out * out) instead, the output's rounding reaches every score's gradient, and
    draws 23, 27 and 46 of this mask miss the rule on the mask's or the query's gradient."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=70)
    torch.manual_seed(seed)
    options = {"mask": torch.randn(2, 1, 70, 70), "window": 40, "document_ids": documents(2, 70)}
    check(query, key, value, options=options, extra=("mask",))
    assert whole_calls == {"forward": 1, "backward": 1}


def test_a_row_that_sees_nothing_gives_zeros_and_no_gradient(whole_calls):
    """Row 5 of the first element sees no key: its output, lse and gradient are 0, 0, -inf
    (with a sink, the sink's logit), and the other rows stay exact."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=40)
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool)
    mask[0, :, 5] = False
    out = check(query, key, value, options={"mask": mask})
    assert torch.equal(out[0, :, 5], torch.zeros_like(out[0, :, 5]))
    leaves = [x.detach().clone().requires_grad_() for x in (query, key, value)]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = tiled_attention(*leaves, mask=mask, sinks=sinks, return_lse=True)
    out.sum().backward()
    assert not out[0, :, 5].any()
    assert not leaves[0].grad[0, :, 5].any()
    assert torch.equal(lse[0, :, 5], sinks)
    _, lse = tiled_attention(query, key, value, mask=mask, return_lse=True)
    assert (lse[0, :, 5] == float("-inf")).all() and lse.isfinite().sum() == lse.numel() - 4
    assert whole_calls["forward"] == 3


def test_more_rows_than_keys_leave_the_first_rows_seeing_nothing(whole_calls):
    """Causal with 50 query rows after 20 keys: rows 0-29 see no key, give zeros, an lse of
    -inf and no gradient; the rest stay exact."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=50, k_len=20)
    out = check(query, key, value, options={})
    assert not out[:, :, :30].any()
    _, lse = tiled_attention(query, key, value, return_lse=True)
    assert (lse[:, :, :30] == float("-inf")).all() and lse[:, :, 30:].isfinite().all()
    leaves = [x.detach().clone().requires_grad_() for x in (query, key, value)]
    tiled_attention(*leaves).sum().backward()
    assert not leaves[0].grad[:, :, :30].any()
    assert whole_calls["forward"] == 3 and whole_calls["backward"] == 2


def test_rows_that_see_one_key_pass_their_output_gradient_through_exactly(whole_calls):
    """``window=1``: each row's probability of its own key is exactly 1, recomputed so in the
    backward, so each key's ``dv`` is its group's ``dO`` at that row, summed."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=70, requires_grad=True)
    grad_out = torch.randn(query.shape)
    tiled_attention(query, key, value, window=1, scale=40.0).backward(grad_out)
    assert torch.equal(value.grad, grad_out.view(2, 2, 2, 70, 32).sum(dim=2))
    assert whole_calls == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("broken", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_key_or_value_reaches_only_the_rows_that_see_it(broken, whole_calls):
    """Key 60 and value 61 are broken in both elements: past the first element's length no row
    sees them; in the second, rows 62 on see both and are not finite, rows before 60 see
    neither and stay exact."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=70)
    key[:, :, 60] = broken
    value[:, :, 61] = broken
    lengths = torch.tensor([50, 70])
    leaves = [x.detach().clone().requires_grad_() for x in (query, key, value)]
    out = tiled_attention(*leaves, key_lengths=lengths)
    out[0].sum().backward()
    golden = reference(query, key, value, key_lengths=lengths)
    base = naive_attention(query, key, value, key_lengths=lengths)
    assert_judged(out[0].detach(), base[0], golden[0])
    assert_judged(out[1, :, :60].detach(), base[1, :, :60], golden[1, :, :60])
    assert not out[1, :, 62:].isfinite().any()
    assert all(leaf.grad[0].isfinite().all() for leaf in leaves)
    assert whole_calls == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("value", [-1e30, FINFO_MIN, 1e30])
def test_huge_finite_mask_values_are_exact(value, whole_calls):
    """A float mask adds a huge finite value to some keys of every row: the shift and the sums
    follow it without losing the scores around it."""
    query, key, value_ = make_qkv(batch=1, heads=2, kv_heads=2, q_len=64)
    mask = torch.zeros(64)
    mask[:20] = value
    mask[40:45] = value
    check(query, key, value_, options={"mask": mask, "causal": False})
    assert whole_calls == {"forward": 1, "backward": 1}


def test_calls_beyond_one_tile_and_block_masks_take_the_block_walk(whole_calls):
    query, key, value = make_qkv(batch=1, heads=2, kv_heads=2, q_len=70)
    tiled_attention(query, key, value, block=(32, 32))
    blocks = block_mask(lambda b, h, q, k: k <= q, 1, 2, 70, 70, block=(32, 32))
    tiled_attention(query, key, value, block_mask=blocks)
    assert whole_calls["forward"] == 0


@pytest.mark.parametrize(
    "options, extra",
    [
        ({"document_ids": documents(3, 70), "mask": torch.rand(3, 6, 70, 70) > 0.2}, ()),
        ({"alibi_slopes": torch.rand(3, 6) / 4, "window": 20}, ("alibi_slopes",)),
        ({"sinks": torch.randn(6), "mask": torch.randn(3, 6, 70, 70)}, ("sinks", "mask")),
    ],
    ids=["documents-and-mask-per-head", "alibi-per-batch", "sinks-and-float-mask-per-head"],
)
def test_heads_cut_into_pieces_take_their_own_part_of_every_rule(
    options, extra, monkeypatch, whole_calls
):
    """One key/value head per piece (three heads a group): each piece's mask, slopes and
    sinks are its own heads'."""
    monkeypatch.setattr(whole, "PIECE_SCORES", 1)
    query, key, value = make_qkv(batch=3, heads=6, kv_heads=2, q_len=70)
    check(query, key, value, options=options, extra=extra)
    assert whole_calls == {"forward": 1, "backward": 1}


def test_strided_inputs_are_read_in_place_and_exact(whole_calls):
    """Heads split out of ``(B, T, H, D)`` projections, and keys and values that are the first
    70 positions of a longer cache buffer: any strides give the reference's answer."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=20, k_len=90)
    query = query.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, Q, D) of (B, Q, H, D)
    key, value = key[:, :, :70], value[:, :, :70]
    assert not (query.is_contiguous() or key.is_contiguous() or value.is_contiguous())
    check(query, key, value, options={"window": 30, "document_ids": documents(2, 70)})
    assert whole_calls == {"forward": 1, "backward": 1}


def test_an_output_gradient_in_the_models_layout_gives_the_same_gradients(whole_calls):
    """A model hands back the output's gradient as a ``(B, Q, H, D)`` tensor seen as ``(B, H,
    Q, D)``: its strides change no bit of the gradients."""
    query, key, value = make_qkv(batch=2, heads=4, kv_heads=2, q_len=40, requires_grad=True)
    options = {"document_ids": documents(2, 40)}
    grad_out = torch.randn(2, 40, 4, 32).transpose(1, 2)  # (B, H, Q, D) of (B, Q, H, D)
    assert not grad_out.is_contiguous()
    grads = []
    for grad in (grad_out, grad_out.contiguous()):
        out = tiled_attention(query, key, value, **options)
        grads.append(torch.autograd.grad(out, (query, key, value), grad))
    for strided, dense in zip(*grads, strict=True):
        assert torch.equal(strided, dense)
    assert whole_calls == {"forward": 2, "backward": 2}
