"""ModelConfig's untied head, MLP width, norm epsilon and QK-norm: what each changes in the model,
that
a derived default compares equal to its explicit value, that bad values are refused by name,
that the train flags set them, and that runs and checkpoints that predate them still load."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import pytest
import torch

from octlm import ModelConfig, OctLM
from octlm.training import checkpoint
from octlm.training.config import RunConfig, check_resumable
from octlm.training.flags import add_arguments, explicit_values

CONFIG = ModelConfig(vocab_size=64, width=48, n_layers=2, n_heads=4, max_length=32)
NEW_FIELDS = ("tied_head", "mlp_width", "norm_eps", "qk_norm")

pytestmark = pytest.mark.usefixtures("one_thread")


def tokens() -> torch.Tensor:
    return torch.randint(CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))


def test_an_untied_head_is_a_matrix_of_its_own():
    tied = OctLM(CONFIG).eval()
    untied = OctLM(replace(CONFIG, tied_head=False)).eval()
    assert "head.weight" not in tied.state_dict()
    state = {**tied.state_dict(), "head.weight": tied.embedding.weight.detach().clone()}
    state["_extra_state"] = untied.get_extra_state()
    untied.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(untied(tokens()), tied(tokens()))  # the same matrix: the same model
        untied.head.weight.mul_(2)
        doubled = untied(tokens())
    # Logits are linear in the head: twice the head, twice the logits, embedding untouched.
    assert torch.allclose(doubled, 2 * tied(tokens()).detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(untied.embedding.weight, tied.embedding.weight)


def test_mlp_width_sets_the_mlp_and_its_default_equals_its_explicit_value():
    assert ModelConfig(width=96) == ModelConfig(width=96, mlp_width=256)  # 8/3 of 96
    model = OctLM(replace(CONFIG, mlp_width=40))
    assert tuple(model.blocks[0].mlp.gate.weight.shape) == (40, CONFIG.width)
    with pytest.raises(ValueError, match=r"mlp_width=40 vs 128"):
        OctLM(CONFIG).load_state_dict(model.state_dict())


def test_norm_eps_is_every_rmsnorms_epsilon():
    """Each norm of the model against RMSNorm's definition in float64, with an epsilon large
    enough to matter."""
    eps = 0.5
    model = OctLM(replace(CONFIG, norm_eps=eps)).double()
    x = torch.randn(3, CONFIG.width, dtype=torch.float64) * 0.3
    norms = [model.norm, *(m for b in model.blocks for m in (b.attention_norm, b.mlp_norm))]
    expected = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    for norm in norms:
        assert torch.allclose(norm(x), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_scores_blind_to_the_size_of_a_head_s_queries_and_keys(qk_norm):
    """With QK-norm each head's queries and keys are normalised before RoPE, so scaling the
    projection rows of one query head and one key head changes no logit (to float64 rounding,
    with an epsilon too small to matter); without it, the same scaling changes the model."""
    config = replace(CONFIG, qk_norm=qk_norm, norm_eps=1e-30, n_kv_heads=2)
    model = OctLM(config).double().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # gains away from 1, so that each is seen to act
                parameter.uniform_(0.5, 1.5)
        before = model(tokens())
        size = config.head_size
        qkv = model.blocks[0].attention.qkv.weight  # rows: H query heads, Hkv key, Hkv value
        qkv[size : 2 * size] *= 7.0  # query head 1
        keys = config.n_heads * size
        qkv[keys : keys + size] *= 0.2  # key head 0
        after = model(tokens())
    if qk_norm:
        assert torch.allclose(after, before, rtol=1e-12, atol=1e-12)
        norms = model.blocks[0].attention.query_norm, model.blocks[0].attention.key_norm
        assert [tuple(norm.weight.shape) for norm in norms] == [(size,), (size,)]
    else:
        assert (after - before).abs().max() > 1e-3
        assert not hasattr(model.blocks[0].attention, "query_norm")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tied_head": "false"}, r"tied_head must be true or false, got 'false'"),
        ({"qk_norm": 1}, r"qk_norm must be true or false, got 1"),
        ({"mlp_width": 0}, r"mlp_width must be a positive int or None, got 0"),
        ({"mlp_width": 2.5}, r"mlp_width must be a positive int or None, got 2.5"),
        ({"norm_eps": 0}, r"norm_eps must be a positive finite number, got 0"),
        ({"norm_eps": float("inf")}, r"norm_eps must be a positive finite number, got inf"),
        ({"norm_eps": True}, r"norm_eps must be a positive finite number, got True"),
    ],
)
def test_bad_values_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**changes)


def test_train_flags_set_the_new_fields():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--no-tied-head", "--mlp-width", "64", "--norm-eps", "1e-5", "--qk-norm"]
    model, _run = explicit_values(parser.parse_args(flags))
    assert model == {"tied_head": False, "mlp_width": 64, "norm_eps": 1e-5, "qk_norm": True}
    assert explicit_values(parser.parse_args(["--tied-head"]))[0] == {"tied_head": True}


def predating(config: ModelConfig) -> dict:
    """``config`` as a run or checkpoint written before these fields existed holds it."""
    return {k: v for k, v in asdict(config).items() if k not in NEW_FIELDS}


def test_a_run_and_a_checkpoint_that_predate_the_fields_still_load(tmp_path):
    config = ModelConfig(vocab_size=64, width=128, n_layers=1, n_heads=4)  # MLP 344, not 688
    stored = json.loads(json.dumps({"model": predating(config), "run": asdict(RunConfig())}))
    check_resumable(stored, config, RunConfig())  # no difference found
    model = OctLM(config)
    state = {"model_config": predating(config), "model": model.state_dict()}
    path = checkpoint.save(tmp_path, 1, state, keep=1)
    assert checkpoint.load(path, config)["step"] == 1
