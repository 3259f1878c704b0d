"""octlm attention inside transformers models: same logits, gradients and tokens as transformers'
own SDPA attention, with the structure (causal, window, padding) kept for the tiled path.

Small randomly initialised models built from configs (nothing is downloaded): Llama (full
attention), Mistral (sliding window on every layer) and Qwen2 (a full layer, then a sliding one).
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402

from octlm.attention import IMPLEMENTATIONS, attention_mask, tiled_attention  # noqa: E402

# transformers.masking_utils (and so the integration) imports torch._dynamo, which imports
# Triton: done at collection, that would come before tests/attention/test_triton.py can switch
# Triton's CPU interpreter on, so these modules are imported only while the tests run.
NAMES = ("octlm", "octlm_naive", "octlm_sdpa", "octlm_tiled", "octlm_auto")
WINDOW = 16
LENGTH = 64  # tokens per row: four windows, four tiles
VOCAB = 96
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    # Larger than the usual 0.02, so that attention is peaked and a wrong mask shows.
    initializer_range=0.2,
)  # fmt: skip
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=WINDOW),
    "qwen2": lambda: Qwen2Config(
        **SIZES, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
}
# The window octlm must receive in each layer.
LAYER_WINDOWS = {"llama": [0, 0], "mistral": [WINDOW, WINDOW], "qwen2": [0, WINDOW]}


@pytest.fixture(autouse=True, scope="module")
def registered():
    from octlm.integrations.transformers import register

    return register()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: a second thread only spins on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiled with 16 x 16 tiles, so these short rows still span several blocks to skip."""
    tiled = IMPLEMENTATIONS["tiled"]
    small = functools.partial(tiled_attention, block=16)
    monkeypatch.setitem(IMPLEMENTATIONS, "tiled", dataclasses.replace(tiled, function=small))


def build(kind: str, dtype=torch.float64, attn="sdpa"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation=attn)
    return model.to(dtype).eval()


def batch(padding: str, length: int = LENGTH, short: int = 19):
    """Token ids (2, length) and a 2-D mask; row 0 is ``short`` tokens shorter when padded."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)  # no pad, bos or eos
    mask = torch.ones(2, length, dtype=torch.long)
    if padding == "left":
        mask[0, :short] = 0
    elif padding == "right":
        mask[0, length - short :] = 0
    return ids, mask


def logits(model, attn, ids, mask):
    model.set_attn_implementation(attn)
    return model(input_ids=ids, attention_mask=mask).logits


@pytest.fixture
def spy(monkeypatch):
    """Record the keywords the registry's tiled function receives."""
    calls = []
    tiled = IMPLEMENTATIONS["tiled"]

    def recording(query, key, value, **kwargs):
        calls.append({**kwargs, "heads": query.shape[1], "kv_heads": key.shape[1]})
        return tiled.function(query, key, value, **kwargs)

    monkeypatch.setitem(IMPLEMENTATIONS, "tiled", dataclasses.replace(tiled, function=recording))
    return calls


def test_register_adds_every_single_process_implementation_to_both_registries(registered):
    from octlm.integrations.transformers import register

    assert registered == NAMES
    for name in NAMES:
        assert name in transformers.AttentionInterface()
        assert name in transformers.AttentionMaskInterface()
    assert register() == NAMES  # idempotent


def test_transformers_sliding_window_is_octlm_window():
    """transformers' sliding_window=w hides exactly what octlm's window=w hides."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    for window in (1, 3, WINDOW):
        for q_len, past in ((40, 0), (5, 30)):
            theirs = sdpa_mask(
                batch_size=1, q_length=q_len, kv_length=past + q_len, q_offset=past,
                mask_function=sliding_window_causal_mask_function(window),
                allow_is_causal_skip=False,
            )[0, 0]  # fmt: skip
            assert torch.equal(theirs, attention_mask(q_len, past=past, window=window))


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_logits_equal_transformers_sdpa_in_float64(kind, padding):
    model = build(kind)
    ids, mask = batch(padding)
    expected = logits(model, "sdpa", ids, mask)
    for name in NAMES:
        error = (logits(model, name, ids, mask) - expected).abs().max().item()
        assert error <= 1e-10, (name, error)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_tiled_logits_in_float32_within_transformers_own_spread(kind, padding):
    """Within 3x what transformers' eager and sdpa differ by, plus 1e-6."""
    model = build(kind, torch.float32)
    ids, mask = batch(padding)
    expected = logits(model, "sdpa", ids, mask)
    spread = (logits(model, "eager", ids, mask) - expected).abs().max().item()
    error = (logits(model, "octlm_tiled", ids, mask) - expected).abs().max().item()
    assert error <= 3 * spread + 1e-6, (error, spread)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_gradients_of_every_parameter_equal_transformers_sdpa(kind, padding):
    model = build(kind).train()
    ids, mask = batch(padding)
    grads = {}
    for name in ("sdpa", "octlm_tiled"):
        model.zero_grad()
        out = logits(model, name, ids, mask)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (out * weights * mask[..., None]).sum().backward()
        grads[name] = {key: p.grad.clone() for key, p in model.named_parameters()}
    assert grads["sdpa"].keys() == grads["octlm_tiled"].keys()
    for key, expected in grads["sdpa"].items():
        error = (grads["octlm_tiled"][key] - expected).abs().max().item()
        assert error <= 1e-10 * max(1.0, expected.abs().max().item()), (key, error)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_generation_gives_the_same_tokens(kind, cache):
    """Same tokens as sdpa; the left-padded row continues as it does alone."""
    model = build(kind)
    ids, mask = batch("left", length=20, short=7)
    options = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation=cache,
        pad_token_id=0,
    )  # fmt: skip
    tokens = {}
    for name in ("sdpa", "octlm_tiled"):
        model.set_attn_implementation(name)
        tokens[name] = model.generate(input_ids=ids, attention_mask=mask, **options)[:, 20:]
    assert torch.equal(tokens["octlm_tiled"], tokens["sdpa"])
    alone = model.generate(input_ids=ids[:1, 7:], attention_mask=mask[:1, 7:], **options)
    assert torch.equal(alone[0, 13:], tokens["octlm_tiled"][0])


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_causal_and_window_reach_tiled_as_structure(kind, spy):
    """No padding: tiled gets mask=None and each layer its own window; right padding becomes
    key_lengths, left padding a (B, 1, 1, K) mask. Key/value heads are never repeated."""
    model = build(kind)
    model.set_attn_implementation("octlm_tiled")
    for padding in ("none", "right", "left"):
        spy.clear()
        ids, mask = batch(padding)
        model(input_ids=ids, attention_mask=None if padding == "none" else mask)
        assert [call["window"] for call in spy] == LAYER_WINDOWS[kind]
        assert all(call["causal"] for call in spy)
        assert all((call["heads"], call["kv_heads"]) == (4, 2) for call in spy)
        masks = [call["mask"] for call in spy]
        lengths = [call["key_lengths"] for call in spy]
        if padding == "none":
            assert masks == [None, None] and lengths == [None, None]
        elif padding == "right":
            assert masks == [None, None]
            assert all(torch.equal(k, mask.sum(dim=1)) for k in lengths)
        else:
            assert lengths == [None, None]
            assert all(m.shape == (2, 1, 1, LENGTH) and m.dtype == torch.bool for m in masks)


def test_static_cache_prefill_keeps_only_the_filled_slots():
    """A static cache hands over all its slots; the empty tail is dropped, so octlm's
    bottom-right causal rule lines up with transformers' positions."""
    from octlm.integrations.transformers import structured_mask

    rules = structured_mask(batch_size=2, q_length=7, kv_length=64, q_offset=torch.tensor(0))
    assert (rules.causal, rules.window, rules.keys) == (True, 0, 7)
    assert rules.mask is None and rules.key_lengths is None
    rules = structured_mask(batch_size=2, q_length=1, kv_length=64, q_offset=torch.tensor(20))
    assert rules.keys == 21


def test_only_patterns_recognised_exactly_become_structure():
    """A sliding window is recognised with its own size; another pattern with the same
    local size (chunked attention) or a window of another size stays transformers' mask."""
    from transformers.masking_utils import (
        chunked_causal_mask_function,
        sdpa_mask,
        sliding_window_causal_mask_function,
    )

    from octlm.integrations.transformers import structured_mask

    sizes = dict(batch_size=2, q_length=12, kv_length=12, local_size=4)
    rules = structured_mask(**sizes, mask_function=sliding_window_causal_mask_function(4))
    assert (rules.causal, rules.window, rules.mask) == (True, 4, None)
    for other in (
        chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)),
        sliding_window_causal_mask_function(5),
    ):
        rules = structured_mask(**sizes, mask_function=other)
        expected = sdpa_mask(**sizes, mask_function=other, allow_is_causal_skip=False)
        assert not rules.causal and torch.equal(rules.mask, expected)


def test_packed_sequences_take_the_exact_route(spy):
    """Position ids that restart mark packed documents: no structure fits, the dense mask is
    used, and documents do not see each other."""
    model = build("mistral")
    ids, _ = batch("none")
    positions = torch.cat([torch.arange(24), torch.arange(LENGTH - 24)]).expand(2, -1)
    # transformers looks for packing only without a cache
    expected = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    model.set_attn_implementation("octlm_tiled")
    got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert (got - expected).abs().max().item() <= 1e-10
    assert all(call["mask"].shape == (2, 1, LENGTH, LENGTH) for call in spy)
    second = model(input_ids=ids[:, 24:], position_ids=positions[:, 24:]).logits
    assert (got[:, 24:] - second).abs().max().item() <= 1e-10


def test_dropout_in_training_goes_to_an_implementation_that_has_it():
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="octlm_tiled").train()
    ids, mask = batch("none", length=8)
    with pytest.raises(ValueError, match=r"octlm_tiled has no attention dropout.*octlm_sdpa"):
        model(input_ids=ids, attention_mask=mask)
    model.set_attn_implementation("octlm_sdpa")
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    model.eval().set_attn_implementation("octlm_tiled")  # no dropout outside training
    model(input_ids=ids, attention_mask=mask)


def test_output_attentions_is_refused():
    model = build("llama", attn="octlm_tiled")
    ids, mask = batch("none", length=8)
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_a_raw_padding_mask_is_refused():
    """A 2-D mask reaching the attention function means masks were not built for octlm."""
    attention = transformers.AttentionInterface()["octlm_tiled"]
    module = build("llama").model.layers[0].self_attn
    query, key = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    with pytest.raises(TypeError, match=r"register\(\)"):
        attention(module, query, key, key, torch.ones(2, 8, dtype=torch.bool))


# Models beyond plain attention: Gemma 2's logit soft-capping, gpt-oss's sinks, DeepSeek-V3's
# latent attention (values shorter than keys), and Doge, which reads the mask itself.
FAMILIES = {
    "gemma2": dict(attn_logit_softcapping=5.0, final_logit_softcapping=None, head_dim=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        moe_intermediate_size=32,
    ),
    "doge": dict(),
}


def build_family(kind: str) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(kind, **{**SIZES, **FAMILIES[kind]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    for module in model.modules():  # gpt-oss starts its sinks at zero: give them weight
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, std=2.0)
    # gpt-oss's experts take no float64; eager's softmax is float32 in any case.
    return model.to(torch.float32 if kind == "gpt_oss" else torch.float64).eval()


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "deepseek_v3"])
def test_soft_capping_sinks_and_latent_attention_reach_octlm(kind, spy):
    """Each family's own maths in octlm: tiled equals naive (float64, or float32 where the
    model takes no float64), and both equal transformers' eager attention, whose softmax runs
    in float32 (so float32's tolerance)."""
    model = build_family(kind)
    ids, mask = batch("none", length=24)
    eager = logits(model, "eager", ids, mask)
    naive = logits(model, "octlm_naive", ids, mask)
    tiled = logits(model, "octlm_tiled", ids, mask)
    close = 1e-10 if naive.dtype == torch.float64 else 1e-4
    assert (tiled - naive).abs().max() < close
    assert (naive - eager).abs().max() < 1e-4
    if kind == "gemma2":
        assert {call["softcap"] for call in spy} == {5.0}
    if kind == "gpt_oss":
        assert all(call["sinks"] is not None for call in spy)


def test_a_model_that_reads_the_mask_itself_is_told_what_to_use():
    model = build_family("doge")
    ids, mask = batch("none", length=8)
    with pytest.raises(AttributeError, match=r"reads the attention mask itself.*'sdpa' or 'eager'"):
        logits(model, "octlm_tiled", ids, mask)


def test_octlm_imports_without_transformers():
    """transformers is an optional extra: octlm works without it, and the integration says
    what to install."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import octlm, octlm.attention, octlm.integrations\n"
        "try:\n"
        "    import octlm.integrations.transformers\n"
        "except ImportError as error:\n"
        "    assert 'octlm[transformers]' in str(error), error\n"
        "else:\n"
        "    raise SystemExit('imported without transformers')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
