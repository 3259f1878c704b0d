"""Only query, key and value go by position: a positional option is a TypeError that names the
keyword it was most likely meant for and shows the keyword call."""

import pytest
import torch

from octlm.attention import naive_attention, tiled_attention


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
