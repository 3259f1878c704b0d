"""The block size is a performance choice, not a numerical one: two block sizes give outputs
that differ only by float32 rounding."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from octlm.attention import tiled_attention
from tests.helpers import make_qkv

blocks = st.one_of(st.integers(1, 80), st.tuples(st.integers(1, 80), st.integers(1, 80)))


@settings(max_examples=40, deadline=None)
@given(
    first=blocks,
    second=blocks,
    q_len=st.integers(1, 70),
    extra_keys=st.integers(0, 30),
    causal=st.booleans(),
    window=st.integers(0, 40),
    kv_heads=st.sampled_from([1, 2, 4]),
)
def test_block_size_changes_output_only_by_rounding(
    first, second, q_len, extra_keys, causal, window, kv_heads
):
    query, key, value = make_qkv(
        batch=1, heads=4, kv_heads=kv_heads, q_len=q_len, k_len=q_len + extra_keys, head_size=16
    )
    one = tiled_attention(query, key, value, block=first, causal=causal, window=window)
    other = tiled_attention(query, key, value, block=second, causal=causal, window=window)
    # Values are convex combinations of unit-normal values: a few float32 ulps of 1.
    assert (one - other).abs().max() <= 2e-6
