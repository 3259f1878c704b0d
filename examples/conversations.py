"""Conversations whose answers follow from the question alone, to fine-tune a small model to
follow instructions and to measure whether it learned them (benchmarks/chat_exact.py).

    python examples/conversations.py OUT_DIR [--train N] [--test N] [--seed S]

writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl, one conversation a line:
``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}], "op": ..., ...}``. Each
operation has one short, fixed phrasing, so that a small model can learn the instruction:

    Copy: q w h z         -> q w h z
    Uppercase: q w h z    -> Q W H Z
    Reverse: q w h z      -> z h w q
    Length: q w h z       -> 4
    Count h in: q w h h z -> 2

The strings are random lowercase letters (3 to 8 of them), not words, so an answer cannot be
recalled, only computed. They are spelled a letter at a time, so that a byte-level BPE reads
each letter as a token of its own, as bytes do, and every operation works on tokens whatever
the model's tokenizer. Held-out questions use strings that occur in no training question: a
right answer there is the operation learned, not a conversation remembered. Each record also
names its last question's ``op``, ``string`` (and the ``letter`` counted), which the benchmark
counts by, and every question's in ``turns``, which a test checks the split with. Training
conversations hold one to three questions, some after a system message, as a conversation in
``octlm chat`` goes on; held-out ones hold one. The same seed writes the same files; the
defaults fit a fine-tune of about five minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path

LETTERS = string.ascii_lowercase
SHORTEST, LONGEST = 3, 8  # letters of a string

# op -> (question template, answer of the string)
STRING_OPS = {
    "copy": ("Copy: {}", lambda text: text),
    "upper": ("Uppercase: {}", str.upper),
    "reverse": ("Reverse: {}", lambda text: text[::-1]),
    "length": ("Length: {}", lambda text: str(len(text))),
}
OPS = (*STRING_OPS, "count")
TURNS = {1: 0.6, 2: 0.25, 3: 0.15}  # questions in a training conversation, and their shares
SYSTEMS = ("Answer exactly.", "You follow instructions.", "Be brief.")
SYSTEM_SHARE = 0.3  # training conversations that open with a system message


def random_string(draw: random.Random) -> str:
    return "".join(draw.choices(LETTERS, k=draw.randint(SHORTEST, LONGEST)))


def spelled(text: str) -> str:
    """``text`` a letter at a time: ``qwhz`` -> ``q w h z``."""
    return " ".join(text)


def turn(op: str, draw: random.Random, strings) -> tuple[list[dict], dict]:
    """One question of ``op`` and its answer (its string drawn by ``strings()``), and what it
    asked: its op, string and counted letter."""
    text = strings()
    asked = {"op": op, "string": text}
    if op == "count":
        # mostly a letter of the string, so that the answers are not mostly 0
        letter = draw.choice(text) if draw.random() < 0.75 else draw.choice(LETTERS)
        question, answer = f"Count {letter} in: {spelled(text)}", str(text.count(letter))
        asked["letter"] = letter
    else:
        template, compute = STRING_OPS[op]
        answer = compute(text)
        question = template.format(spelled(text))
        answer = answer if op == "length" else spelled(answer)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages, asked


def conversation(ops: list[str], draw: random.Random, strings, system: str | None = None) -> dict:
    """A conversation of one turn per op in ``ops``, after ``system`` where given. The record
    names every turn's op, string and letter (``turns``), and the last one's at its top level,
    the question a benchmark scores."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    turns = []
    for op in ops:
        said, asked = turn(op, draw, strings)
        messages += said
        turns.append(asked)
    return {"messages": messages, **turns[-1], "turns": turns}


def split(train: int, test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``train`` and ``test`` conversations, the operations in turn (shuffled in training),
    the held-out ones with strings that no training question has. A held-out conversation is
    one question; a training one is one to three (:data:`TURNS`), some after a system message
    (:data:`SYSTEMS`), so that a conversation that goes on, as ``octlm chat`` keeps one, is
    no stranger to the model."""
    for name, value in (("train", train), ("test", test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    draw = random.Random(seed)
    held_strings: set[str] = set()

    def held_out_string() -> str:
        text = random_string(draw)
        held_strings.add(text)
        return text

    def training_string() -> str:
        text = random_string(draw)
        while text in held_strings:  # drawn again: no held-out string is ever trained on
            text = random_string(draw)
        return text

    tested = [conversation([OPS[i % len(OPS)]], draw, held_out_string) for i in range(test)]
    ops = [OPS[i % len(OPS)] for i in range(train)]
    draw.shuffle(ops)
    trained = []
    for op in ops:
        count = draw.choices(list(TURNS), weights=list(TURNS.values()))[0]
        earlier = [draw.choice(OPS) for _ in range(count - 1)]
        system = draw.choice(SYSTEMS) if draw.random() < SYSTEM_SHARE else None
        trained.append(conversation([*earlier, op], draw, training_string, system))
    return trained, tested


def write(path: Path, conversations: list[dict]) -> None:
    with path.open("w") as out:
        for record in conversations:
            out.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="folder for the two files")
    parser.add_argument("--train", type=int, default=20_000, help="training conversations")
    parser.add_argument("--test", type=int, default=40, help="held-out conversations")
    parser.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0)")
    args = parser.parse_args(argv)
    trained, tested = split(args.train, args.test, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "train.jsonl", trained)
    write(args.out / "test.jsonl", tested)
    print(f"{len(trained)} training and {len(tested)} held-out conversations in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
