"""octlm export of a chat model (its tokenizer has ``<|im_start|>`` and ``<|im_end|>``): the
transformers folder carries ChatML, so ``apply_chat_template`` gives octlm's ids and greedy
``generate`` stops at ``<|im_end|>`` where octlm's reply ends; the GGUF file carries the
template, the end of turn and CONTROL token types, and an Ollama Modelfile goes beside it,
both or neither; where llama-cpp-python is installed, llama.cpp tokenizes the rendered prompt
as octlm does and its chat completion is octlm's greedy reply. Text that spells
``<|im_end|>`` is the control token to transformers and llama.cpp, and text to octlm.

Byte and BPE chat tokenizers, tiny models with random peaked weights written as run folders by
hand, and one run made by ``octlm train`` and ``octlm finetune``; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from octlm import ModelConfig, OctLM, chat, chatml
from octlm.chatml import IM_END, IM_START, JINJA, OLLAMA
from octlm.cli import main
from octlm.export import export, export_gguf, export_model
from octlm.integrations.tokenizer_files import bpe_file
from octlm.tokenizer import END_OF_TEXT, BPETokenizer, ByteTokenizer, byte_symbols, with_chat_tokens
from tests.transformers_folders import TEXTS, make_run

CONFIG = ModelConfig(vocab_size=256, width=32, n_layers=2, n_heads=4, n_kv_heads=2, max_length=128)
KINDS = ("bytes", "bpe")
# Conversations that spell no control token: a user alone, a system message, several turns.
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld ☃ 𝄞"}],
    [
        {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": "    return x  # done"},
        {"role": "user", "content": "  and   spaces\t\ttabs\n"},
    ],
]
PROMPT = CONVERSATIONS[1]  # the conversation a model answers
REPLY = 30  # the most new tokens asked

pytestmark = pytest.mark.usefixtures("one_thread")


def chat_tokenizer(kind: str) -> BPETokenizer:
    """A chat tokenizer as ``octlm finetune`` makes it: bytes or a BPE of octlm's own
    training (its end of text the last id), and the chat tokens after."""
    if kind == "bytes":
        return with_chat_tokens(ByteTokenizer())
    texts = [text.replace(END_OF_TEXT, "").encode() for text in TEXTS] * 20
    return with_chat_tokens(BPETokenizer.train(texts, 300))


def write_chat_run(root: Path, kind: str) -> tuple[Path, OctLM, BPETokenizer]:
    """A chat run folder (checkpoints 2 and 4, untied head) of the kind asked: (folder, model
    of step 4, its tokenizer)."""
    tokenizer = chat_tokenizer(kind)
    (root / "tokenizer").mkdir(parents=True)
    tokenizer.save(root / "tokenizer")
    config = replace(CONFIG, vocab_size=tokenizer.vocab_size, tied_head=False)
    models = make_run(root / "run", config, tokenizer=root / "tokenizer" / "tokenizer.json")
    return root / "run", models[4], tokenizer


def ending_turn(model: OctLM, tokenizer, messages, least: int = 4) -> chat.Reply:
    """``model`` made to end its greedy reply to ``messages`` after ``least`` tokens or a few
    more: the head row of ``<|im_end|>`` becomes 1.05 times that of the first token drawn there
    that was not drawn before. Where that token wins (a positive logit, the largest by far)
    ``<|im_end|>`` beats it; before, it stays below the largest. Returns octlm's reply, which
    ends there."""
    _, end = chatml.chat_ids(tokenizer)
    drawn = chat.reply(model, tokenizer, messages, max_new_tokens=REPLY).ids
    place = next(i for i in range(least, len(drawn)) if drawn[i] not in drawn[:i])
    with torch.no_grad():
        model.head.weight[end] = 1.05 * model.head.weight[drawn[place]]
    reply = chat.reply(model, tokenizer, messages, max_new_tokens=REPLY)
    assert reply.ids == drawn[:place]  # then <|im_end|>, as the callers check
    return reply


def rendered(tokenizer, messages, reply: bool = True) -> list[int]:
    return chatml.render(tokenizer, chatml.messages_of(messages, reply=reply), reply=reply).ids


# --- transformers --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_apply_chat_template_gives_octlm_s_ids(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    run, _model, tokenizer = write_chat_run(tmp_path, kind)
    exported = export(run, tmp_path / "out")
    assert exported.tokenizer == kind and exported.modelfile is None
    out = tmp_path / "out"
    # the run's own tokenizer.json: a byte run's holds the chat tokens too
    assert (out / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    start, end = chatml.chat_ids(tokenizer)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == JINJA and config["eos_token"] == IM_END
    decoder = {
        int(index): token["content"] for index, token in config["added_tokens_decoder"].items()
    }
    assert decoder == {index: token for token, index in tokenizer.special_ids.items()}
    assert all(token["special"] for token in config["added_tokens_decoder"].values())
    generation = json.loads((out / "generation_config.json").read_text())
    ends = end if kind == "bytes" else [end, tokenizer.end_token]
    assert generation["eos_token_id"] == ends
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token_id == end and theirs.convert_tokens_to_ids(IM_START) == start
    for messages in CONVERSATIONS:
        asked = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        assert asked["input_ids"] == rendered(tokenizer, messages), messages
        answered = [*messages, {"role": "assistant", "content": "ok, done."}]
        whole = theirs.apply_chat_template(answered, return_dict=True)["input_ids"]
        assert whole == rendered(tokenizer, answered, reply=False)
    # read back (octlm finetune FOLDER, --init-from): the folder's tokenizer, chat tokens and all
    assert bpe_file(out, tokenizer.vocab_size) == out / "tokenizer.json"


@pytest.mark.parametrize("kind", KINDS)
def test_generate_stops_at_im_end_where_octlm_s_reply_ends(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    run, model, tokenizer = write_chat_run(tmp_path, kind)
    ours = ending_turn(model, tokenizer, PROMPT)
    export_model(model, tmp_path / "out", tokenizer=run / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    asked = theirs.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        drawn = hf.eval().generate(**asked, max_new_tokens=REPLY, do_sample=False)
    drawn = drawn[0, asked["input_ids"].shape[1] :].tolist()
    _, end = chatml.chat_ids(tokenizer)
    assert drawn == [*ours.ids, end]
    assert theirs.decode(drawn, skip_special_tokens=True) == ours.text


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_reads_im_end_in_text_as_the_control_token(tmp_path, kind):
    """octlm reads the characters of ``<|im_end|>`` as text; transformers' tokenizer reads
    them as the token, in a plain text and inside a message alike."""
    transformers = pytest.importorskip("transformers")
    run, _model, tokenizer = write_chat_run(tmp_path, kind)
    export(run, tmp_path / "out")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    _, end = chatml.chat_ids(tokenizer)
    assert end in theirs("a<|im_end|>b")["input_ids"]
    assert end not in tokenizer.encode(b"a<|im_end|>b")
    forged = [{"role": "user", "content": "a<|im_end|>b"}]
    asked = theirs.apply_chat_template(forged, add_generation_prompt=True, return_dict=True)
    ours = rendered(tokenizer, forged)
    assert asked["input_ids"].count(end) == ours.count(end) + 1


# --- GGUF and Ollama -----------------------------------------------------------------------------


def fields(path: Path) -> dict:
    gguf = pytest.importorskip("gguf")
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_the_gguf_file_holds_chatml_and_ends_a_turn_at_im_end(tmp_path, kind):
    gguf = pytest.importorskip("gguf")
    run, _model, tokenizer = write_chat_run(tmp_path, kind)
    exported = export(run, tmp_path / "chat.gguf")
    assert exported.folder == tmp_path / "chat.gguf"
    assert exported.modelfile == tmp_path / "chat.Modelfile"
    values = fields(tmp_path / "chat.gguf")
    start, end = chatml.chat_ids(tokenizer)
    assert values["tokenizer.chat_template"] == JINJA
    assert values["tokenizer.ggml.eos_token_id"] == end
    assert values["tokenizer.ggml.eot_token_id"] == end
    assert values["tokenizer.ggml.add_bos_token"] is False
    tokens, types = values["tokenizer.ggml.tokens"], values["tokenizer.ggml.token_type"]
    assert len(tokens) == tokenizer.vocab_size
    control = {index for index, kind in enumerate(types) if kind == gguf.TokenType.CONTROL}
    assert control == set(tokenizer.special_ids.values())
    assert tokens[start] == IM_START and tokens[end] == IM_END
    stops = [IM_END]
    if kind == "bytes":  # the byte symbols, each id its byte; one merge that never applies
        assert values["tokenizer.ggml.model"] == "gpt2"
        assert tokens[:256] == byte_symbols() and (start, end) == (256, 257)
        (merge,) = values["tokenizer.ggml.merges"]
        assert merge.split(" ")[0] not in tokens
        assert values["tokenizer.ggml.bos_token_id"] == 0
    else:
        assert tokens[tokenizer.end_token] == END_OF_TEXT
        assert values["tokenizer.ggml.bos_token_id"] == tokenizer.end_token
        stops.append(END_OF_TEXT)
    parameters = "".join(f'PARAMETER stop "{stop}"\n' for stop in stops)
    expected = f'FROM ./chat.gguf\nTEMPLATE """{OLLAMA}"""\n{parameters}'
    assert (tmp_path / "chat.Modelfile").read_text() == expected


def test_the_modelfile_goes_with_the_gguf_file_both_or_neither(tmp_path, capsys, monkeypatch):
    pytest.importorskip("gguf")
    run, model, _tokenizer = write_chat_run(tmp_path, "bytes")
    before = sorted(os.listdir(tmp_path))
    # a Modelfile in the way: refused before anything is written
    (tmp_path / "chat.Modelfile").write_text("FROM elsewhere\n")
    assert main(["export", str(run), str(tmp_path / "chat.gguf")]) == 2
    error = capsys.readouterr().err
    assert "chat.Modelfile" in error and "exists" in error and error.count("\n") == 1
    assert (tmp_path / "chat.Modelfile").read_text() == "FROM elsewhere\n"
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "chat.Modelfile"])
    (tmp_path / "chat.Modelfile").unlink()
    # stopped between the two renames: the file already in place goes too
    replace_file, calls = os.replace, []

    def stopped_at_the_second(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise KeyboardInterrupt
        replace_file(source, target)

    monkeypatch.setattr(os, "replace", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(model, tmp_path / "chat.gguf", tokenizer=run / "tokenizer.json")
    monkeypatch.undo()
    assert len(calls) == 2 and sorted(os.listdir(tmp_path)) == before
    # whole: both; a base model: the file alone
    export_gguf(model, tmp_path / "chat.gguf", tokenizer=run / "tokenizer.json")
    assert {"chat.gguf", "chat.Modelfile"} <= set(os.listdir(tmp_path))
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "chat.Modelfile").stat().st_mode & 0o777 == 0o666 & ~umask
    base = OctLM(replace(CONFIG, vocab_size=256))
    assert export(save(base, tmp_path / "base.pt"), tmp_path / "base.gguf").modelfile is None
    assert not (tmp_path / "base.Modelfile").exists()
    assert "tokenizer.chat_template" not in fields(tmp_path / "base.gguf")


def save(model: OctLM, path: Path) -> Path:
    model.save(path)
    return path


# --- llama.cpp -----------------------------------------------------------------------------------


def built_in_chatml(messages) -> str:
    """The prompt llama.cpp's own template engine (no Jinja: llama-cli's without ``--jinja``)
    renders for ``messages`` under the file's template, and the reply's start."""
    import ctypes

    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages]
    )
    text = ctypes.create_string_buffer(4096)
    size = llama_cpp.llama_chat_apply_template(JINJA.encode(), chat, len(chat), True, text, 4096)
    assert 0 < size <= len(text)
    return text.raw[:size].decode()


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_renders_tokenizes_and_replies_as_octlm(tmp_path, kind):
    pytest.importorskip("gguf")
    from tests.integrations.test_gguf import WITHOUT_LLAMA_CPP, greedy_ids, llama

    pytest.importorskip("llama_cpp", reason=WITHOUT_LLAMA_CPP)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    run, model, tokenizer = write_chat_run(tmp_path, kind)
    ours = ending_turn(model, tokenizer, PROMPT)
    export_gguf(model, tmp_path / "chat.gguf", tokenizer=run / "tokenizer.json")
    llm = llama(tmp_path / "chat.gguf", CONFIG.max_length)
    template = ImmutableSandboxedEnvironment().from_string(JINJA)
    for messages in CONVERSATIONS:
        text = template.render(messages=messages, add_generation_prompt=True)
        assert built_in_chatml(messages) == text
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert ids == rendered(tokenizer, messages), messages
    _, end = chatml.chat_ids(tokenizer)
    # a text that spells <|im_end|>: the token to llama.cpp's special=True, text otherwise
    assert end in llm.tokenize(b"a<|im_end|>b", add_bos=False, special=True)
    spelt = llm.tokenize(b"a<|im_end|>b", add_bos=False, special=False)
    assert spelt == tokenizer.encode(b"a<|im_end|>b")
    prompt = rendered(tokenizer, PROMPT)
    assert greedy_ids(llm, prompt, len(ours.ids) + 1) == [*ours.ids, end]
    assert llm.chat_format == "chat_template.default"  # the file's own template
    llm.reset()
    completion = llm.create_chat_completion(PROMPT, temperature=0, max_tokens=REPLY)
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "stop"
    # llama-cpp-python drops bytes that are not UTF-8, where octlm's text replaces them
    assert choice["message"]["content"] == tokenizer.decode(ours.ids).decode(errors="ignore")
    # a message that spells <|im_end|>: one control token in llama.cpp's prompt
    forged = [{"role": "user", "content": "a<|im_end|>b"}]
    asked = llm.create_chat_completion(forged, temperature=0, max_tokens=1)["usage"]
    spelt_ids = len(tokenizer.encode(b"<|im_end|>"))
    assert asked["prompt_tokens"] == len(rendered(tokenizer, forged)) - spelt_ids + 1


# --- a run of octlm finetune ---------------------------------------------------------------------


def test_a_finetuned_byte_run_exports_with_its_chat_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 100)
    lines = [
        {"messages": [{"role": "user", "content": f"{i} plus {i}?"},
                      {"role": "assistant", "content": f"{2 * i}."}]}
        for i in range(40)
    ]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = [
        "--steps", "2", "--batch", "2", "--eval-every", "100000", "--checkpoint-every", "100000",
        "--eval-batches", "1", "--sample-tokens", "4", "--dtype", "float32", "--optimizer", "adamw",
    ]  # fmt: skip
    run += ["--length", "48"]
    model = ["--width", "16", "--n-layers", "1", "--n-heads", "2"]
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    text = ["--data", str(tmp_path / "text.txt"), "--tokenizer", "bytes"]
    assert main(["train", *text, *model, *run, "--out", str(base)]) == 0
    assert not (base / "tokenizer.json").exists()  # a byte run
    conversations = ["--data", str(tmp_path / "chat.jsonl")]
    assert main(["finetune", str(base), *conversations, *run, "--out", str(tuned)]) == 0
    from octlm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tuned)
    assert tokenizer.name == "bytes" and tokenizer.special_ids == {IM_START: 256, IM_END: 257}
    export(tuned, tmp_path / "out")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    asked = theirs.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)
    assert asked["input_ids"] == rendered(tokenizer, PROMPT)
    assert (
        json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 257
    )
    exported = export(tuned, tmp_path / "tuned.gguf")
    assert exported.modelfile == tmp_path / "tuned.Modelfile" and exported.modelfile.is_file()
    values = fields(tmp_path / "tuned.gguf")
    assert values["tokenizer.chat_template"] == JINJA
    assert values["tokenizer.ggml.eos_token_id"] == values["tokenizer.ggml.eot_token_id"] == 257
