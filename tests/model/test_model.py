"""The model: every attention implementation gives the same logits, gradients, cached decoding,
generations and training curve as the naive reference (docs/design.md, 'When are two results
equal')."""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from octlm import KVCache, ModelConfig, OctLM
from octlm.attention import IMPLEMENTATIONS as REGISTRY
from octlm.equality import GRADIENT_FACTOR, OUTPUT_FACTOR, judge
from octlm.lab.verify.loss_curve import loss_curve
from octlm.model import document_positions

IMPLEMENTATIONS = ("naive", "sdpa", "tiled")
# Tiny tiles, so that the tiled path really walks several blocks at these short lengths.
SMALL = ModelConfig(vocab_size=256, width=64, n_layers=2, n_heads=8, max_length=64, block=(8, 16))


pytestmark = pytest.mark.usefixtures("one_thread")


def same_weights(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, OctLM]:
    """One model per implementation, all holding the naive model's initial weights."""
    torch.manual_seed(0)
    naive = OctLM(replace(config, attention="naive"))
    models = {"naive": naive}
    for name in IMPLEMENTATIONS[1:]:
        models[name] = OctLM(replace(config, attention=name))
        models[name].load_state_dict(naive.state_dict())
    return {name: model.to(dtype) for name, model in models.items()}


def tokens_for(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL.vocab_size, (batch, length), generator=generator)


def logits_and_grads(model: OctLM, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Logits of ``tokens[:, :-1]`` and the next-token loss's gradient for every parameter."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    names, parameters = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, parameters)
    return logits.detach(), dict(zip(names, grads, strict=True))


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_implementations_match_naive_in_float64(kv_heads, window):
    models = same_weights(replace(SMALL, n_kv_heads=kv_heads, window=window), torch.float64)
    tokens = tokens_for(2, 41)
    logits, grads = logits_and_grads(models["naive"], tokens)
    for name in IMPLEMENTATIONS[1:]:
        other_logits, other_grads = logits_and_grads(models[name], tokens)
        torch.testing.assert_close(other_logits, logits, rtol=0, atol=1e-10, msg=name)
        for parameter, grad in grads.items():
            torch.testing.assert_close(
                other_grads[parameter], grad, rtol=0, atol=1e-10, msg=f"{name} {parameter}"
            )


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_implementations_match_float64_reference_in_float32(kv_heads):
    models = same_weights(replace(SMALL, n_kv_heads=kv_heads))
    tokens = tokens_for(2, 41)
    reference_logits, reference_grads = logits_and_grads(
        copy.deepcopy(models["naive"]).double(), tokens
    )
    base_logits, base_grads = logits_and_grads(models["naive"], tokens)
    for name in IMPLEMENTATIONS[1:]:
        logits, grads = logits_and_grads(models[name], tokens)
        verdict = judge(logits, base_logits, reference_logits, factor=OUTPUT_FACTOR)
        assert verdict.passed, f"{name} logits: {verdict}"
        for parameter, grad in grads.items():
            verdict = judge(
                grad, base_grads[parameter], reference_grads[parameter], factor=GRADIENT_FACTOR
            )
            assert verdict.passed, f"{name} grad of {parameter}: {verdict}"


@pytest.mark.parametrize("chunks", [(1,) * 16, (5, 1, 7, 3)], ids=["one-by-one", "5-1-7-3"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("attention", IMPLEMENTATIONS)
def test_cached_decoding_matches_full_forward(attention, window, chunks):
    config = replace(SMALL, n_kv_heads=2, window=window, attention=attention)
    torch.manual_seed(0)
    model = OctLM(config).double().eval()
    tokens = tokens_for(2, sum(chunks))
    full = model(tokens)
    cache = KVCache(config)
    pieces, buffers = [], None
    for chunk in tokens.split(chunks, dim=1):
        pieces.append(model(chunk, cache=cache))
        # Allocated once, at the first call, and written in place after: with a window the
        # buffers hold only the window (a ring), without one every position up to max_length.
        views = cache.keys + cache.values
        buffers = buffers or [view.data_ptr() for view in views]
        assert [view.data_ptr() for view in views] == buffers
        slots = window or config.max_length
        assert {view.untyped_storage().nbytes() for view in views} == {
            2 * config.n_kv_heads * slots * config.head_size * 8
        }  # float64
        assert {view.shape[2] for view in views} == {min(cache.length, slots)}
    assert cache.length == tokens.shape[1]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("window", [0, 4])
def test_greedy_generate_is_the_same_for_every_implementation(window):
    models = same_weights(replace(SMALL, n_kv_heads=2, window=window))
    prompt = tokens_for(2, 5)
    generated = {name: model.eval().generate(prompt, 12) for name, model in models.items()}
    assert generated["naive"].shape == (2, 17)
    assert torch.equal(generated["naive"][:, :5], prompt)
    for name in IMPLEMENTATIONS[1:]:
        assert torch.equal(generated[name], generated["naive"]), name


def test_greedy_generate_equals_decoding_without_a_cache():
    model = same_weights(replace(SMALL, n_kv_heads=4))["naive"].eval()
    tokens = tokens_for(2, 5)
    expected = tokens
    with torch.no_grad():
        for _ in range(8):
            next_token = model(expected)[:, -1].argmax(dim=-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert torch.equal(model.generate(tokens, 8), expected)


def test_sampling_follows_the_generator_and_top_k_one_is_greedy():
    model = same_weights(SMALL)["naive"].eval()
    prompt = tokens_for(1, 4)

    def sampled(seed, **options):
        generator = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 10, temperature=1.0, generator=generator, **options)

    assert torch.equal(sampled(3), sampled(3))
    assert torch.equal(sampled(3, top_k=1), model.generate(prompt, 10))


@pytest.mark.parametrize("temperature", [1e-39, 1e-300])
def test_a_tiny_temperature_draws_the_largest_logit(temperature):
    """logits / temperature overflowed to inf, and inf - inf gave NaN probabilities."""
    from octlm.model import sample

    logits = torch.tensor([[3.0, 40.0, -2.0, 39.5], [1.0, 0.0, 0.5, 0.9]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        drawn = sample(logits, temperature, None, generator)
        assert drawn.tolist() == [[1], [0]]


def test_rope_positions_are_relative():
    model = same_weights(SMALL, torch.float64)["naive"].eval()
    tokens = tokens_for(2, 12)
    default = model(tokens)
    assert torch.equal(model(tokens, positions=torch.arange(12)), default)
    # Shifting every position leaves each query-key angle, hence the logits, unchanged (up to
    # the float32 rounding of the cos/sin tables).
    shifted = model(tokens, positions=torch.arange(12) + 30)
    torch.testing.assert_close(shifted, default, rtol=0, atol=1e-6)


# Two packed rows of 40 tokens: a document of one token, documents across the (8, 16) tiles'
# edges, ids in no order.
PACKED = torch.tensor(
    [[0] * 5 + [1] + [2] * 13 + [3] * 17 + [4] * 4, [7] * 9 + [3] * 11 + [8] * 6 + [5] * 14]
)


def alone(model: OctLM, tokens: torch.Tensor, document_ids: torch.Tensor):
    """``(row, places, logits)`` of every document of every row, run as a row of its own."""
    for row, (ids, line) in enumerate(zip(document_ids, tokens, strict=True)):
        for document in ids.unique():
            places = (ids == document).nonzero().flatten()  # the document's tokens, in order
            yield row, places, model(line[places].unsqueeze(0))[0]  # (n, V)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("attention", IMPLEMENTATIONS)
def test_a_packed_row_gives_each_document_its_logits_and_gradients_alone(attention, window):
    config = replace(SMALL, n_kv_heads=2, window=window)
    model = same_weights(config, torch.float64)[attention]
    tokens = tokens_for(2, 40)
    weights = torch.randn(2, 40, SMALL.vocab_size, dtype=torch.float64)  # a loss linear in logits
    packed = model(tokens, PACKED)  # (2, 40, V)
    packed_grads = torch.autograd.grad((packed * weights).sum(), list(model.parameters()))
    loss = 0
    for row, places, logits in alone(model, tokens, PACKED):
        torch.testing.assert_close(packed[row, places], logits, rtol=0, atol=1e-10)
        loss = loss + (logits * weights[row, places]).sum()
    for packed_grad, grad in zip(
        packed_grads, torch.autograd.grad(loss, list(model.parameters())), strict=True
    ):
        assert packed_grad.abs().sum() > 0
        torch.testing.assert_close(packed_grad, grad, rtol=0, atol=1e-10)

    models = same_weights(config)  # float32, judged against the float64 model alone
    tested = models[attention](tokens, PACKED).detach()  # (2, 40, V)
    references = alone(model, tokens, PACKED)
    for (row, places, base), (_, _, reference) in zip(
        alone(models["naive"], tokens, PACKED), references, strict=True
    ):
        verdict = judge(tested[row, places], base.detach(), reference.detach())
        assert verdict.passed, f"row {row}, tokens {places.tolist()}: {verdict}"


def test_a_document_whose_tokens_recur_apart_counts_positions_within_itself():
    ids = torch.tensor([[7] * 9 + [3] * 11 + [7] * 6 + [5] * 14])  # document 7 resumes at 20
    assert document_positions(ids)[0, 18:22].tolist() == [9, 10, 9, 10]
    tokens = tokens_for(1, 40)
    for attention in ("naive", "tiled"):
        model = same_weights(SMALL, torch.float64)[attention]
        packed = model(tokens, ids)  # (1, 40, V)
        for row, places, logits in alone(model, tokens, ids):
            torch.testing.assert_close(packed[row, places], logits, rtol=0, atol=1e-10)


IDS = torch.zeros(2, 4, dtype=torch.long)


@pytest.mark.parametrize(
    ("document_ids", "options", "error", "match"),
    [
        (IDS.tolist(), {}, TypeError, r"document_ids must be a torch.Tensor or None, got list"),
        (IDS.float(), {}, TypeError, r"integer tensor, got torch.float32"),
        (IDS.bool(), {}, TypeError, r"integer tensor, got torch.bool"),
        (IDS[:, :3], {}, ValueError, r"shape of tokens \(2, 4\), got \(2, 3\)"),
        (IDS.to("meta"), {}, ValueError, r"is on meta but tokens are on cpu"),
        (IDS, {"positions": torch.arange(4)}, ValueError, r"pass positions or document_ids"),
        (IDS, {"attention": "ring"}, ValueError, r"'sdpa', 'tiled', 'auto'\); 'ring' does not"),
    ],
)
def test_bad_document_ids_raise(document_ids, options, error, match):
    attention = options.pop("attention", SMALL.attention)
    model = OctLM(replace(SMALL, attention=attention))
    with pytest.raises(error, match=match):
        model(torch.zeros(2, 4, dtype=torch.long), document_ids, **options)


def test_document_ids_with_a_cache_are_refused_before_anything_is_written():
    model = OctLM(SMALL).eval()
    cache = KVCache(SMALL)
    with pytest.raises(ValueError, match=r"KVCache: decoding packed rows is not supported"):
        model(torch.zeros(2, 4, dtype=torch.long), IDS, cache=cache)
    assert cache.length == 0 and not cache.keys


def test_dropout_only_while_training():
    torch.manual_seed(0)
    model = OctLM(replace(SMALL, dropout=0.3, attention="sdpa"))
    plain = OctLM(SMALL)
    plain.load_state_dict(model.state_dict())
    tokens = tokens_for(2, 16)
    assert torch.equal(model.eval()(tokens), plain.eval()(tokens))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))


def test_state_dict_round_trip():
    model = same_weights(replace(SMALL, n_kv_heads=2))["naive"]
    state = model.state_dict()
    assert "cos" not in state and "sin" not in state  # recomputed from the config
    assert state["_extra_state"] == {"config": asdict(model.config)}
    torch.manual_seed(123)
    restored = OctLM(model.config)
    restored.load_state_dict(state)
    tokens = tokens_for(2, 20)
    assert torch.equal(restored(tokens), model(tokens))


def snapshot(cache: KVCache) -> tuple:
    return cache.length, [t.clone() for t in cache.keys + cache.values]


@pytest.mark.parametrize(
    ("other", "match"),
    [
        ({"window": 0}, r"window=6 vs 0"),
        ({"n_layers": 1}, r"n_layers=2 vs 1"),
        ({"n_layers": 3}, r"n_layers=2 vs 3"),
        ({"n_kv_heads": 4}, r"n_kv_heads=2 vs 4"),
        ({"width": 32, "n_heads": 4}, r"width=64 vs 32"),
        ({"max_length": 48}, r"max_length=64 vs 48"),
        ({"rope_base": 500.0}, r"rope_base=10000.0 vs 500.0"),
        ({"dtype": torch.float32}, r"cache holds torch.float64 on cpu but the model runs in "),
        ({"batch": 1}, r"cache holds batch 2 but tokens have batch 1"),
    ],
)
def test_cache_for_another_model_is_refused_before_anything_is_written(other, match):
    config = replace(SMALL, n_kv_heads=2, window=6)
    torch.manual_seed(0)
    model = OctLM(config).double().eval()
    tokens = tokens_for(2, 12)
    cache = KVCache(config)
    model(tokens[:, :8], cache=cache)
    before = snapshot(cache)
    dtype, batch = other.pop("dtype", torch.float64), other.pop("batch", 2)
    wrong = OctLM(replace(config, **other)).to(dtype).eval()
    with pytest.raises(ValueError, match=match):
        wrong(tokens[:batch, 8:9], cache=cache)
    length, buffers = snapshot(cache)
    assert length == before[0]
    assert all(torch.equal(a, b) for a, b in zip(buffers, before[1], strict=True))
    # The cache still serves its own model: decoding on gives the full forward's logits.
    rest = torch.cat([model(tokens[:, i : i + 1], cache=cache) for i in range(8, 12)], dim=1)
    torch.testing.assert_close(rest, model(tokens)[:, 8:], rtol=0, atol=1e-10)


def test_a_cache_serves_a_model_that_runs_differently():
    config = replace(SMALL, n_kv_heads=2, window=6)
    models = same_weights(config, torch.float64)
    tokens = tokens_for(2, 10)
    cache = KVCache(config)
    models["naive"].eval()(tokens[:, :7], cache=cache)
    tail = models["tiled"].eval()(tokens[:, 7:], cache=cache)
    torch.testing.assert_close(tail, models["naive"](tokens)[:, 7:], rtol=0, atol=1e-10)


def test_saved_model_loads_with_its_config_and_weights(tmp_path):
    config = replace(SMALL, n_kv_heads=2, window=9, rope_base=500.0, attention="naive")
    model = same_weights(config)["naive"].eval()
    model.save(tmp_path / "model.pt")
    loaded = OctLM.load(tmp_path / "model.pt", attention="tiled").eval()
    assert loaded.config == replace(config, attention="tiled")
    tokens = tokens_for(2, 20)
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=1e-5)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary left behind


@pytest.mark.parametrize(
    ("other", "match"),
    [
        ({"n_heads": 4, "n_kv_heads": 4}, r"n_heads=8 vs 4"),
        ({"window": 16}, r"window=0 vs 16"),
        ({"rope_base": 500.0}, r"rope_base=10000.0 vs 500.0"),
        ({"max_length": 128}, r"max_length=64 vs 128"),
    ],
)
def test_weights_of_another_config_are_refused(tmp_path, other, match):
    model = OctLM(SMALL)
    model.save(tmp_path / "model.pt")
    torch.manual_seed(5)
    target = OctLM(replace(SMALL, **other))
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(model.state_dict())
    after = target.state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before if name != "_extra_state")
    with pytest.raises(ValueError, match=match):
        OctLM.load(tmp_path / "model.pt", **other)


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    OctLM(SMALL).save(path)
    saved = path.read_bytes()

    def torn_save(obj, out):
        out.write(b"PK\x03\x04 half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space left"):
        OctLM(replace(SMALL, window=3)).save(path)
    assert path.read_bytes() == saved
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


@pytest.mark.parametrize("damage", ["torn", "flipped byte", "empty", "plain state dict"])
def test_damaged_model_file_gives_a_clear_error(tmp_path, damage):
    path = tmp_path / "model.pt"
    model = OctLM(SMALL)
    model.save(path)
    data = bytearray(path.read_bytes())
    if damage == "torn":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        data[len(data) // 2] ^= 0x01  # inside the weights: torch itself would not notice
        path.write_bytes(data)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save(model.state_dict(), path)
    match = {"flipped byte": "checksum does not match", "plain state dict": "not an octlm model"}
    with pytest.raises(ValueError, match=match.get(damage, r"torn or corrupted file\?")):
        OctLM.load(path)


def test_a_model_file_cut_anywhere_gives_a_clear_error(tmp_path):
    """torch reports some cuts as OSError (EINVAL from the zip reader): still a ValueError."""
    path = tmp_path / "model.pt"
    OctLM(replace(SMALL, n_layers=1)).save(path)
    data = path.read_bytes()
    for cut in range(1, len(data), max(1, len(data) // 61)):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"torn or corrupted file\?"):
            OctLM.load(path)


def test_a_missing_file_is_not_called_damaged(tmp_path):
    with pytest.raises(FileNotFoundError):
        OctLM.load(tmp_path / "absent.pt")
    with pytest.raises(TypeError, match=r"fields that ModelConfig does not have: \['bogus'\]"):
        OctLM.load(tmp_path / "absent.pt", bogus=1)


@pytest.mark.parametrize("entry", ["state_dict", "sha256"])
def test_a_model_file_missing_an_entry_is_called_corrupted(tmp_path, entry):
    path = tmp_path / "model.pt"
    OctLM(SMALL).save(path)
    contents = torch.load(path, weights_only=True)
    del contents[entry]
    torch.save(contents, path)
    with pytest.raises(ValueError, match="checksum does not match"):
        OctLM.load(path)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_loads_in_the_dtype_it_was_saved_in(tmp_path, dtype):
    model = OctLM(SMALL).to(dtype).eval()
    model.save(tmp_path / "model.pt")
    loaded = OctLM.load(tmp_path / "model.pt").eval()
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    tokens = tokens_for(1, 12)
    assert torch.equal(loaded(tokens), model(tokens))


def test_the_model_keeps_its_own_config():
    config = replace(SMALL)
    model = OctLM(config)
    config.attention = "naive"
    assert model.config.attention == SMALL.attention
    assert all(block.attention.config is model.config for block in model.blocks)


def test_a_cache_of_another_type_is_refused():
    with pytest.raises(TypeError, match="cache must be a KVCache or None, got int"):
        OctLM(SMALL)(torch.zeros(1, 3, dtype=torch.long), cache=5)


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_call_that_fails_part_way_leaves_a_windowed_cache_as_it_was(chunk):
    """The ring's slots are overwritten only once every layer has run: a call that fails in a
    later layer (here the last one's attention) can be retried, and decoding goes on exact."""
    config = replace(SMALL, window=5, n_kv_heads=2)
    torch.manual_seed(0)
    model = OctLM(config).double().eval()
    tokens = tokens_for(1, 14)
    full = model(tokens)
    cache = KVCache(config)
    model(tokens[:, :9], cache=cache)  # the ring is full and has wrapped
    last = model.blocks[-1].attention

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    last.forward, keep = fail, last.forward
    with pytest.raises(RuntimeError, match="out of memory"):
        model(tokens[:, 9 : 9 + chunk], cache=cache)
    last.forward = keep
    assert cache.length == 9
    pieces = [model(piece, cache=cache) for piece in tokens[:, 9:].split(chunk, dim=1)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full[:, 9:], rtol=0, atol=1e-10)


COMPILED = """
import torch, torch.nn.functional as F
from dataclasses import replace
from tests.model.test_model import SMALL, logits_and_grads, same_weights, tokens_for
torch.set_num_threads(1)
for attention in ("naive", "sdpa", "tiled"):
    config = replace(SMALL, n_kv_heads=2, attention=attention)
    model = same_weights(config, torch.float64)[attention]
    tokens = tokens_for(2, 40)
    logits, grads = logits_and_grads(model, tokens)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")(tokens[:, :-1])
    F.cross_entropy(compiled.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    torch.testing.assert_close(compiled, logits, rtol=0, atol=1e-12)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name], rtol=0, atol=1e-12)
"""


def test_a_compiled_model_gives_the_eager_logits_and_gradients():
    """torch.compile traces the model; tiled's block loop (Python over tile bounds) is a graph
    break, run eagerly, also on one thread, where tracing it would crash dynamo. The "eager"
    backend keeps the test fast: the tracing is what is checked. In a process of its own:
    dynamo imports Triton, which tests/attention/test_triton.py must import first, for its
    interpreter."""
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", COMPILED], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_importing_octlm_imports_neither_dynamo_nor_triton():
    """Both cost seconds, and Triton imported for a GPU keeps its CPU interpreter off."""
    code = "import sys, octlm; print(sorted({'torch._dynamo', 'triton'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


def test_kv_heads_default_to_heads():
    assert ModelConfig(n_heads=4, width=64).n_kv_heads == 4


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"width": 60}, r"width \(60\) must be a multiple of n_heads \(8\)"),
        ({"n_kv_heads": 3}, r"n_heads \(8\) must be a multiple of n_kv_heads \(3\)"),
        ({"width": 24}, r"head size width // n_heads = 3 must be even"),
        ({"attention": "flash"}, r"attention must be one of .* got 'flash'"),
        ({"window": -1}, r"window must be an int >= 0 .* got -1"),
        ({"attention": "tiled", "dropout": 0.1}, r"dropout=0.1 needs attention in"),
        ({"attention": "ring", "dropout": 0.1}, r"'ring' has no attention dropout"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
        ({"width": 0}, r"width must be a positive int, got 0"),
        ({"n_layers": 0}, r"n_layers must be a positive int, got 0"),
        ({"vocab_size": -3}, r"vocab_size must be a positive int, got -3"),
        ({"max_length": 0}, r"max_length must be a positive int, got 0"),
        ({"n_heads": 2.0}, r"n_heads must be a positive int, got 2.0"),
        ({"block": 0}, r"block must be an int >= 1 or a pair"),
        ({"rope_base": 0}, r"rope_base must be a positive number, got 0"),
    ],
)
def test_config_rejects_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        replace(SMALL, **fields)


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        (torch.tensor([[1, 256]]), ValueError, r"\[0, vocab_size=256\), got values in \[1, 256\]"),
        (torch.tensor([[-1, 5]]), ValueError, r"\[0, vocab_size=256\)"),
        (torch.zeros(1, 65, dtype=torch.long), ValueError, r"65 positions .* max_length=64"),
        (torch.tensor([[1, 2]], dtype=torch.int32), TypeError, r"int64 tensor, got torch.int32"),
        (torch.tensor([1, 2]), ValueError, r"shape \(batch, length\)"),
        (
            torch.zeros(0, 5, dtype=torch.long),
            ValueError,
            r"batch >= 1 and length >= 1, got \(0, 5\)",
        ),
        (
            torch.zeros(2, 0, dtype=torch.long),
            ValueError,
            r"batch >= 1 and length >= 1, got \(2, 0\)",
        ),
    ],
)
def test_bad_tokens_raise(tokens, error, match):
    model = OctLM(SMALL)
    with pytest.raises(error, match=match):
        model(tokens)


def test_cache_and_generate_stop_at_max_length():
    model = OctLM(SMALL).eval()
    cache = KVCache(SMALL)
    model(torch.zeros(1, 60, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"65 positions \(60 cached \+ 5 new\) exceeds max_length"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"makes 65 positions, more than max_length=64"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), 5)


def test_cache_capacity_bounds_the_buffers_and_is_refused_when_exceeded():
    model = OctLM(SMALL).eval()
    cache = KVCache(SMALL, capacity=10)
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    assert cache.keys[0].shape == (1, SMALL.n_heads, 8, SMALL.head_size)
    assert cache.keys[0].untyped_storage().nbytes() == SMALL.n_heads * 10 * SMALL.head_size * 4
    with pytest.raises(ValueError, match=r"8 cached \+ 3 new positions exceed .* capacity of 10"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    assert cache.length == 8
    with pytest.raises(ValueError, match=r"capacity must be an int in \[1, max_length=64\]"):
        KVCache(SMALL, capacity=65)


def test_bad_positions_and_cache_batch_raise():
    model = OctLM(SMALL)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"positions must have shape \(length,\) = \(4,\)"):
        model(tokens, positions=torch.arange(5))
    with pytest.raises(ValueError, match=r"positions must lie in \[0, max_length=64\)"):
        model(tokens, positions=torch.arange(62, 66))
    cache = KVCache(SMALL)
    model(tokens, cache=cache)
    with pytest.raises(ValueError, match=r"cache holds batch 2 but tokens have batch 1"):
        model(tokens[:1], cache=cache)


def test_training_lowers_the_loss():
    losses = loss_curve(replace(SMALL, n_kv_heads=2, attention="sdpa"), steps=30)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses


def test_training_is_reproducible_and_the_same_for_every_implementation():
    curves = {
        name: loss_curve(replace(SMALL, n_kv_heads=2, attention=name), steps=20)
        for name in IMPLEMENTATIONS
    }
    assert loss_curve(replace(SMALL, n_kv_heads=2, attention="naive"), steps=20) == curves["naive"]
    for name in IMPLEMENTATIONS[1:]:
        assert curves[name] == pytest.approx(curves["naive"], rel=1e-4), name


def test_a_model_file_of_the_first_format_still_loads():
    """tests/fixtures/model-format-1.pt was saved by octlm before training checkpoints had
    their own checksum: its flat checksum still matches, and it holds the seed-0 model."""
    path = Path(__file__).parents[1] / "fixtures" / "model-format-1.pt"
    loaded = OctLM.load(path)
    torch.manual_seed(0)
    made = OctLM(ModelConfig(width=16, n_layers=1, n_heads=2, max_length=32, attention="sdpa"))
    assert loaded.config == made.config  # the file names sdpa as its attention
    for (name, a), b in zip(loaded.state_dict().items(), made.state_dict().values(), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name


@pytest.mark.parametrize("name", [*IMPLEMENTATIONS, "auto"])
def test_attention_computes_in_float32_under_cpu_autocast(name, monkeypatch):
    """Under bfloat16 autocast on CPU the projections run in bfloat16 and every attention
    call gets float32 operands with autocast off; the gradients reach the weights."""
    seen = []
    impl = REGISTRY[name]

    def spy(query, key, value, **options):
        seen.append((query.dtype, key.dtype, value.dtype, torch.is_autocast_enabled("cpu")))
        return impl.function(query, key, value, **options)

    monkeypatch.setitem(REGISTRY, name, replace(impl, function=spy))
    torch.manual_seed(0)
    model = OctLM(replace(SMALL, attention=name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens_for(2, 24))  # (B, T, V)
    assert logits.dtype == torch.bfloat16
    assert seen == [(torch.float32,) * 3 + (False,)] * SMALL.n_layers
    logits.float().logsumexp(-1).sum().backward()
    for weight in model.parameters():
        assert weight.grad is not None and weight.grad.dtype == torch.float32
        assert weight.grad.isfinite().all()
