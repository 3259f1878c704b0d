"""``attention="auto"``: the route it takes for every case of its rule, and its exactness.

For each structure and score keyword, :func:`octlm.attention.route` names the implementation and a
reason that names the case; ``auto_attention`` returns exactly what that implementation returns, and
its output and gradients meet docs/design.md, 'When are two results equal' against the independent
float64 reference. The model with ``attention="auto"`` meets the same rule against the float64 naive
model, with and without a KV cache, with packed documents and with a window.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from octlm import KVCache, ModelConfig, OctLM
from octlm.attention import (
    IMPLEMENTATIONS,
    auto_attention,
    block_mask,
    naive_attention,
    route,
    sdpa_attention,
)
from octlm.attention.block_masks import prefix_lm_mod
from octlm.equality import GRADIENT_FACTOR, OUTPUT_FACTOR, judge
from octlm.training.config import resolve
from tests.helpers import assert_judged, make_qkv, reference

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS, KV_HEADS, LENGTH = 4, 2, 40
BLOCK = (16, 8)  # several tiles at these lengths, when the call goes to tiled


def _documents(batch: int = 2, length: int = LENGTH) -> torch.Tensor:
    """Ids ``(batch, length)``: row 0 three documents, row 1 two, crossing tile edges."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    ids[0, 11:], ids[0, 29:] = 1, 2
    ids[1, 23:] = 1
    return ids


def _prefix_lm() -> dict:
    mask = block_mask(prefix_lm_mod(torch.tensor([10, 25])), 2, HEADS, LENGTH, LENGTH, block=8)
    return {"block_mask": mask}


# case: (query rows, keys, keywords, the implementation, a word the reason must hold)
CASES = {
    "plain causal": (LENGTH, LENGTH, {}, "sdpa", "plain causal"),
    "non-causal": (LENGTH, LENGTH, {"causal": False}, "sdpa", "non-causal"),
    "one decoding row": (1, LENGTH, {}, "sdpa", "one query row"),
    "chunk after a cache": (7, LENGTH, {}, "tiled", "q_len=7 != k_len=40"),
    "window": (LENGTH, LENGTH, {"window": 9}, "tiled", "window=9"),
    "window as wide as the keys": (LENGTH, LENGTH, {"window": LENGTH}, "sdpa", "plain causal"),
    "decoding row in a window": (1, LENGTH, {"window": 9}, "tiled", "window=9"),
    "documents": (LENGTH, LENGTH, {"document_ids": _documents()}, "tiled", "document_ids"),
    "right padding": (
        LENGTH, LENGTH, {"key_lengths": torch.tensor([LENGTH, 17])}, "tiled", "key_lengths",
    ),
    "left padding": (
        LENGTH, LENGTH, {"key_starts": torch.tensor([0, 13])}, "tiled", "key_starts",
    ),
    "softcap": (LENGTH, LENGTH, {"softcap": 2.0}, "tiled", "softcap"),
    "alibi": (
        LENGTH, LENGTH, {"alibi_slopes": 2.0 ** -torch.arange(1.0, HEADS + 1)}, "tiled",
        "alibi_slopes",
    ),
    "sinks": (LENGTH, LENGTH, {"sinks": torch.tensor([-1.0, 0.0, 1.0, 3.0])}, "tiled", "sinks"),
    "block mask": (LENGTH, LENGTH, {"causal": False, **_prefix_lm()}, "tiled", "block_mask"),
    "mask, non-causal": (
        LENGTH, LENGTH, {"causal": False, "mask": torch.rand(LENGTH, LENGTH) > 0.3}, "sdpa",
        "explicit mask",
    ),
    "mask beside causal": (
        LENGTH, LENGTH, {"mask": torch.rand(LENGTH, LENGTH) > 0.3}, "tiled", "explicit mask",
    ),
    "float mask on one decoding row": (
        1, LENGTH, {"mask": torch.randn(1, LENGTH)}, "sdpa", "explicit mask",
    ),
}  # fmt: skip
LEARNED = ("alibi_slopes", "sinks")


def _inputs(q_len: int, k_len: int, dtype=torch.float32):
    return make_qkv(heads=HEADS, kv_heads=KV_HEADS, q_len=q_len, k_len=k_len, dtype=dtype)


def _reference_keywords(keywords: dict) -> dict:
    """The keywords in the reference's terms: a block mask as its dense mask."""
    given = dict(keywords)
    if "block_mask" in given:
        given["mask"] = given.pop("block_mask").dense()
    return given


@pytest.mark.parametrize("case", CASES)
def test_route_names_the_implementation_and_the_case(case):
    q_len, k_len, keywords, expected, word = CASES[case]
    name, reason = route(*_inputs(q_len, k_len), **keywords)
    assert name == expected
    assert reason.startswith(f"{expected}: ") and word in reason, reason


@pytest.mark.parametrize("case", CASES)
def test_auto_returns_what_the_routed_implementation_returns(case):
    q_len, k_len, keywords, expected, _ = CASES[case]
    query, key, value = _inputs(q_len, k_len)
    impl = IMPLEMENTATIONS[expected]
    tuning = {"block": BLOCK} if "block" in impl.tuning else {}
    chosen = impl.function(query, key, value, **keywords, **tuning)
    assert torch.equal(auto_attention(query, key, value, **keywords, block=BLOCK), chosen)


def _gradients(function, tensors: dict, grad_out: torch.Tensor, keywords: dict) -> dict:
    """The output and the gradients of query, key, value and the learned keywords."""
    leaves = {name: x.detach().clone().requires_grad_() for name, x in tensors.items()}
    given = {**keywords, **{name: leaves[name] for name in LEARNED if name in leaves}}
    out = function(leaves["query"], leaves["key"], leaves["value"], **given)
    out.backward(grad_out.to(out.dtype))
    return {"output": out.detach()} | {name: leaf.grad for name, leaf in leaves.items()}


@pytest.mark.parametrize("case", CASES)
def test_auto_output_and_gradients_meet_the_equality_rule(case):
    q_len, k_len, keywords, _, _ = CASES[case]
    query, key, value = _inputs(q_len, k_len)
    tensors = {"query": query, "key": key, "value": value}
    tensors |= {name: keywords[name] for name in LEARNED if name in keywords}
    plain = {name: x for name, x in keywords.items() if name not in LEARNED}
    grad_out = torch.randn(query.shape, dtype=torch.float64)
    doubled = {name: x.double() for name, x in tensors.items()}
    dense = _reference_keywords(plain)
    if "mask" in dense and dense["mask"].is_floating_point():
        dense["mask"] = dense["mask"].double()
    golden = _gradients(reference, doubled, grad_out, dense)
    base = _gradients(naive_attention, tensors, grad_out, plain)
    tested = _gradients(
        lambda *args, **kw: auto_attention(*args, **kw, block=BLOCK), tensors, grad_out, plain
    )
    for part, result in tested.items():
        factor = OUTPUT_FACTOR if part == "output" else GRADIENT_FACTOR
        assert_judged(result, base[part], golden[part], factor=factor)


def test_dropout_goes_to_sdpa_and_drops_as_sdpa_does():
    query, key, value = _inputs(LENGTH, LENGTH)
    for keywords in ({}, {"window": 9}, {"document_ids": _documents()}):
        name, reason = route(query, key, value, dropout_p=0.25, **keywords)
        assert name == "sdpa" and "dropout_p=0.25" in reason
        torch.manual_seed(3)
        expected = sdpa_attention(query, key, value, dropout_p=0.25, **keywords)
        torch.manual_seed(3)
        assert torch.equal(auto_attention(query, key, value, dropout_p=0.25, **keywords), expected)


def test_route_reads_no_tensor_values():
    """Tensors on the meta device hold no values: the rule must decide from shapes alone."""
    meta = [x.to("meta") for x in _inputs(LENGTH, LENGTH)]
    lengths = torch.tensor([LENGTH, 3], device="meta")
    documents = _documents().to("meta")
    name, reason = route(*meta, key_lengths=lengths, document_ids=documents, window=5)
    assert name == "tiled" and "document_ids" in reason and "key_lengths" in reason


def test_a_window_as_wide_as_the_keys_gives_sdpa_no_mask(monkeypatch):
    seen = []
    fused = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append((kwargs["attn_mask"], kwargs["is_causal"]))
        return fused(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    query, key, value = _inputs(LENGTH, LENGTH)
    sdpa_attention(query, key, value, window=LENGTH)
    sdpa_attention(query[:, :, -1:], key, value, window=LENGTH + 3)
    assert seen == [(None, True), (None, False)]


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"block": 0}, r"block must be an int >= 1 .* got 0"),
        ({"kernel": "cuda"}, r"kernel must be one of \('auto', 'pytorch', 'triton'\), got 'cuda'"),
        ({"window": -1}, r"window must be an int >= 0 .* got -1"),
    ],
)
def test_bad_keywords_are_refused_whichever_way_the_call_goes(keywords, message):
    query, key, value = _inputs(LENGTH, LENGTH)
    with pytest.raises(ValueError, match=message):
        auto_attention(query, key, value, **keywords)  # plain causal: the sdpa route
    with pytest.raises(ValueError, match=message):
        auto_attention(query, key, value, softcap=2.0, **keywords)  # the tiled route


def test_route_refuses_a_keyword_it_does_not_know():
    query, key, value = _inputs(LENGTH, LENGTH)
    with pytest.raises(TypeError, match=r"route\(\) got unexpected keyword argument\(s\) windw"):
        route(query, key, value, windw=3)


# --- the model ----------------------------------------------------------------------------------

SMALL = ModelConfig(vocab_size=256, width=64, n_layers=2, n_heads=8, n_kv_heads=2, max_length=64)


def test_model_and_octlm_train_default_to_auto():
    assert ModelConfig().attention == "auto"
    model_config, _ = resolve()
    assert model_config.attention == "auto"


def _models(config: ModelConfig) -> tuple[OctLM, OctLM, OctLM]:
    """auto in float32, naive in float32 (the base) and in float64, with the same weights."""
    torch.manual_seed(0)
    auto = OctLM(replace(config, attention="auto")).eval()
    naive = OctLM(replace(config, attention="naive")).eval()
    naive.load_state_dict(auto.state_dict())
    return auto, naive, copy.deepcopy(naive).double()


def _tokens(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_model_logits_and_gradients_meet_the_equality_rule(window, packed):
    models = _models(replace(SMALL, window=window, block=BLOCK))
    tokens = _tokens(2, LENGTH + 1)
    documents = _documents() if packed else None
    found = []
    for model in models:
        logits = model(tokens[:, :-1], documents)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        names, parameters = zip(*model.named_parameters(), strict=True)
        grads = dict(zip(names, torch.autograd.grad(loss, parameters), strict=True))
        found.append((logits.detach(), grads))
    (auto, auto_grads), (base, base_grads), (golden, golden_grads) = found
    verdict = judge(auto, base, golden, factor=OUTPUT_FACTOR)
    assert verdict.passed, f"logits: {verdict}"
    for name, grad in auto_grads.items():
        verdict = judge(grad, base_grads[name], golden_grads[name], factor=GRADIENT_FACTOR)
        assert verdict.passed, f"gradient of {name}: {verdict}"


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("chunks", [(12,) + (1,) * 8, (5, 1, 7, 3)], ids=["rows", "chunks"])
def test_cached_decoding_meets_the_equality_rule(window, chunks):
    """A prefill then single rows (sdpa) or chunks after a cache (tiled), against one float64
    forward of the naive model."""
    auto, naive, golden_model = _models(replace(SMALL, window=window, block=BLOCK))
    tokens = _tokens(2, sum(chunks))
    with torch.no_grad():
        cache = KVCache(auto.config)
        cached = torch.cat([auto(part, cache=cache) for part in tokens.split(chunks, 1)], 1)
        verdict = judge(cached, naive(tokens), golden_model(tokens), factor=OUTPUT_FACTOR)
    assert verdict.passed, str(verdict)


def test_route_checks_no_tensor_values_when_called_itself():
    """``route`` itself, with its validation, on meta tensors: shapes and keywords only."""
    meta = [x.to("meta") for x in _inputs(LENGTH, LENGTH)]
    bounds = torch.tensor([LENGTH, 5], device="meta")
    for name in ("key_lengths", "key_starts"):
        chosen, reason = route(*meta, **{name: bounds})
        assert chosen == "tiled" and name in reason
    with pytest.raises(ValueError, match="key_lengths must have shape"):
        route(*meta, key_lengths=torch.tensor([1], device="meta"))


NAN_CALLS = {
    "causal": {},
    "bool mask": {"causal": False, "mask": torch.arange(LENGTH) < LENGTH - 1},
}


@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("case", NAN_CALLS)
def test_auto_on_sdpa_makes_nan_rows_only_where_docs_say(where, case):
    """docs/attention.md: where route names sdpa, a NaN in the last key or value, which only
    some rows see, makes those rows NaN; other rows are NaN or naive's numbers, never others.
    Where route names tiled, the rows that cannot see it stay exact."""
    query, key, value = _inputs(LENGTH, LENGTH)
    {"key": key, "value": value}[where][:, :, -1] = float("nan")
    options = NAN_CALLS[case]
    golden = reference(query, key, value, **options)
    seeing = golden.isnan().any(dim=-1)  # (B, H, Q), the rows that see the NaN
    assert route(query, key, value, **options)[0] == "sdpa"
    out = auto_attention(query, key, value, **options)
    assert out.isnan().any(dim=-1)[seeing].all()
    kept = ~out.isnan().any(dim=-1)  # rows auto left finite: they must be exact
    plain = naive_attention(query, key, value, **options)
    assert_judged(out[kept], plain[kept], golden[kept])
    windowed = dict(options, window=LENGTH - 1)  # narrower than the keys: route names tiled
    assert route(query, key, value, **windowed)[0] == "tiled"
    out = auto_attention(query, key, value, block=BLOCK, **windowed)
    golden = reference(query, key, value, **windowed)
    assert torch.equal(out.isnan().any(dim=-1), golden.isnan().any(dim=-1))
    finite = ~golden.isnan().any(dim=-1)
    plain = naive_attention(query, key, value, **windowed)
    assert_judged(out[finite], plain[finite], golden[finite])


def test_ring_module_exports_what_docs_import():
    from octlm.attention.ring import ring_attention, shard_sequence  # as docs/attention.md

    assert callable(ring_attention) and callable(shard_sequence)
