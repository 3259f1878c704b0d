"""The model compiles whole: no graph break in a training step and no recompilation after the
first, counted by dynamo itself (a counting backend, so no C++ compiler is needed)."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

from octlm.model import ModelConfig, OctLM


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_step_is_one_graph_and_compiles_once(attention, dtype):
    torch._dynamo.reset()
    config = ModelConfig(vocab_size=64, width=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         max_length=32, attention=attention)  # fmt: skip
    model = OctLM(config)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=False)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 32), generator=generator)  # (B, T)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = compiled(tokens)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
    assert counter.frame_count == 1  # one graph: no break, and no recompilation


def test_compiled_logits_equal_eager_ones_and_eager_still_checks_token_values():
    torch._dynamo.reset()
    model = OctLM(ModelConfig(vocab_size=64, width=32, n_layers=1, n_heads=4, max_length=16))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, vocab_size=64\)"):
        model(tokens + 64)
