"""octlm export to GGUF: the file read back with gguf's own reader holds every tensor of the
model (for llama, q and k rows put back from llama.cpp's interleaved RoPE order by index; for
qwen3, with QK-norm, as they are) and every key llama.cpp reads; where llama-cpp-python is
installed, llama.cpp itself gives octlm's tokens, logits and greedy continuations for byte and
BPE runs, tied and untied, llama and qwen3, and stops at the end of text and nowhere else. A
windowed model and a model without a tokenizer are refused.

Tiny models with random peaked weights, written as run folders by hand; nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from octlm import ModelConfig, OctLM  # noqa: E402
from octlm.cli import main  # noqa: E402
from octlm.export import export  # noqa: E402
from octlm.integrations import gguf_format  # noqa: E402
from octlm.tokenizer import DEFAULT_BPE_VOCAB, END_OF_TEXT, BPETokenizer, byte_symbols  # noqa: E402
from octlm.training.config import PRESETS  # noqa: E402
from octlm.training.sample import generate_text  # noqa: E402
from tests.transformers_folders import TEXTS, make_run, peaked, rope_tolerance  # noqa: E402

CONFIG = ModelConfig(vocab_size=256, width=32, n_layers=2, n_heads=4, n_kv_heads=2, max_length=64)
BPE_VOCAB = 300
KINDS = [(tokenizer, tied) for tokenizer in ("bytes", "bpe") for tied in (True, False)]
# llama.cpp's architecture -> the model fields that make octlm's model one
ARCHITECTURES = {"llama": {}, "qwen3": {"qk_norm": True}}
CASES = [(*kind, "llama") for kind in KINDS] + [("bytes", True, "qwen3"), ("bpe", False, "qwen3")]

pytestmark = pytest.mark.usefixtures("one_thread")


def bpe_file(folder: Path) -> Path:
    """A BPE of octlm's own training (with its end-of-text token) on ``TEXTS``."""
    texts = [text.replace(END_OF_TEXT, "").encode() for text in TEXTS] * 20
    BPETokenizer.train(texts, BPE_VOCAB).save(folder)
    return folder / "tokenizer.json"


def write_run(root: Path, tokenizer: str, tied: bool, config: ModelConfig = CONFIG):
    """A run folder (checkpoints 2 and 4) of the kind asked: (folder, model of step 4, BPE or
    None)."""
    bpe = None
    if tokenizer == "bpe":
        (root / "bpe").mkdir(parents=True)
        bpe = BPETokenizer.from_file(bpe_file(root / "bpe"))
        config = replace(config, vocab_size=BPE_VOCAB)
    config = replace(config, tied_head=tied)
    models = make_run(
        root / "run", config, tokenizer=None if bpe is None else root / "bpe" / "tokenizer.json"
    )
    return root / "run", models[4], bpe


def fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def rotate_half_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows in llama.cpp's interleaved order back in rotate-half order, by index: within a
    head of size D, file row ``2i + j`` is row ``j * D/2 + i``."""
    size = rows.shape[0] // heads
    back = np.empty_like(rows)
    for head in range(heads):
        for i in range(size // 2):
            for j in range(2):
                back[head * size + j * size // 2 + i] = rows[head * size + 2 * i + j]
    return back


@pytest.mark.parametrize("tokenizer, tied, architecture", CASES)
def test_the_file_holds_every_tensor_and_key(tmp_path, tokenizer, tied, architecture):
    config = replace(CONFIG, **ARCHITECTURES[architecture])
    run, model, bpe = write_run(tmp_path, tokenizer, tied, config)
    exported = export(run, tmp_path / "model.gguf")
    assert exported.folder == tmp_path / "model.gguf" and exported.step == 4
    assert exported.architecture == f"GGUF {architecture}"
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    config, state = model.config, model.state_dict()
    values = fields(reader)
    arch = architecture
    expected = {
        "general.architecture": arch,
        "general.file_type": int(gguf.LlamaFileType.ALL_F32),
        f"{arch}.vocab_size": config.vocab_size,
        f"{arch}.context_length": config.max_length,
        f"{arch}.embedding_length": config.width,
        f"{arch}.block_count": config.n_layers,
        f"{arch}.feed_forward_length": config.mlp_width,
        f"{arch}.attention.head_count": config.n_heads,
        f"{arch}.attention.head_count_kv": config.n_kv_heads,
        f"{arch}.attention.key_length": config.head_size,
        f"{arch}.attention.value_length": config.head_size,
        f"{arch}.rope.dimension_count": config.head_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
    }
    for key, value in expected.items():
        assert values[key] == value, key
    assert values[f"{arch}.rope.freq_base"] == pytest.approx(config.rope_base, rel=1e-7)
    assert values[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(config.norm_eps)
    tokens, types = values["tokenizer.ggml.tokens"], values["tokenizer.ggml.token_type"]
    if bpe is None:
        assert tokens == byte_symbols()
        assert set(types) == {int(gguf.TokenType.NORMAL)}
        (merge,) = values["tokenizer.ggml.merges"]
        left, right = merge.split(" ")
        assert right in tokens and len(left) == 2 and left not in tokens  # never applies
        assert values["tokenizer.ggml.eos_token_id"] == 0  # NUL, as the docs say
    else:
        spec = json.loads((run / "tokenizer.json").read_text())
        vocabulary = spec["model"]["vocab"] | {END_OF_TEXT: bpe.end_token}
        assert {token: index for index, token in enumerate(tokens)} == vocabulary
        merges = [" ".join(pair) for pair in spec["model"]["merges"]]
        assert values["tokenizer.ggml.merges"] == merges
        control = [index for index, kind in enumerate(types) if kind == gguf.TokenType.CONTROL]
        assert control == [bpe.end_token] == [BPE_VOCAB - 1]
        assert values["tokenizer.ggml.eos_token_id"] == bpe.end_token
    assert values["tokenizer.ggml.bos_token_id"] == values["tokenizer.ggml.eos_token_id"]
    assert "tokenizer.chat_template" not in values  # llama-completion runs it as a base model
    tensors = {tensor.name: np.array(tensor.data) for tensor in reader.tensors}
    size = config.head_size
    rows = (config.n_heads * size, config.n_kv_heads * size, config.n_kv_heads * size)
    ours = {
        "token_embd.weight": state["embedding.weight"],
        "output_norm.weight": state["norm.weight"],
    }
    if not tied:
        ours["output.weight"] = state["head.weight"]
    for layer in range(config.n_layers):
        block = f"blocks.{layer}."
        q, k, v = state[block + "attention.qkv.weight"].split(rows)
        names = {
            "attn_norm": "attention_norm", "attn_output": "attention.output",
            "ffn_norm": "mlp_norm", "ffn_gate": "mlp.gate", "ffn_up": "mlp.up",
            "ffn_down": "mlp.down",
        }  # fmt: skip
        for theirs, name in names.items():
            ours[f"blk.{layer}.{theirs}.weight"] = state[block + name + ".weight"]
        ours[f"blk.{layer}.attn_v.weight"] = v
        ours[f"blk.{layer}.attn_q.weight"] = q
        ours[f"blk.{layer}.attn_k.weight"] = k
        if config.qk_norm:  # qwen3 turns rotate-half pairs itself: rows as octlm's
            ours[f"blk.{layer}.attn_q_norm.weight"] = state[block + "attention.query_norm.weight"]
            ours[f"blk.{layer}.attn_k_norm.weight"] = state[block + "attention.key_norm.weight"]
            continue
        tensors[f"blk.{layer}.attn_q.weight"] = rotate_half_rows(
            tensors[f"blk.{layer}.attn_q.weight"], config.n_heads
        )
        tensors[f"blk.{layer}.attn_k.weight"] = rotate_half_rows(
            tensors[f"blk.{layer}.attn_k.weight"], config.n_kv_heads
        )
    assert sorted(tensors) == sorted(ours)
    for name, tensor in ours.items():
        assert tensors[name].dtype == np.float32, name
        assert np.array_equal(tensors[name], tensor.numpy()), name


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "q8_0"])
def test_every_type_keeps_the_norms_of_the_model_bit_for_bit(tmp_path, dtype):
    run, model, _bpe = write_run(tmp_path, "bytes", tied=False)
    out = tmp_path / "model"
    assert main(["export", str(run), str(out), "--format", "gguf", "--dtype", dtype]) == 0
    reader = gguf.GGUFReader(out)
    state = gguf_format.gguf_tensors(model.config, model.state_dict())
    norms = [tensor for tensor in reader.tensors if tensor.name.endswith("norm.weight")]
    assert len(norms) == 2 * CONFIG.n_layers + 1
    for tensor in norms:
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name
        ours = state[tensor.name].numpy()
        assert np.array_equal(np.array(tensor.data).view(np.uint32), ours.view(np.uint32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_matrices_are_the_weights_rounded_once(tmp_path, dtype):
    run, model, _bpe = write_run(tmp_path, "bytes", tied=False)
    out = tmp_path / "model"
    assert main(["export", str(run), str(out), "--format", "gguf", "--dtype", dtype]) == 0
    reader = gguf.GGUFReader(out)
    kinds = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    wanted = {"float16": gguf.GGMLQuantizationType.F16, "bfloat16": gguf.GGMLQuantizationType.BF16}
    assert kinds["blk.0.ffn_down.weight"] == kinds["output.weight"] == wanted[dtype]
    data = {tensor.name: tensor.data for tensor in reader.tensors}
    head = model.state_dict()["head.weight"].to(getattr(torch, dtype))
    stored = torch.from_numpy(
        np.array(data["output.weight"]).view(np.int16 if dtype == "bfloat16" else np.float16)
    )
    if dtype == "bfloat16":
        stored = stored.view(torch.bfloat16)
    assert torch.equal(stored.reshape(head.shape), head)


@pytest.mark.parametrize("flag", [("--dtype", "q8_0"), ("--outtype", "q8_0")])
def test_q8_0_is_gguf_s_own_quantizer_with_float16_where_rows_do_not_fit(tmp_path, capsys, flag):
    run, model, _bpe = write_run(tmp_path, "bytes", tied=False)  # MLP width 88: not 32s
    assert main(["export", str(run), str(tmp_path / "model.gguf"), *flag]) == 0
    said = capsys.readouterr().out
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    assert fields(reader)["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    state = gguf_format.gguf_tensors(model.config, model.state_dict())
    down = [f"blk.{layer}.ffn_down.weight" for layer in range(CONFIG.n_layers)]
    assert "in float16, as q8_0 cannot hold their rows (a length not a multiple of its " in said
    assert said.rstrip().endswith(", ".join(down))
    q8_0, f16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
    for tensor in reader.tensors:
        ours = state[tensor.name].numpy()
        if ours.ndim == 1:
            continue
        if tensor.name in down:
            assert tensor.tensor_type == f16 and ours.shape[-1] % 32
            assert np.array_equal(np.array(tensor.data), ours.astype(np.float16))
        else:
            assert tensor.tensor_type == q8_0, tensor.name
            assert np.array_equal(np.array(tensor.data), gguf.quants.quantize(ours, q8_0))
            # within half a step of max/127 per block of 32, and the float16 rounding of that
            # step times up to 127
            back = gguf.quants.dequantize(np.array(tensor.data), q8_0)
            blocks = np.abs(ours.reshape(-1, 32)).max(axis=1, keepdims=True)
            assert (np.abs(back - ours).reshape(-1, 32) <= blocks / 127 * 0.6).all()


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_s_matrices_fill_whole_quantized_blocks(preset):
    """Rows of 32 (q8_0, q4_0) everywhere, and of 256 (the K-quants) where the width allows."""
    for vocab_size in (256, DEFAULT_BPE_VOCAB):
        with torch.device("meta"):
            model = OctLM(ModelConfig(vocab_size=vocab_size, **PRESETS[preset]))
        rows = {name: p.shape[-1] for name, p in model.named_parameters() if p.dim() == 2}
        assert all(row % 32 == 0 for row in rows.values()), rows
        if model.config.width % 256 == 0:
            assert all(row % 256 == 0 for row in rows.values()), rows


def test_the_tiny_preset_goes_to_q8_0_whole(tmp_path, capsys):
    OctLM(ModelConfig(vocab_size=256, **PRESETS["tiny"])).save(tmp_path / "model.pt")
    out = tmp_path / "model.gguf"
    assert main(["export", str(tmp_path / "model.pt"), str(out), "--dtype", "q8_0"]) == 0
    assert "in float16" not in capsys.readouterr().out
    kinds = {
        tensor.tensor_type for tensor in gguf.GGUFReader(out).tensors if len(tensor.shape) == 2
    }
    assert kinds == {gguf.GGMLQuantizationType.Q8_0}


def test_q8_0_is_refused_for_a_transformers_folder(tmp_path, capsys):
    run, _model, _bpe = write_run(tmp_path, "bytes", tied=True)
    assert main(["export", str(run), str(tmp_path / "folder"), "--dtype", "q8_0"]) == 2
    assert "dtype must be one of ('float32', 'float16', 'bfloat16') for transformers" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("architecture, folder", [("llama", "Mistral"), ("qwen3", "Qwen3")])
def test_a_windowed_model_is_refused_in_one_line(tmp_path, capsys, architecture, folder):
    config = replace(CONFIG, window=8, **ARCHITECTURES[architecture])
    run, _model, _bpe = write_run(tmp_path, "bytes", True, config)
    assert main(["export", str(run), str(tmp_path / "model.gguf")]) == 2
    error = capsys.readouterr().err
    assert "window=8" in error and "no sliding window" in error and error.count("\n") == 1
    assert f"llama.cpp's {architecture} architecture" in error and f"({folder})" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_model_file_without_a_tokenizer_is_refused(tmp_path, capsys):
    peaked(OctLM(replace(CONFIG, vocab_size=300))).save(tmp_path / "model.pt")
    assert main(["export", str(tmp_path / "model.pt"), str(tmp_path / "model.gguf")]) == 2
    assert "vocabulary of 300 is not bytes" in capsys.readouterr().err
    peaked(OctLM(CONFIG)).save(tmp_path / "bytes.pt")
    assert main(["export", str(tmp_path / "bytes.pt"), str(tmp_path / "bytes.gguf")]) == 0
    assert main(["export", str(tmp_path / "bytes.pt"), str(tmp_path / "bytes.gguf")]) == 2
    assert "exists: choose a new file" in capsys.readouterr().err
    assert (tmp_path / "bytes.gguf").stat().st_mode & 0o777 == 0o666 & ~current_umask()


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


# --- llama.cpp itself ---------------------------------------------------------------------------

LLAMA_CPP_THREADS = 1
# Why llama.cpp's checks skip where llama-cpp-python is not installed, and how to run them.
WITHOUT_LLAMA_CPP = "llama.cpp's own checks need llama-cpp-python: make llama-cpp"


def llama(path: Path, context: int):
    """llama.cpp on ``path`` with an f32 KV cache and flash attention off: its exact path."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=WITHOUT_LLAMA_CPP)
    return llama_cpp.Llama(
        str(path), n_ctx=context, logits_all=True, verbose=False, n_threads=LLAMA_CPP_THREADS,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
        flash_attn=False,
    )  # fmt: skip


def greedy_ids(llm, prompt: list[int], count: int) -> list[int]:
    """llama.cpp's greedy continuation: the argmax of its own logits, token by token."""
    llm.reset()
    llm.eval(prompt)
    drawn = []
    for _ in range(count):
        drawn.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(drawn[-1:])
    return drawn


@pytest.mark.parametrize("tokenizer, tied, architecture", CASES)
def test_llama_cpp_gives_octlm_s_tokens_and_logits(tmp_path, tokenizer, tied, architecture):
    pytest.importorskip("llama_cpp", reason=WITHOUT_LLAMA_CPP)
    config = replace(CONFIG, **ARCHITECTURES[architecture])
    run, model, bpe = write_run(tmp_path, tokenizer, tied, config)
    export(run, tmp_path / "model.gguf")
    llm = llama(tmp_path / "model.gguf", CONFIG.max_length)
    encode = (lambda data: list(data)) if bpe is None else bpe.encode
    for text in TEXTS:  # "<|endoftext|>" among them: text, as octlm reads it
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert ids == encode(text.encode()), text
    prompt = encode(TEXTS[0].encode())[:12]
    ids = torch.tensor([prompt + encode(TEXTS[1].encode())])[:, :40]  # (1, T)
    llm.reset()
    llm.eval(ids[0].tolist())
    theirs = torch.from_numpy(np.array(llm.scores[: ids.shape[1]])).double()  # (T, V)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(ids)[0]  # (T, V) float64
    assert (theirs - reference).abs().max().item() <= rope_tolerance(reference[None])
    with torch.no_grad():
        ours = model.generate(torch.tensor([prompt]), 40)[0, len(prompt) :].tolist()
    assert greedy_ids(llm, prompt, 40) == ours


@pytest.mark.parametrize("tokenizer, architecture", [("bytes", "llama"), ("bpe", "qwen3")])
def test_greedy_tokens_agree_with_llama_cpp_for_the_model_s_whole_context(
    tmp_path, tokenizer, architecture
):
    """Prompt and continuation fill ``max_length``: octlm's cached decoding (octlm sample's,
    tests/training/test_sample_context.py) and llama.cpp's argmax agree at every position."""
    pytest.importorskip("llama_cpp", reason=WITHOUT_LLAMA_CPP)
    config = replace(CONFIG, **ARCHITECTURES[architecture])
    run, model, bpe = write_run(tmp_path, tokenizer, True, config)
    export(run, tmp_path / "model.gguf")
    llm = llama(tmp_path / "model.gguf", CONFIG.max_length)
    prompt = bpe.encode(b"def f(x):") if bpe else list(b"def f(x):")
    count = CONFIG.max_length - len(prompt)
    with torch.no_grad():
        ours = model.generate(torch.tensor([prompt]), count)[0, len(prompt) :].tolist()
    assert greedy_ids(llm, prompt, count) == ours


def ending_model(model: OctLM, end: int, prompt: list[int], place: int) -> OctLM:
    """``model`` whose head row for ``end`` is 1.5 times that of the token it draws greedily
    at ``place``: that token's (positive) logit is the largest there, so ``end`` wins there or
    earlier, and greedy decoding ends."""
    with torch.no_grad():
        drawn = model.generate(torch.tensor([prompt]), place + 1)[0, len(prompt) + place]
        head = model.head.weight if not model.config.tied_head else model.embedding.weight
        head[end] = 1.5 * head[drawn]
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_llama_cpp_completion_stops_at_the_end_of_text_and_nowhere_else(tmp_path, tied):
    pytest.importorskip("llama_cpp", reason=WITHOUT_LLAMA_CPP)
    run, model, bpe = write_run(tmp_path, "bpe", tied)
    prompt = "def f(x):"
    ids = bpe.encode(prompt.encode())
    model = ending_model(model, bpe.end_token, ids, 12)
    from octlm.export import export_gguf

    export_gguf(model, tmp_path / "model.gguf", tokenizer=run / "tokenizer.json")
    with torch.no_grad():
        free = model.generate(torch.tensor([ids]), 30)[0, len(ids) :].tolist()
    assert bpe.end_token in free  # the model ends its text
    place = free.index(bpe.end_token)
    llm = llama(tmp_path / "model.gguf", CONFIG.max_length)
    completion = llm.create_completion(prompt, max_tokens=30, temperature=0.0, top_k=1)
    choice = completion["choices"][0]
    ours = generate_text(model, prompt, 30, tokenizer=bpe)
    assert choice["finish_reason"] == "stop"
    # octlm sample ends at the same place; llama.cpp's pieces are the same bytes (its text
    # drops what is not UTF-8, where octlm's replaces it)
    assert ours == (prompt.encode() + bpe.decode(free[:place])).decode(errors="replace")
    import llama_cpp

    vocab = llm._model.vocab
    drawn = greedy_ids(llm, ids, place + 1)
    assert drawn == free[: place + 1]
    assert llm.detokenize(drawn[:place]) == bpe.decode(free[:place])
    assert [bool(llama_cpp.llama_vocab_is_eog(vocab, t)) for t in drawn] == [False] * place + [True]


def test_llama_cpp_runs_a_byte_model_to_the_length_asked(tmp_path):
    """A byte model has no end of text: llama.cpp stops nowhere (its file's EOS is NUL)."""
    pytest.importorskip("llama_cpp", reason=WITHOUT_LLAMA_CPP)
    run, model, _bpe = write_run(tmp_path, "bytes", tied=False)
    export(run, tmp_path / "model.gguf")
    llm = llama(tmp_path / "model.gguf", CONFIG.max_length)
    completion = llm.create_completion("def ", max_tokens=40, temperature=0.0, top_k=1)
    with torch.no_grad():
        ours = model.generate(torch.tensor([list(b"def ")]), 40)[0, 4:].tolist()
    assert 0 not in ours
    assert completion["choices"][0]["finish_reason"] == "length"
    assert greedy_ids(llm, list(b"def "), 40) == ours
