"""Bad input fails early with an error that names the argument, in every implementation; only
query, key and value go by position, and a positional option names the keyword it was meant for."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from octlm.attention import (
    IMPLEMENTATIONS,
    attention_mask,
    block_mask,
    naive_attention,
    sdpa_attention,
    tiled_attention,
)
from octlm.attention.inputs import Call
from tests.helpers import make_qkv

ALL = [naive_attention, sdpa_attention, tiled_attention]


def qkv(**kw):
    return make_qkv(batch=2, heads=4, kv_heads=2, q_len=8, head_size=16, **kw)


CASES = [
    ("3-D query", lambda q, k, v: (q[0], k, v), {}, ValueError, "query must be 4-D"),
    ("batch", lambda q, k, v: (q, k[:1], v[:1]), {}, ValueError, "key has batch 1"),
    ("head_size", lambda q, k, v: (q, k[..., :8], v[..., :8]), {}, ValueError, "head_size"),
    ("value shape", lambda q, k, v: (q, k, v[:, :, :4]), {}, ValueError, "value must have"),
    ("heads", lambda q, k, v: (q[:, :3], k, v), {}, ValueError, r"multiple of key/value heads"),
    ("dtype", lambda q, k, v: (q, k.double(), v), {}, TypeError, "key has dtype"),
    ("int", lambda q, k, v: (q.long(), k, v), {}, TypeError, "floating-point"),
    ("not a tensor", lambda q, k, v: (q.tolist(), k, v), {}, TypeError, "query must be"),
    ("window", lambda *t: t, {"window": -1}, ValueError, "window must be"),
    ("window type", lambda *t: t, {"window": 2.5}, ValueError, "window must be"),
    ("scale", lambda *t: t, {"scale": 0.0}, ValueError, "scale must be"),
    ("scale bool", lambda *t: t, {"scale": True}, ValueError, "scale must be"),
    ("causal", lambda *t: t, {"causal": "yes"}, TypeError, "causal must be a bool"),
    (
        "mask shape",
        lambda *t: t,
        {"mask": torch.ones(3, 8, 8, dtype=torch.bool)},
        ValueError,
        "does not broadcast",
    ),
    (
        "mask rank",
        lambda *t: t,
        {"mask": torch.ones(1, 1, 1, 8, 8, dtype=torch.bool)},
        ValueError,
        "at most 4 dims",
    ),
    (
        "mask dtype",
        lambda *t: t,
        {"mask": torch.ones(8, 8, dtype=torch.long)},
        TypeError,
        "mask must be bool",
    ),
    (
        "key_lengths shape",
        lambda *t: t,
        {"key_lengths": torch.tensor([8])},
        ValueError,
        "key_lengths must have shape",
    ),
    (
        "key_lengths range",
        lambda *t: t,
        {"key_lengths": torch.tensor([8, 9])},
        ValueError,
        r"key_lengths must lie in \[0, k_len=8\]",
    ),
    (
        "key_lengths complex",
        lambda *t: t,
        {"key_lengths": torch.tensor([8, 2]) + 0j},
        TypeError,
        "integer tensor",
    ),
    (
        "key_lengths dtype",
        lambda *t: t,
        {"key_lengths": torch.tensor([8.0, 2.0])},
        TypeError,
        "integer tensor",
    ),
    ("dropout", lambda *t: t, {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
    (
        "key_starts range",
        lambda *t: t,
        {"key_starts": torch.tensor([-1, 2])},
        ValueError,
        r"key_starts must lie in \[0, k_len=8\]",
    ),
    ("key_starts dtype", lambda *t: t, {"key_starts": torch.zeros(2)}, TypeError, "key_starts"),
    (
        "document_ids shape",
        lambda *t: t,
        {"document_ids": torch.zeros(2, 7, dtype=torch.long)},
        ValueError,
        r"document_ids must have shape \(batch, k_len\) = \(2, 8\), got \(2, 7\)",
    ),
    (
        "document_ids dtype",
        lambda *t: t,
        {"document_ids": torch.zeros(2, 8, dtype=torch.bool)},
        TypeError,
        "document_ids must be an integer tensor, got torch.bool",
    ),
    (
        "document_ids q_len > k_len",
        lambda q, k, v: (q, k[:, :, :6], v[:, :, :6]),
        {"document_ids": torch.zeros(2, 6, dtype=torch.long), "causal": False},
        ValueError,
        "document_ids needs q_len <= k_len",
    ),
    ("softcap", lambda *t: t, {"softcap": 0.0}, ValueError, "softcap must be a positive"),
    ("softcap inf", lambda *t: t, {"softcap": float("inf")}, ValueError, "softcap must be"),
    (
        "alibi shape",
        lambda *t: t,
        {"alibi_slopes": torch.ones(2)},
        ValueError,
        r"alibi_slopes must have shape \(heads,\) or \(batch, heads\) = \(4,\) or \(2, 4\)",
    ),
    (
        "alibi dtype",
        lambda *t: t,
        {"alibi_slopes": torch.ones(4, dtype=torch.long)},
        TypeError,
        "alibi_slopes must be a floating-point tensor",
    ),
    ("sinks shape", lambda *t: t, {"sinks": torch.ones(2, 4)}, ValueError, r"sinks must have"),
    ("sinks type", lambda *t: t, {"sinks": [0.0] * 4}, TypeError, "sinks must be a torch.Tensor"),
    ("block_mask type", lambda *t: t, {"block_mask": torch.ones(8, 8)}, TypeError, "BlockMask"),
    (
        "block_mask shape",
        lambda *t: t,
        {"block_mask": block_mask(lambda b, h, q, k: k <= q, 2, 4, 8, 9)},
        ValueError,
        r"block_mask was built for \(batch, heads, q_len, k_len\) = \(2, 4, 8, 9\)",
    ),
]


@pytest.mark.parametrize("attention", ALL, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name, change, options, error, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(attention, name, change, options, error, match):
    with pytest.raises(error, match=match):
        attention(*change(*qkv()), **options)


@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
@pytest.mark.parametrize("block", [0, -3, (16,), (16, 0), 2.5, True, "64"])
def test_bad_block_is_rejected_on_every_path(block, kernel):
    with pytest.raises(ValueError, match="block must be"):
        tiled_attention(*qkv(), block=block, kernel=kernel)


def test_tiled_refuses_dropout_rather_than_ignoring_it():
    with pytest.raises(ValueError, match="implementation without dropout"):
        tiled_attention(*qkv(), dropout_p=0.1)


@pytest.mark.parametrize("attention", [naive_attention, sdpa_attention])
def test_dropout_is_applied_only_when_asked(attention):
    query, key, value = qkv()
    plain = attention(query, key, value)
    torch.testing.assert_close(attention(query, key, value, dropout_p=0.0), plain)
    assert not torch.allclose(attention(query, key, value, dropout_p=0.5), plain)


def test_attention_mask_is_bottom_right_causal_with_window():
    mask = attention_mask(3, past=2, window=2)
    expected = torch.tensor(
        [[False, True, True, False, False],
         [False, False, True, True, False],
         [False, False, False, True, True]]
    )  # fmt: skip
    assert mask.dtype == torch.bool and torch.equal(mask, expected)
    assert torch.equal(attention_mask(4), torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="past must be"):
        attention_mask(3, past=-1)


def test_kernel_choice_is_validated_and_routed(monkeypatch):
    """Routing only: a stand-in module takes the Triton call, so Triton itself is not imported
    here (its CPU interpreter must be switched on before the first import, in test_triton)."""
    import types

    import octlm.attention.tiled.attention as tiled

    with pytest.raises(ValueError, match="kernel must be one of"):
        tiled_attention(*qkv(), kernel="cuda")
    query, key, value = qkv()
    assert not tiled._triton_fits(Call(query, key, value))  # CPU tensors stay on PyTorch's path
    calls = []
    stand_in = types.SimpleNamespace(triton_call=lambda call, **kw: calls.append(call))
    monkeypatch.setitem(sys.modules, "octlm.attention.tiled.triton_flash", stand_in)
    monkeypatch.setattr(tiled, "_triton_fits", lambda *a: True)
    tiled_attention(query, key, value, window=3)
    assert calls and calls[0].window == 3
    tiled_attention(query, key, value, kernel="pytorch")
    assert len(calls) == 1


@pytest.mark.parametrize("attention", ALL, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "batch, q_len, k_len", [(0, 8, 8), (2, 8, 0), (2, 0, 8), (2, 0, 0)], ids=str
)
def test_empty_inputs_give_empty_or_zero_outputs(attention, batch, q_len, k_len):
    """No rows: an empty output. No keys: every row sees nothing, so zeros (and zero grads)."""
    query = torch.randn(batch, 4, q_len, 16, requires_grad=True)
    key, value = (torch.randn(batch, 2, k_len, 16, requires_grad=True) for _ in range(2))
    out = attention(query, key, value, causal=k_len >= q_len)
    assert out.shape == query.shape and not out.any()
    out.sum().backward()
    assert all(not x.grad.any() for x in (query, key, value))


# The public keywords and their defaults, as users and scripts call them.
PUBLIC_DEFAULTS = {
    "causal": True, "window": 0, "mask": None, "scale": None, "dropout_p": 0.0,
    "key_lengths": None, "key_starts": None, "document_ids": None, "softcap": None,
    "alibi_slopes": None, "sinks": None, "block_mask": None,
}  # fmt: skip


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_signature_shows_the_shared_keywords_then_the_implementations_own(name):
    impl = IMPLEMENTATIONS[name]
    parameters = inspect.signature(impl.function).parameters
    common = ("causal", "window", "mask", "scale", "dropout_p", "key_lengths")
    shared = [keyword for keyword in PUBLIC_DEFAULTS if keyword in common + impl.features]
    assert list(parameters)[: 3 + len(shared)] == ["query", "key", "value", *shared]
    for keyword in shared:
        assert parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY, keyword
        assert parameters[keyword].default == PUBLIC_DEFAULTS[keyword], keyword
    assert set(impl.tuning) <= set(list(parameters)[3 + len(shared) :])


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_unknown_keywords_are_named(name):
    query, key, value = qkv()
    function = IMPLEMENTATIONS[name].function
    with pytest.raises(TypeError, match=f"{function.__name__}.*causl, blok"):
        function(query, key, value, causl=True, blok=4)
    with pytest.raises(TypeError, match="missing a required argument: 'value'"):
        function(query, key)


@pytest.mark.parametrize(
    "function, option, meant",
    [(tiled_attention, 64, "block=64"), (naive_attention, False, "causal=False")],
)
def test_a_positional_option_names_its_keyword_and_the_keyword_call(function, option, meant):
    query, key, value = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with pytest.raises(TypeError) as raised:
        function(query, key, value, option)
    message = str(raised.value)
    name = function.__name__
    assert f"{meant.split('=')[0]} and every other argument are keyword-only" in message
    assert f"{name}(query, key, value, {meant})" in message
    assert "4 positional arguments" in message
