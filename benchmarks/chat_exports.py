"""The same greedy replies where a chat run lands: octlm's own (:func:`octlm.chat.reply`)
against the transformers export's (``apply_chat_template`` and ``generate``, float32) and,
where ``llama_cpp`` is installed, the GGUF export's in llama.cpp (``create_chat_completion``,
temperature 0), question by question.

    .venv/bin/python benchmarks/chat_exports.py RUN --questions DIR/test.jsonl --out DIR
        [--record runs/checks/chat-exports.jsonl]

Exports the run's best checkpoint to ``OUT/hf`` and ``OUT/chat.gguf`` (float32), replies to the
user message of each held-out conversation, and appends one record with the counts of equal
replies (and the first differences).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import octlm
from octlm import records
from octlm.chat import reply
from octlm.export import export

TOKENS = 32  # new tokens at most: every held-out answer is shorter


def transformers_reply(model, tokenizer, messages: list[dict]) -> str:
    """transformers' greedy reply: the chat template's prompt, ``generate`` up to the end of
    turn, decoded without the special tokens."""
    asked = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        drawn = model.generate(**asked, max_new_tokens=TOKENS, do_sample=False)
    new = drawn[0, asked["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a chat run folder")
    parser.add_argument("--questions", type=Path, required=True, help="conversations (.jsonl)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the two exports")
    parser.add_argument(
        "--record",
        type=Path,
        default=Path("runs/checks/chat-exports.jsonl"),
        help="records file to append to (default %(default)s)",
    )
    args = parser.parse_args(argv)
    records.check_writable(args.record, "--record")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer, step = octlm.load_run(args.run)
    hf_folder, gguf_file = args.out / "hf", args.out / "chat.gguf"
    export(args.run, hf_folder, dtype="float32")
    export(args.run, gguf_file)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_folder)
    try:
        from llama_cpp import Llama

        llm = Llama(str(gguf_file), n_ctx=model.config.max_length, verbose=False)
    except ImportError:
        llm = None
    lines = args.questions.read_text().splitlines()
    asked = [json.loads(line)["messages"][:-1] for line in lines if line.strip()]
    equal = {"transformers": 0, "llama.cpp": 0}
    differences = []
    for messages in asked:
        ours = reply(model, tokenizer, messages, max_new_tokens=TOKENS).text
        theirs = {"transformers": transformers_reply(hf_model, hf_tokenizer, messages)}
        if llm is not None:
            llm.reset()
            completion = llm.create_chat_completion(messages, temperature=0, max_tokens=TOKENS)
            theirs["llama.cpp"] = completion["choices"][0]["message"]["content"]
        for where, text in theirs.items():
            equal[where] += text == ours
            if text != ours and len(differences) < 5:
                differences.append({"where": where, "octlm": ours, "theirs": text})
    if llm is None:
        del equal["llama.cpp"]
    for where, count in equal.items():
        print(f"{where}: {count}/{len(asked)} greedy replies equal to octlm chat's")
    record = records.make("check", "chat-exports", folder=str(args.run), step=step)
    record |= {"questions": str(args.questions), "conversations": len(asked), "equal": equal}
    record["differences"] = differences
    records.append(args.record, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
