"""What a KVCache holds: the cached positions as views, and nothing of a call that failed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from octlm import KVCache, ModelConfig, OctLM

CONFIG = ModelConfig(vocab_size=64, width=32, n_layers=2, n_heads=4, n_kv_heads=2, max_length=64)


def out_of_memory(*args, **kwargs):
    raise RuntimeError("out of memory")


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("failing", ["norm", "head"])
def test_a_call_that_fails_after_the_last_layer_leaves_the_cache_as_it_was(window, chunk, failing):
    """The final norm and the head (the (B, T, V) logits, where memory runs out first) come
    after every layer has written its keys; a failure there must not count the call."""
    config = replace(CONFIG, window=window)
    torch.manual_seed(0)
    model = OctLM(config).double().eval()
    tokens = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(config)
        model(tokens[:, :9], cache=cache)  # with the window, the ring has wrapped
        # The head fails on a width it cannot multiply, as it would on memory it cannot get.
        model.norm.forward = out_of_memory if failing == "norm" else lambda x: x[..., 1:]
        with pytest.raises(RuntimeError):
            model(tokens[:, 9 : 9 + chunk], cache=cache)
        del model.norm.forward
        assert cache.length == 9
        pieces = [model(piece, cache=cache) for piece in tokens[:, 9:].split(chunk, dim=1)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full[:, 9:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("window", [0, 5])
def test_keys_and_values_are_the_cached_positions(window):
    """``keys[layer]`` and ``values[layer]`` hold the positions cached so far and nothing
    else (with a window, the last ``window`` of them in their ring slots ``p % window``): the
    layer's keys (after RoPE) and values of those positions, as a full forward makes them."""
    config = replace(CONFIG, window=window)
    torch.manual_seed(0)
    model = OctLM(config).double().eval()
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2))
    made = {}  # layer -> (key, value) of the full forward, (B, Hkv, T, D) each
    for layer, block in enumerate(model.blocks):
        project = block.attention._project

        def recorded(x, rope, layer=layer, project=project):
            query, key, value = project(x, rope)
            made.setdefault(layer, (key, value))
            return query, key, value

        block.attention._project = recorded
    cache = KVCache(config)
    assert cache.keys == [] and cache.values == []
    with torch.no_grad():
        model(tokens)
        for chunk in tokens.split([3, 1, 7], dim=1):
            model(chunk, cache=cache)
            held = range(max(0, cache.length - (window or cache.length)), cache.length)
            positions = sorted(held, key=lambda p: p % (window or config.max_length))
            for layer, (key, value) in made.items():  # float64 rounding of chunked layers
                exact = dict(rtol=0, atol=1e-12)
                torch.testing.assert_close(cache.keys[layer], key[:, :, positions], **exact)
                torch.testing.assert_close(cache.values[layer], value[:, :, positions], **exact)
