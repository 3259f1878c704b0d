"""OctLM.from_pretrained: a transformers Llama (tied or untied head) or Mistral (with a window)
folder gives transformers' own logits with every attention implementation, and the same
cached greedy tokens; what octlm cannot compute exactly is refused, naming the field; export
gives back the folder's tensors bit for bit.

Tiny transformers models with random weights, saved with ``save_pretrained``; nothing is
downloaded.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from octlm import ModelConfig, OctLM  # noqa: E402
from octlm.export import export_model  # noqa: E402
from tests.transformers_folders import rope_tolerance  # noqa: E402

SIZES = dict(
    vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, initializer_range=0.2,  # peaked logits: greedy tokens decided by margins
)  # fmt: skip
CONFIGS = {
    "llama-tied": lambda: LlamaConfig(**SIZES, tie_word_embeddings=True, rope_theta=500.0),
    "llama-untied": lambda: LlamaConfig(**SIZES, tie_word_embeddings=False),
    "mistral-window": lambda: MistralConfig(**SIZES, sliding_window=12),
    "qwen3-tied": lambda: Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=True),
    "qwen3-window": lambda: Qwen3Config(
        **SIZES, head_dim=16, use_sliding_window=True, sliding_window=12, max_window_layers=0
    ),
}
LENGTH = 40

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request, tmp_path_factory):
    """A saved transformers model (float64 weights) of the kind ``request.param``, its norm
    gains drawn from [0.5, 1.5] so that a gain read into the wrong place is seen."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param]()).to(torch.float64)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path


def token_ids(length: int = LENGTH) -> torch.Tensor:
    return torch.randint(
        SIZES["vocab_size"], (2, length), generator=torch.Generator().manual_seed(3)
    )


def test_the_config_is_the_folders(folder):
    theirs = json.loads((folder / "config.json").read_text())
    config = OctLM.from_pretrained(folder).config
    assert (config.width, config.mlp_width, config.n_kv_heads) == (64, 80, 2)
    assert config.norm_eps == theirs["rms_norm_eps"]
    assert config.rope_base == theirs["rope_parameters"]["rope_theta"]
    assert config.tied_head == theirs["tie_word_embeddings"]
    assert config.window == (theirs.get("sliding_window") or 0)
    assert config.qk_norm == (theirs["model_type"] == "qwen3")
    assert config.max_length == theirs["max_position_embeddings"]


@pytest.mark.parametrize("attention", ["naive", "sdpa", "tiled"])
def test_logits_equal_transformers_with_every_attention(folder, attention):
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ours = OctLM.from_pretrained(folder, attention=attention, block=16)  # tiles: several blocks
    assert next(ours.parameters()).dtype == torch.float64
    ids = token_ids()
    with torch.no_grad():
        expected = theirs(ids).logits  # (B, T, V)
        logits = ours.eval()(ids)
    assert (logits - expected).abs().max().item() <= rope_tolerance(expected)


@pytest.mark.parametrize("attention", ["naive", "sdpa", "tiled"])
def test_cached_greedy_generation_gives_transformers_tokens(folder, attention):
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ours = OctLM.from_pretrained(folder, attention=attention, block=16).eval()
    theirs.generation_config.eos_token_id = None  # token 2 is a token like any other here
    prompt = token_ids(length=10)
    expected = theirs.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False
    )
    assert torch.equal(ours.generate(prompt, 20), expected)  # prefill, then one token per call


def test_export_gives_back_the_folders_tensors_bit_for_bit(folder, tmp_path):
    model = OctLM.from_pretrained(folder)
    export_model(model, tmp_path / "out", tokenizer=None)
    original = load_file(folder / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name].view(torch.int64), tensor.view(torch.int64)), name
    again = OctLM.from_pretrained(tmp_path / "out")
    assert asdict(again.config) == asdict(model.config)


def test_runtime_fields_only_may_change(folder):
    with pytest.raises(TypeError, match=r"may change only .*got \['width'\]"):
        OctLM.from_pretrained(folder, width=32)


def test_a_qwen2_folder_is_refused(tmp_path):
    """Qwen2 has biases on its query, key and value projections, which octlm has not."""
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SIZES))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'qwen2' is not one octlm computes exactly"):
        OctLM.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(CONFIGS["llama-untied"]()).save_pretrained(path)
    return path


def edited(source, target, **changes):
    """A copy of the folder ``source`` whose config.json has ``changes`` (None: key removed)."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    (target / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    return target


PARTIAL = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
REFUSED = [
    (
        {"attention_bias": True},
        r"attention_bias=True, but octlm computes only attention_bias=False",
    ),
    ({"mlp_bias": True}, r"mlp_bias=True"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu', but octlm computes only hidden_act='silu'"),
    ({"head_dim": 32}, r"head_dim=32, but octlm's head size is hidden_size // num_attention_h"),
    (
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        r"rope_parameters.rope_type='linear': octlm computes only 'default' RoPE",
    ),
    ({"rope_parameters": PARTIAL}, r"rope_parameters has partial_rotary_factor"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_scaling=.*no scaling"),
    ({"model_type": "gemma"}, r"model_type 'gemma' is not one octlm computes exactly"),
    ({"architectures": ["LlamaForTokenClassification"]}, r"architectures .*LlamaForCausalLM"),
    ({"tie_word_embeddings": True}, r"not in octlm's model: lm_head.weight"),
    ({"intermediate_size": 96}, r"gate_proj.weight has shape \(80, 64\), expected \(96, 64\)"),
]


@pytest.mark.parametrize("changes, message", REFUSED)
def test_what_octlm_cannot_compute_is_refused_by_name(llama_folder, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        OctLM.from_pretrained(edited(llama_folder, tmp_path / "edited", **changes))


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    AutoModelForCausalLM.from_config(CONFIGS["qwen3-tied"]()).save_pretrained(path)
    return path


MIXED = ["full_attention", "sliding_attention"]
QWEN3_REFUSED = [
    (
        {"use_sliding_window": True, "sliding_window": 12, "layer_types": MIXED},
        r"layer_types \['full_attention', 'sliding_attention'\]: octlm's window slides on every",
    ),
    (
        {"use_sliding_window": True, "max_window_layers": 1, "layer_types": None},
        r"layer_types \['full_attention', 'sliding_attention'\]",
    ),
    ({"head_dim": None}, r"head_dim=128, but octlm's head size is hidden_size // num_att"),
    ({"attention_bias": True}, r"attention_bias=True, but octlm computes only"),
]


@pytest.mark.parametrize("changes, message", QWEN3_REFUSED)
def test_what_octlm_cannot_compute_of_qwen3_is_refused(qwen3_folder, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        OctLM.from_pretrained(edited(qwen3_folder, tmp_path / "edited", **changes))


def test_a_llama_folder_called_qwen3_lacks_the_qk_norms(llama_folder, tmp_path):
    changes = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ValueError, match=r"missing model.layers.0.self_attn.k_norm.weight"):
        OctLM.from_pretrained(edited(llama_folder, tmp_path / "edited", **changes))


def test_a_folder_without_one_safetensors_file_is_refused(llama_folder, tmp_path):
    folder = edited(llama_folder, tmp_path / "edited")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has no model.safetensors.*sharded folders"):
        OctLM.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"has no config.json: not a transformers folder"):
        OctLM.from_pretrained(tmp_path)


def test_a_file_is_refused_as_no_folder(llama_folder, tmp_path):
    OctLM(ModelConfig(width=32, n_layers=1, n_heads=4)).save(tmp_path / "model.pt")
    for path in (tmp_path / "model.pt", llama_folder / "config.json"):
        with pytest.raises(ValueError, match=r"is a file, not a transformers folder"):
            OctLM.from_pretrained(path)
