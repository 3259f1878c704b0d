"""octlm's model as a transformers Llama, Mistral or Qwen3 folder, and back: config fields and
weights.

octlm's model is the Llama architecture (pre-norm RMSNorm, rotate-half RoPE, grouped-query
attention, SwiGLU, no biases), so the two map one to one; docs/transformers.md has the table.
``SIZES``, ``LAYER_WEIGHTS``, ``QK_NORMS``, ``PROJECTIONS`` and ``MODEL_WEIGHTS`` below are the
mapping. A model with ``qk_norm`` is Qwen3's architecture: Llama's with an RMSNorm over each
head's queries and keys before RoPE (``q_norm``, ``k_norm``).

The fused ``qkv`` projection holds the query rows, then the key rows, then the value rows, each
head's ``D`` rows in the rotate-half layout transformers uses (the pair ``(i, i + D/2)`` turns
together), so the split needs no permutation. A window ``w`` lets a query see itself and the
``w - 1`` keys before it, which is what Mistral's ``sliding_window=w`` means; a model with a
window is written as Mistral, one without as Llama; a model with ``qk_norm`` as Qwen3, its window
(if any) on every layer.

Reading refuses, naming the key or tensor, whatever octlm cannot compute exactly: another
model type, biases, another activation, a head size other than ``hidden_size //
num_attention_heads``, RoPE scaling or partial rotation, missing, extra or misshapen tensors.
This module imports no other octlm module, so the model can delegate to it without a cycle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

try:
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save
except ImportError as error:
    raise ImportError(
        "reading and writing transformers folders needs safetensors: pip install 'octlm[export]'"
    ) from error

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
# model_type -> the class transformers builds for it.
FAMILY = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# transformers' Qwen3 head size where config.json gives none (Qwen3Config's default).
QWEN3_HEAD_DIM = 128
# octlm name -> transformers name, in each layer (prefixes ``blocks.N.`` and ``model.layers.N.``)
LAYER_WEIGHTS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.output.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
# The norms of a model with qk_norm, in each layer as LAYER_WEIGHTS.
QK_NORMS = {
    "attention.query_norm.weight": "self_attn.q_norm.weight",
    "attention.key_norm.weight": "self_attn.k_norm.weight",
}
# The rows of octlm's fused ``attention.qkv.weight``, in order.
PROJECTIONS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
MODEL_WEIGHTS = {
    "embedding.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
# config.json keys octlm reads, and the ModelConfig field each sets.
SIZES = {
    "vocab_size": "vocab_size",
    "hidden_size": "width",
    "intermediate_size": "mlp_width",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "max_position_embeddings": "max_length",
}
# Keys whose other values change what the model computes, with the value octlm computes.
REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def write(
    folder: str | os.PathLike,
    config,
    state: dict[str, Tensor],
    end_token: int | None = None,
    end_of_turn: int | None = None,
) -> None:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` for the octlm
    model of ``config`` (a ``ModelConfig``) whose weights are ``state`` (its state dict);
    ``end_token`` is the id of the run's end-of-text token (None: no token ends a sequence, as
    in a byte run), its ``eos_token_id``. A chat model's ``end_of_turn`` (the id of
    ``<|im_end|>``) ends a reply: ``generate`` stops there, or at the end of text where the
    run has one (``eos_token_id`` ``[end_of_turn, end_token]`` in ``generation_config.json``)."""
    folder = Path(folder)
    dtype = state["embedding.weight"].dtype
    _write_json(folder / CONFIG, llama_config(config, dtype, end_token))
    stops = end_token
    if end_of_turn is not None:
        stops = end_of_turn if end_token is None else [end_of_turn, end_token]
    generation = {"bos_token_id": None, "eos_token_id": stops, "pad_token_id": None}
    _write_json(folder / GENERATION_CONFIG, generation)
    # Serialised in memory, written by Python: a full disk is an OSError (safetensors' own
    # writer raises SafetensorError) and the file follows the umask (safetensors' is 0600).
    weights = save(llama_tensors(config, state), metadata={"format": "pt"})
    (folder / WEIGHTS).write_bytes(weights)


def model_type(config) -> str:
    """transformers' ``model_type`` for ``config``'s model: qwen3 with QK-norm, else mistral
    with a window, else llama."""
    return "qwen3" if config.qk_norm else "mistral" if config.window else "llama"


def layer_weights(config) -> dict[str, str]:
    """The octlm -> transformers names in each layer of ``config``'s model."""
    return LAYER_WEIGHTS | (QK_NORMS if config.qk_norm else {})


def llama_config(config, dtype: torch.dtype, end_token: int | None = None) -> dict:
    """The ``config.json`` of ``config``'s model: Llama, Mistral when it has a window, Qwen3
    when it has QK-norm (a window then slides on every layer)."""
    kind = model_type(config)
    values = {
        "architectures": [FAMILY[kind]],
        "model_type": kind,
        **{key: getattr(config, name) for key, name in SIZES.items()},
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope_base)},
        "tie_word_embeddings": config.tied_head,
        "attention_dropout": 0.0,  # dropout is a training setting (ModelConfig's runtime fields)
        "bos_token_id": None,
        "eos_token_id": end_token,
        "pad_token_id": None,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if kind == "mistral":
        return values | {"sliding_window": config.window}
    if kind == "qwen3":
        layer = "sliding_attention" if config.window else "full_attention"
        return values | {
            "attention_bias": False,
            "use_sliding_window": bool(config.window),
            "sliding_window": config.window or None,
            "max_window_layers": 0,
            "layer_types": [layer] * config.n_layers,
        }
    return values | {"attention_bias": False, "mlp_bias": False}


def renamed(
    config, state: dict[str, Tensor], names: dict, layer_names: dict, projections: tuple, layer: str
) -> dict[str, Tensor]:
    """``state`` under another format's names: ``names`` for the whole model's tensors,
    ``layer_names`` for each layer's (``blocks.N.`` becoming ``layer.format(N)``), and ``qkv``
    split into the three ``projections``. The GGUF writer shares it."""
    size = config.head_size
    rows = (config.n_heads * size, config.n_kv_heads * size, config.n_kv_heads * size)
    tensors = {theirs: state[ours] for ours, theirs in names.items() if ours in state}
    for index in range(config.n_layers):
        ours, theirs = f"blocks.{index}.", layer.format(index)
        for name, their_name in layer_names.items():
            tensors[theirs + their_name] = state[ours + name]
        parts = state[ours + "attention.qkv.weight"].split(rows)  # (H*D, C), (Hkv*D, C) x 2
        tensors |= {theirs + name: part for name, part in zip(projections, parts, strict=True)}
    return tensors


def llama_tensors(config, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` under transformers' names, ``qkv`` split into its three projections."""
    layer = "model.layers.{}."
    tensors = renamed(config, state, MODEL_WEIGHTS, layer_weights(config), PROJECTIONS, layer)
    # safetensors stores each tensor on its own: no views into a shared buffer
    return {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}


def read_weights(folder: str | os.PathLike, config) -> dict[str, Tensor]:
    """The octlm state dict (without its config) of the model of ``config`` (a ``ModelConfig``,
    from :func:`read_config`) in a transformers folder's ``model.safetensors``."""
    path = Path(folder) / WEIGHTS
    if not path.is_file():
        raise ValueError(
            f"{str(folder)!r} has no {WEIGHTS}: expected one safetensors file (sharded folders "
            "and pytorch_model.bin are not read)"
        )
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"cannot read {str(path)!r}: {error}") from error
    return octlm_state(config, tensors, where=str(path))


def read_config(folder: str | os.PathLike) -> dict:
    """The ``ModelConfig`` fields of a transformers folder's ``config.json`` of the Llama family
    (Llama, Mistral, Qwen3); ``ValueError`` naming a key whose value octlm cannot compute
    exactly."""
    path = Path(folder) / CONFIG
    if not Path(folder).exists():
        raise ValueError(
            f"{str(folder)!r} does not exist: expected a transformers folder (with {CONFIG} and "
            f"{WEIGHTS})"
        )
    if not Path(folder).is_dir():
        raise ValueError(
            f"{str(folder)!r} is a file, not a transformers folder (a folder with {CONFIG} and "
            f"{WEIGHTS}); a file saved with OctLM.save loads with OctLM.load"
        )
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(folder)!r} has no {CONFIG}: not a transformers folder") from None
    except ValueError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} holds {type(config).__name__}, not a JSON object")
    where = f"{str(path)!r}:"
    kind = config.get("model_type")
    if kind not in FAMILY:
        raise ValueError(
            f"{where} model_type {kind!r} is not one octlm computes exactly; expected one of "
            f"{tuple(FAMILY)} (no biases, SiLU gate, rotate-half RoPE)"
        )
    architectures = config.get("architectures")
    if architectures not in (None, [FAMILY[kind]]):
        raise ValueError(f"{where} architectures {architectures!r}, expected [{FAMILY[kind]!r}]")
    for key, expected in REQUIRED.items():
        if config.get(key, expected) != expected:
            raise ValueError(
                f"{where} {key}={config[key]!r}, but octlm computes only {key}={expected!r}"
            )
    missing = [key for key in SIZES if key not in config]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    values = {name: config[key] for key, name in SIZES.items()}
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads")
    values["n_kv_heads"] = heads if kv_heads is None else kv_heads
    width = config["hidden_size"]
    head_dim = config.get("head_dim", QWEN3_HEAD_DIM if kind == "qwen3" else None)
    if head_dim is not None and head_dim * heads != width:
        raise ValueError(
            f"{where} head_dim={head_dim!r}, but octlm's head size is hidden_size // "
            f"num_attention_heads = {width} // {heads}"
        )
    values["rope_base"] = _rope_theta(config, where)
    values["norm_eps"] = config.get("rms_norm_eps", 1e-6)
    values["tied_head"] = config.get("tie_word_embeddings", False)
    values["qk_norm"] = kind == "qwen3"
    window = None
    if kind == "mistral":
        window = config.get("sliding_window")
    elif kind == "qwen3":
        window = _qwen3_window(config, where)
    values["window"] = 0 if window is None else window
    return values


def _qwen3_window(config: dict, where: str) -> int | None:
    """The window of a Qwen3 ``config`` (None without one); ValueError where only some layers
    slide, which octlm's one window cannot say."""
    if not config.get("use_sliding_window", False):
        return None
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types")
    if kinds is None:  # transformers' rule: layers from max_window_layers on slide
        first = config.get("max_window_layers", 28)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if set(kinds) == {"full_attention"}:
        return None
    if set(kinds) != {"sliding_attention"}:
        raise ValueError(
            f"{where} layer_types {kinds!r}: octlm's window slides on every layer or on none"
        )
    return config.get("sliding_window")


def _rope_theta(config: dict, where: str) -> float:
    """RoPE's base from ``rope_parameters`` (or a top-level ``rope_theta``); ValueError for any
    scaling or partial rotation, which octlm's RoPE does not compute."""
    if config.get("rope_scaling") is not None:
        scaling = config["rope_scaling"]
        raise ValueError(f"{where} rope_scaling={scaling!r}: octlm's RoPE has no scaling")
    parameters = config.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        raise ValueError(f"{where} rope_parameters={parameters!r}, expected a JSON object")
    if parameters.get("rope_type", "default") != "default":
        raise ValueError(
            f"{where} rope_parameters.rope_type={parameters['rope_type']!r}: octlm computes only "
            "'default' RoPE (no scaling)"
        )
    extra = sorted(set(parameters) - {"rope_type", "rope_theta"})
    if extra:
        raise ValueError(
            f"{where} rope_parameters has {', '.join(extra)}: octlm's RoPE takes only rope_theta"
        )
    return parameters.get("rope_theta", config.get("rope_theta", 10000.0))


def octlm_state(config, tensors: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """transformers' tensors of the model of ``config`` under octlm's names, ``q``, ``k`` and
    ``v`` fused into ``qkv``; ValueError for a tensor missing, left over or misshapen, or a
    dtype that is not the embedding's."""
    expected = _llama_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{where} does not hold octlm's tensors"
            + (f"; missing {', '.join(missing[:4])}" if missing else "")
            + (f"; not in octlm's model: {', '.join(extra[:4])}" if extra else "")
        )
    dtype = tensors[MODEL_WEIGHTS["embedding.weight"]].dtype
    for name, shape in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
        if tensor.dtype != dtype or not tensor.is_floating_point():
            raise ValueError(
                f"{where}: {name} is {tensor.dtype}; octlm takes one floating dtype for every "
                f"tensor (the embedding's is {dtype})"
            )
    state = {ours: tensors[theirs] for ours, theirs in MODEL_WEIGHTS.items() if theirs in tensors}
    for layer in range(config.n_layers):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        for name, their_name in layer_weights(config).items():
            state[ours + name] = tensors[theirs + their_name]
        projections = [tensors[theirs + name] for name in PROJECTIONS]
        state[ours + "attention.qkv.weight"] = torch.cat(projections)  # ((H + 2 Hkv) D, C)
    return state


def _llama_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor transformers' model of ``config`` holds, with its shape."""
    vocab, width, mlp = config.vocab_size, config.width, config.mlp_width
    query, key = config.n_heads * config.head_size, config.n_kv_heads * config.head_size
    shapes = {"model.embed_tokens.weight": (vocab, width), "model.norm.weight": (width,)}
    if not config.tied_head:
        shapes["lm_head.weight"] = (vocab, width)
    layer_shapes = {
        "input_layernorm.weight": (width,),
        "post_attention_layernorm.weight": (width,),
        "self_attn.q_proj.weight": (query, width),
        "self_attn.k_proj.weight": (key, width),
        "self_attn.v_proj.weight": (key, width),
        "self_attn.o_proj.weight": (width, query),
        "mlp.gate_proj.weight": (mlp, width),
        "mlp.up_proj.weight": (mlp, width),
        "mlp.down_proj.weight": (width, mlp),
    }
    if config.qk_norm:
        size = (config.head_size,)
        layer_shapes |= {"self_attn.q_norm.weight": size, "self_attn.k_norm.weight": size}
    for layer in range(config.n_layers):
        shapes |= {f"model.layers.{layer}.{name}": shape for name, shape in layer_shapes.items()}
    return shapes


def _write_json(path: Path, values: dict) -> None:
    path.write_text(json.dumps(values, indent=2) + "\n")
