"""Exact answers of a chat model on held-out conversations: each one's greedy reply against the
answer it should give, counted overall and per operation, with the bits per byte of the answers.

    .venv/bin/python benchmarks/chat_exact.py RUN --questions DIR/test.jsonl [--step S]
        [--record runs/checks/chat-exact.jsonl] [--label TEXT]

A conversation is a JSON line ``{"messages": [...], "op": ...}`` that ends with the assistant's
answer (examples/conversations.py writes them; ``op`` is optional). The model replies
(:func:`octlm.chat.reply`, temperature 0) to the messages before the answer; the reply counts
when it is the answer exactly and the model then ends its turn (or its text). The bits per byte
are the model's summed loss, in bits, on the supervised tokens of the whole conversation in
ChatML (each assistant message and its ``<|im_end|>``), over the UTF-8 bytes of the assistant
messages: ``<|im_end|>`` is in the loss and stands for no byte. :func:`score` does the same for
a model and tokenizer in hand. A run without chat tokens (a base) is scored as its fine-tune
starts: the chat tokens added, their rows the mean of the others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

import octlm
from octlm import chatml, records
from octlm.chat import TEXT_ENDED, TURN_ENDED, reply
from octlm.tokenizer import with_chat_tokens
from octlm.training.base import grown
from octlm.training.folder import BEST, choose

SHOWN_MISSES = 5  # wrong replies printed under the table


def score(model, tokenizer, conversations: Iterable[Mapping]) -> dict:
    """Exact replies and bits per byte of ``conversations`` (mappings with ``messages``, ending
    with the assistant's answer, and optionally ``op``): ``conversations``, ``exact``,
    ``by_op`` (op -> those two counts), ``bits_per_byte``, ``answer_bytes`` and ``misses``
    (question, expected, reply, why it stopped)."""
    found = {"conversations": 0, "exact": 0, "by_op": {}, "misses": []}
    bits, answer_bytes = 0.0, 0
    for index, conversation in enumerate(conversations):
        messages = chatml.messages_of(conversation["messages"])
        expected = messages[-1].content
        # A token stands for at least a byte: a reply one token longer than the answer's bytes
        # cannot be it, and the token after the answer shows whether the model ends its turn.
        got = reply(model, tokenizer, messages[:-1], max_new_tokens=len(expected.encode()) + 1)
        right = got.text == expected and got.stopped in (TURN_ENDED, TEXT_ENDED)
        op = conversation.get("op")
        counts = found["by_op"].setdefault(op, {"conversations": 0, "exact": 0})
        for tally in (found, counts):
            tally["conversations"] += 1
            tally["exact"] += right
        if not right:
            question = messages[-2].content
            found["misses"].append(
                {
                    "question": question,
                    "expected": expected,
                    "reply": got.text,
                    "stopped": got.stopped,
                }
            )
        bits += answer_bits(model, tokenizer, messages, index)
        answer_bytes += sum(len(m.content.encode()) for m in messages if m.role == "assistant")
    found["bits_per_byte"] = bits / answer_bytes if answer_bytes else None
    found["answer_bytes"] = answer_bytes
    return found


def answer_bits(model, tokenizer, messages: list[chatml.Message], index: int) -> float:
    """The model's summed loss in bits on the supervised tokens of ``messages`` in ChatML."""
    rendered = chatml.render(tokenizer, messages)
    last = max(i for i, learned in enumerate(rendered.supervised) if learned) + 1
    if last - 1 > model.config.max_length:
        raise ValueError(
            f"conversation {index} takes {last} tokens up to its last answer, more than the "
            f"model's max_length={model.config.max_length} + 1"
        )
    device = next(model.parameters()).device
    ids = torch.tensor(rendered.ids[:last], device=device)  # (N,)
    learned = torch.tensor(rendered.supervised[1:last], device=device)  # (N - 1,)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(ids[None, :-1])[0]  # (N - 1, V)
    finally:
        model.train(was_training)
    losses = F.cross_entropy(logits.double(), ids[1:], reduction="none")  # (N - 1,)
    return float(losses[learned].sum()) / math.log(2)


def table(found: dict) -> str:
    """Exact replies per operation and overall, bits per byte, and the first misses."""
    lines = [f"{'op':10} {'exact':>9}"]
    for op, counts in sorted(found["by_op"].items(), key=lambda item: str(item[0])):
        lines.append(f"{op or '-':10} {counts['exact']:>4}/{counts['conversations']:<4}")
    share = found["exact"] / found["conversations"] if found["conversations"] else 0.0
    bits = "-" if found["bits_per_byte"] is None else f"{found['bits_per_byte']:.3f}"
    lines.append(
        f"{'all':10} {found['exact']:>4}/{found['conversations']:<4} ({100 * share:.1f}%), "
        f"{bits} bits per answer byte"
    )
    for miss in found["misses"][:SHOWN_MISSES]:
        lines.append(
            f"  {miss['question']!r}: expected {miss['expected']!r}, got {miss['reply']!r} "
            f"({miss['stopped']})"
        )
    return "\n".join(lines)


def as_fine_tune_starts(model, tokenizer):
    """A base model and tokenizer as ``octlm finetune`` starts from them: the chat tokens added
    to the tokenizer, their embedding rows the mean of the others (octlm.training.base)."""
    chat = with_chat_tokens(tokenizer)
    config = replace(model.config, vocab_size=chat.vocab_size)
    grown_state = grown(model.state_dict(), tokenizer.vocab_size, chat.vocab_size)
    started = octlm.OctLM(config)
    started.load_state_dict(grown_state | {"_extra_state": started.get_extra_state()})
    return started.eval(), chat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, metavar="RUN", help="a run folder with chat tokens")
    parser.add_argument(
        "--questions", type=Path, required=True, help="held-out conversations (.jsonl)"
    )
    parser.add_argument(
        "--step",
        type=lambda text: int(text) if text.isdigit() else text,
        default=BEST,
        help="the run's checkpoint: best, last or a step (default %(default)s)",
    )
    parser.add_argument(
        "--record",
        type=Path,
        default=Path("runs/checks/chat-exact.jsonl"),
        help="records file to append to (default %(default)s)",
    )
    parser.add_argument("--label", help="a note kept in the record, say what was trained")
    args = parser.parse_args(argv)
    records.check_writable(args.record, "--record")
    with args.questions.open() as lines:
        conversations = [json.loads(line) for line in lines if line.strip()]
    chosen = choose(args.run, args.step)
    model, tokenizer, step = octlm.load_run(args.run, step=chosen.step)
    added = "<|im_start|>" not in tokenizer.special_ids
    if added:  # a base: scored as its fine-tune starts, the chat tokens added
        model, tokenizer = as_fine_tune_starts(model, tokenizer)
    started = time.perf_counter()
    found = score(model, tokenizer, conversations)
    seconds = time.perf_counter() - started
    before = ", as a fine-tune starts from it (chat tokens added)" * added
    print(f"{args.run}, checkpoint of step {step} ({chosen.how}){before}, {args.questions}")
    print(table(found))
    record = records.make("check", "chat-exact", label=args.label, folder=str(args.run))
    record |= {"step": step, "checkpoint": chosen.how, "tokenizer": tokenizer.name}
    record["chat_tokens_added"] = added
    record |= {"questions": str(args.questions), "seconds": seconds, **found}
    record["misses"] = found["misses"][:SHOWN_MISSES]
    records.append(args.record, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
