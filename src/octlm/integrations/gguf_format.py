"""octlm's model as one GGUF file for llama.cpp and the apps built on it (Ollama, LM Studio).

Written with the ``gguf`` package (the library llama.cpp ships for this) under llama.cpp's
``llama`` architecture, which computes what octlm computes: pre-norm RMSNorm, RoPE, grouped-query
attention, SwiGLU, no biases; a model with ``qk_norm`` under ``qwen3``, which adds the norms over
each head's queries and keys (``attn_q_norm``, ``attn_k_norm``). docs/llama_cpp.md has the whole
path and the key table.

- Tensors: float32, or on request float16, bfloat16 or q8_0 (written by ``gguf``'s own
  quantizer). The 1-D norm weights stay float32, taken from the model's own weights bit for
  bit, as llama.cpp's converter keeps them; a matrix whose rows q8_0 cannot hold (a length not
  a multiple of its block of 32) falls back to float16, as llama.cpp's converter does. Names
  are llama.cpp's; a tied head writes no ``output.weight`` (llama.cpp then reads the
  embedding), an untied one does.
- RoPE: octlm turns the pair ``(i, i + D/2)`` of each head (rotate-half); llama.cpp's llama
  turns ``(2i, 2i + 1)``. Each head's query and key rows are interleaved to match
  (:func:`interleave`), which changes no score: a query and a key move the same way. Its
  qwen3 turns ``(i, i + D/2)`` as octlm does (NeoX order), so those rows go as they are: the
  norms' gains act on the rows in octlm's order.
- Tokenizer: a ``gpt2``-type vocabulary (byte-level symbols, merges, token types). A BPE run's
  comes from its ``tokenizer.json``, its end-of-text token a CONTROL token, the file's
  BOS and EOS. A byte run's is the 256 byte symbols and one merge that can never apply
  (llama.cpp needs at least one, and no merge makes its left side); it has no end token, and
  the format has no way to say so (without one llama.cpp takes id 11, a vertical tab), so NUL,
  a byte that text does not hold, is named instead.
- Pre-tokenizer ``gpt-2``: its regex is the one ``tokenizers``' ByteLevel pre-tokenizer uses,
  so llama.cpp splits text into the same words (docs/llama_cpp.md weighs the other names).
- Adding BOS and EOS is off (octlm's models start a text on its first token).
- A chat model (its tokenizer has ``<|im_start|>`` and ``<|im_end|>``, :mod:`octlm.chatml`):
  the chat tokens are CONTROL tokens, ``<|im_end|>`` is the EOS and the end of turn (EOT), and
  ``tokenizer.chat_template`` is ChatML (:data:`octlm.chatml.JINJA`), which llama.cpp's own
  template engine knows as ``chatml``. A byte run's chat tokenizer goes as the byte vocabulary
  above with the chat tokens after it. :func:`modelfile` is the Ollama ``Modelfile`` that
  export writes beside such a file. A base model's file has no template: with one,
  ``llama-completion`` turns to conversation mode.

A model with a window is refused: llama.cpp's llama and qwen3 architectures have no sliding
window and would attend to every key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

try:
    import gguf
except ImportError as error:
    raise ImportError("writing a GGUF file needs gguf: pip install 'octlm[export]'") from error

from octlm.chatml import CHAT_TOKENS, IM_END, JINJA, OLLAMA
from octlm.integrations.llama_format import renamed
from octlm.tokenizer import BYTE_VOCAB, END_OF_TEXT, byte_symbols

PRE_TOKENIZER = "gpt-2"
TYPES = {  # the type names export takes -> the matrices' GGML type
    "float32": gguf.GGMLQuantizationType.F32,
    "float16": gguf.GGMLQuantizationType.F16,
    "bfloat16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
FILE_TYPES = {
    "float32": gguf.LlamaFileType.ALL_F32,
    "float16": gguf.LlamaFileType.MOSTLY_F16,
    "bfloat16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
# What a matrix is written in when its rows do not fit the quantized type's blocks.
FALLBACK = gguf.GGMLQuantizationType.F16
# octlm name -> llama.cpp name, in each layer (prefixes ``blocks.N.`` and ``blk.N.``)
LAYER_TENSORS = {
    "attention_norm.weight": "attn_norm.weight",
    "attention.output.weight": "attn_output.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate.weight",
    "mlp.up.weight": "ffn_up.weight",
    "mlp.down.weight": "ffn_down.weight",
}
QK_NORM_TENSORS = {
    "attention.query_norm.weight": "attn_q_norm.weight",
    "attention.key_norm.weight": "attn_k_norm.weight",
}
PROJECTIONS = ("attn_q.weight", "attn_k.weight", "attn_v.weight")  # the rows of ``qkv``
MODEL_TENSORS = {
    "embedding.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
}
END_OF_BYTES = 0  # NUL: the EOS a byte model's file names, since it must name one


def architecture(config) -> str:
    """llama.cpp's architecture for ``config``'s model: qwen3 with QK-norm, else llama."""
    return "qwen3" if config.qk_norm else "llama"


def check_exportable(config) -> None:
    """``ValueError`` in one line for a model llama.cpp would compute otherwise."""
    if config.window:
        folder = "Qwen3" if config.qk_norm else "Mistral"
        raise ValueError(
            f"a model with a window (window={config.window}) cannot go to GGUF: llama.cpp's "
            f"{architecture(config)} architecture has no sliding window and would attend to "
            f"every key; export it as a transformers folder ({folder}) instead"
        )


def interleave(rows: Tensor, heads: int) -> Tensor:
    """Query or key rows ``(heads * D, C)`` from rotate-half order (pair ``(i, i + D/2)``) to
    llama.cpp's interleaved order (pair ``(2i, 2i + 1)``), head by head."""
    size = rows.shape[0] // heads
    halves = rows.reshape(heads, 2, size // 2, *rows.shape[1:])  # (H, 2, D/2, C)
    return halves.transpose(1, 2).reshape(rows.shape)  # (H * D, C): row 2i+j = half j's i


def gguf_tensors(config, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` under llama.cpp's names, on the CPU in its own dtype: ``qkv`` split, and for
    the llama architecture q and k interleaved."""
    names = LAYER_TENSORS | (QK_NORM_TENSORS if config.qk_norm else {})
    tensors = renamed(config, state, MODEL_TENSORS, names, PROJECTIONS, "blk.{}.")
    for layer in range(config.n_layers if architecture(config) == "llama" else 0):
        for name, heads in zip(PROJECTIONS[:2], (config.n_heads, config.n_kv_heads), strict=True):
            tensors[f"blk.{layer}.{name}"] = interleave(tensors[f"blk.{layer}.{name}"], heads)
    return {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}


def tensor_type(tensor: Tensor, dtype: str) -> gguf.GGMLQuantizationType:
    """The GGML type ``tensor`` is written in for export type ``dtype``: float32 for a 1-D
    norm weight, :data:`FALLBACK` for a matrix whose rows do not fill whole blocks."""
    if dtype not in TYPES:
        raise ValueError(f"dtype must be one of {tuple(TYPES)}, got {dtype!r}")
    if tensor.dim() < 2:
        return gguf.GGMLQuantizationType.F32
    wanted = TYPES[dtype]
    block, _bytes = gguf.GGML_QUANT_SIZES[wanted]
    return wanted if tensor.shape[-1] % block == 0 else FALLBACK


def fallbacks(config, state: dict[str, Tensor], dtype: str) -> list[str]:
    """The matrices (llama.cpp's names) written in :data:`FALLBACK` rather than ``dtype``."""
    return [
        name
        for name, tensor in gguf_tensors(config, state).items()
        if tensor.dim() > 1 and tensor_type(tensor, dtype) != TYPES[dtype]
    ]


def encoded(tensor: Tensor, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """``tensor``'s data as the writer takes it for GGML type ``kind``: float32 and float16 as
    numpy arrays, bfloat16 and quantized types as their bytes."""
    if kind == gguf.GGMLQuantizationType.BF16:  # numpy has no bfloat16: torch rounds, as gguf
        return tensor.to(torch.bfloat16).view(torch.uint8).numpy()
    if kind == gguf.GGMLQuantizationType.F16:
        return tensor.to(torch.float16).numpy()
    data = tensor.to(torch.float32).numpy()
    return data if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(data, kind)


def vocabulary(bpe: str | os.PathLike | None) -> dict:
    """The gpt2-type vocabulary of a BPE ``tokenizer.json`` (None: bytes): tokens, token types
    (the special tokens CONTROL), merges (one that never applies where the file has none), the
    EOS id (None where the run has no end token) and the end of turn (the id of
    ``<|im_end|>`` in a chat model's tokenizer, else None)."""
    symbols = byte_symbols()
    never = f"{symbols[0] * 2} {symbols[0]}"  # no merge makes its left side
    if bpe is None:
        normal = [gguf.TokenType.NORMAL] * BYTE_VOCAB
        return {"tokens": symbols, "types": normal, "merges": [never], "end": None, "turn": None}
    spec = json.loads(Path(bpe).read_text())
    added = {token["content"]: token["id"] for token in spec.get("added_tokens") or []}
    pieces = {index: token for token, index in spec["model"]["vocab"].items()}
    pieces |= {index: token for token, index in added.items()}
    tokens = [pieces[index] for index in range(len(pieces))]
    control = set(added.values())
    types = [
        gguf.TokenType.CONTROL if index in control else gguf.TokenType.NORMAL
        for index in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    chat = all(token in added for token in CHAT_TOKENS)
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges or [never],  # a byte run's chat tokenizer has no merges
        "end": added.get(END_OF_TEXT),
        "turn": added[IM_END] if chat else None,
    }


def modelfile(gguf_name: str, stops: list[str]) -> str:
    """The Ollama ``Modelfile`` of a chat model's GGUF file ``gguf_name`` (in the same folder):
    ChatML as its ``TEMPLATE`` (:data:`octlm.chatml.OLLAMA`) and a ``stop`` for each of
    ``stops``, the special tokens that end a reply."""
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{OLLAMA}"""']
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"


def write(
    path: str | os.PathLike,
    config,
    state: dict[str, Tensor],
    bpe: str | os.PathLike | None,
    dtype: str = "float32",
    name: str = "octlm",
) -> None:
    """Write the GGUF file ``path`` for the octlm model of ``config`` whose weights are
    ``state``, with the tokenizer of ``bpe`` (a ``tokenizer.json``; None: bytes); matrices in
    ``dtype`` (a name of :data:`TYPES`) where their shape allows (:func:`tensor_type`)."""
    check_exportable(config)
    if dtype not in TYPES:
        raise ValueError(f"dtype must be one of {tuple(TYPES)}, got {dtype!r}")
    words = vocabulary(bpe)
    if len(words["tokens"]) != config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(words['tokens'])} tokens and the model {config.vocab_size}"
        )
    end = END_OF_BYTES if words["end"] is None else words["end"]
    turn = words["turn"]
    writer = gguf.GGUFWriter(os.fspath(path), architecture(config))
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[dtype])
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_length)
    writer.add_embedding_length(config.width)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.mlp_width)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_size)
    writer.add_value_length(config.head_size)
    writer.add_rope_dimension_count(config.head_size)
    writer.add_rope_freq_base(float(config.rope_base))
    writer.add_layer_norm_rms_eps(float(config.norm_eps))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(words["tokens"])
    writer.add_token_types(words["types"])
    writer.add_token_merges(words["merges"])
    writer.add_bos_token_id(end)
    writer.add_eos_token_id(end if turn is None else turn)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    # A base model has no chat template: with one, llama-completion turns to conversation mode.
    if turn is not None:
        writer.add_eot_token_id(turn)
        writer.add_chat_template(JINJA)
    for tensor_name, tensor in gguf_tensors(config, state).items():
        kind = tensor_type(tensor, dtype)
        writer.add_tensor(tensor_name, encoded(tensor, kind), raw_dtype=kind)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
