"""Conversations in records: each record shape (messages, ShareGPT, prompt-completion, Alpaca)
read into ChatML messages in every container, a bad record skipped with a problem naming its file
and line or row (or refused under strict), the split made by conversation."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest

from octlm.chatml import Message
from octlm.training import conversations, readers
from octlm.training.config import RunConfig
from octlm.training.corpus import Corpus, record_fraction
from octlm.training.formats import CHAT_FORMATS, DEFAULT_GLOB, Formats
from tests.training.test_readers import COMPRESSIONS, arrow_bytes, write_compressed

# Every container a conversation comes in; json-lines: a .json file of JSON Lines.
CONTAINERS = [
    *("jsonl", "ndjson", "json-array", "json-lines"),
    *("parquet", "arrow-stream", "arrow-file"),
]
SYSTEM, HI, HELLO = (
    Message("system", "Be brief."),
    Message("user", "Hi"),
    Message("assistant", "Hello!"),
)
SUM = [Message("user", "2+2?"), Message("assistant", "4"), Message("user", "3+3?")]
SUM += [Message("assistant", "6")]


def message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


# Each format: records of it (every row of the same types, as a table needs) and the
# conversations they hold, written out by hand.
CASES = {
    "messages": (
        [
            {"id": 0, "messages": [message(m.role, m.content) for m in (SYSTEM, HI, HELLO)]},
            {"id": 1, "messages": [message(m.role, m.content) for m in SUM]},
        ],
        [[SYSTEM, HI, HELLO], SUM],
    ),
    "sharegpt": (
        [
            {
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "Hello!"},
                ]
            },
            {
                "conversations": [
                    {"from": "user", "value": "2+2?"},
                    {"from": "assistant", "value": "4"},
                    {"from": "human", "value": "3+3?"},
                    {"from": "gpt", "value": "6"},
                ]
            },
        ],
        [[SYSTEM, HI, HELLO], SUM],
    ),
    "prompt": (
        [
            {
                "prompt": [message("system", "Be brief."), message("user", "Hi")],
                "completion": [message("assistant", "Hello!")],
            },
            {
                "prompt": [
                    message("user", "2+2?"),
                    message("assistant", "4"),
                    message("user", "3+3?"),
                ],
                "completion": [message("assistant", "6")],
            },
        ],
        [[SYSTEM, HI, HELLO], SUM],
    ),
    "alpaca": (
        [
            {"instruction": "Translate.", "input": "cat", "output": "chat", "system": "Be brief."},
            {"instruction": "Name a colour.", "input": "", "output": "Red.", "system": None},
        ],
        [
            [SYSTEM, Message("user", "Translate.\n\ncat"), Message("assistant", "chat")],
            [Message("user", "Name a colour."), Message("assistant", "Red.")],
        ],
    ),
}


def payload(records: list, container: str) -> bytes:
    """``records`` as the bytes of a file of ``container``."""
    if container in ("jsonl", "ndjson", "json-lines"):
        return b"".join(json.dumps(r).encode() + b"\n" for r in records)
    if container == "json-array":
        return json.dumps(records, indent=1).encode()
    pa = pytest.importorskip("pyarrow")
    table = pa.Table.from_pylist(records)
    if container == "parquet":
        import pyarrow.parquet as pq

        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=1)
        return sink.getvalue()
    return arrow_bytes(table, container.removeprefix("arrow-"))


def write(folder: Path, container: str, records: list, suffix: str = "", stem: str = "c") -> Path:
    """A file of ``records`` in ``container``, compressed by ``suffix``."""
    extension = {"json-array": "json", "json-lines": "json"}.get(container, container)
    extension = extension.partition("-")[0]  # arrow-stream, arrow-file: .arrow
    return write_compressed(folder / f"{stem}.{extension}{suffix}", payload(records, container))


def where(container: str, index: int) -> str:
    """How a problem names the record ``index`` of a file of ``container``."""
    if container == "json-array":
        return f"record {index}"
    return f"row {index}" if container.startswith(("parquet", "arrow")) else f"line {index + 1}"


def documents(path: Path, chat_format: str, strict: bool = False) -> list[readers.Document]:
    formats = Formats(chat_format=chat_format, strict=strict)
    return list(readers.read(path, Path(path.name), formats))


def messages(path: Path, chat_format: str) -> list[list[Message] | None]:
    return [d.messages for d in documents(path, chat_format)]


@pytest.mark.parametrize("suffix", ["", *COMPRESSIONS])
@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("chat_format", list(CASES))
def test_each_format_reads_into_its_messages_in_every_container(
    tmp_path, chat_format, container, suffix
):
    records, expected = CASES[chat_format]
    file = write(tmp_path, container, records, suffix)
    found = documents(file, chat_format)
    assert [d.messages for d in found] == expected
    assert [(d.index, d.problem, list(d.text)) for d in found] == [(0, None, []), (1, None, [])]


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("chat_format", list(CASES))
def test_auto_detects_each_format_in_every_container(tmp_path, chat_format, container):
    records, expected = CASES[chat_format]
    assert messages(write(tmp_path, container, records), "auto") == expected


def test_auto_detects_each_record_by_its_own_fields(tmp_path):
    """Records of every format in one file, each read as its own; a record with the fields of
    two formats reads as the first of CHAT_FORMATS, and a null field counts as absent."""
    records = [record for records, _ in CASES.values() for record in records]
    expected = [conversation for _, found in CASES.values() for conversation in found]
    both = {**CASES["sharegpt"][0][1], "messages": CASES["messages"][0][0]["messages"]}
    null = {**CASES["sharegpt"][0][1], "messages": None}
    file = write(tmp_path, "jsonl", [*records, both, null])
    assert messages(file, "auto") == [*expected, [SYSTEM, HI, HELLO], SUM]


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"prompt": "Hi", "completion": "Hello!"}, [HI, HELLO]),
        (
            {
                "prompt": [message("system", "Be brief."), message("user", "Hi")],
                "completion": "Hello!",
            },
            [SYSTEM, HI, HELLO],
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "Hello"},
                            {"type": "text", "text": "!"},
                        ],
                    },
                ]
            },
            [HI, Message("assistant", "Hello\n!")],
        ),
        ({"instruction": "Hi", "output": "Hello!"}, [HI, HELLO]),
    ],
)
def test_texts_parts_and_optional_fields_read_as_written(record, expected):
    """A prompt and completion given as text are the user's and the assistant's; OpenAI-style
    text parts are joined by line breaks; Alpaca's input and system may be left out."""
    assert conversations.conversation(record, "auto") == expected


@pytest.mark.parametrize("container", CONTAINERS)
def test_a_forced_format_that_does_not_match_is_a_bad_record(tmp_path, container):
    records, _ = CASES["sharegpt"]
    file = write(tmp_path, container, records)
    found = documents(file, "messages")
    assert [d.messages for d in found] == [None, None]
    assert found[1].problem == (
        f"{file.name}: {where(container, 1)}: no field 'messages' (it has 'conversations'); a "
        "messages record holds messages"
    )


GOOD = CASES["messages"][0][0]
BAD = [  # a record, and what its problem says is wrong
    (
        {"messages": [message("user", "a"), message("user", "b"), message("assistant", "c")]},
        "message 1: expected a assistant message (after an optional system message, user and "
        "assistant take turns), got user (a messages record)",
    ),
    (
        {"messages": [message("user", "a"), message("assistant", " \n")]},
        "message 1: the assistant's answer is empty (a messages record)",
    ),
    (
        {"instruction": "a", "input": "b"},
        "no chat format's fields (it has 'instruction', 'input'); expected those of one of: "
        "messages (messages); sharegpt (conversations); prompt (prompt, completion); alpaca "
        "(instruction, output)",
    ),
    (
        {"messages": [message("user", "a"), message("assistant", "b"), message("user", "c")]},
        "a conversation must end with a assistant message (a messages record)",
    ),
    (
        {"messages": [message("user", "a"), message("tool", "b")]},
        "message 1: role must be one of ('system', 'user', 'assistant'), got 'tool' (a messages "
        "record)",
    ),
    (
        {"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]},
        "conversations[1]: 'from' must be one of human, gpt, system, user, assistant, got 'bot'",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        'messages[0]: content part 0 is \'image_url\', not text ({"type": "text", "text": ...})',
    ),
    (
        {"messages": [message("user", "a"), {"role": "assistant", "content": 3}]},
        "message 1: content must be text, got int (a messages record)",
    ),
    (["user", "a"], "a record must be an object of fields, got list"),
]


@pytest.mark.parametrize(("record", "problem"), BAD)
@pytest.mark.parametrize("container", ["jsonl", "json-array"])
def test_a_bad_record_is_skipped_with_its_file_line_and_what_is_wrong(
    tmp_path, container, record, problem
):
    file = write(tmp_path, container, [GOOD, record, GOOD])
    found = documents(file, "auto")
    assert [(d.index, d.messages is None, d.problem) for d in found] == [
        (0, False, None),
        (1, True, f"{file.name}: {where(container, 1)}: {problem}"),
        (2, False, None),
    ]
    assert [list(d.text) for d in found] == [[], [], []]


@pytest.mark.parametrize("container", ["parquet", "arrow-stream", "arrow-file"])
def test_a_bad_row_of_a_table_names_its_row(tmp_path, container):
    """Rows of one schema, some of them no conversation; the columns a row holds are named."""
    rows = [GOOD, *(r for r, _ in BAD[:2]), GOOD, BAD[3][0], BAD[4][0]]
    file = write(tmp_path, container, [{"id": i, **row} for i, row in enumerate(rows)])
    found = documents(file, "messages")
    problems = {d.index: d.problem for d in found if d.problem}
    assert problems == {
        row: f"{file.name}: row {row}: {BAD[case][1]}"
        for row, case in ((1, 0), (2, 1), (4, 3), (5, 4))
    }
    assert [d.messages for d in found if not d.problem] == [[SYSTEM, HI, HELLO]] * 2


def test_a_table_without_the_format_s_column_names_the_columns_its_rows_have(tmp_path):
    records, _ = CASES["alpaca"]
    file = write(tmp_path, "parquet", records)
    assert documents(file, "prompt")[0].problem == (
        "c.parquet: row 0: no field 'prompt' (it has 'instruction', 'input', 'output', "
        "'system'); a prompt record holds prompt, completion"
    )


@pytest.mark.parametrize("container", ["jsonl", "json-array", "parquet", "arrow-file"])
def test_strict_refuses_a_bad_record_saying_how_to_skip_it(tmp_path, container):
    rows = [GOOD, BAD[1][0]]
    file = write(tmp_path, container, rows)
    assert documents(file, "auto", strict=False)[1].problem
    with pytest.raises(ValueError) as raised:
        documents(file, "auto", strict=True)
    assert str(raised.value) == (
        f"{file.name}: {where(container, 1)}: {BAD[1][1]}; without --strict such records are "
        "skipped"
    )


def test_a_line_that_is_not_json_is_an_error_not_a_bad_record(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"^c.jsonl: line 2 is not JSON"):
        documents(tmp_path / "c.jsonl", "auto")


@pytest.mark.parametrize("name", ["notes.txt", "notes.md.gz"])
def test_a_text_file_under_a_chat_format_is_refused_naming_it(tmp_path, name):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write(folder, "jsonl", CASES["messages"][0])
    write_compressed(folder / name, b"User: hi\nAssistant: hello\n")
    corpus = Corpus.open(folder, DEFAULT_GLOB, 0.1, Formats(chat_format="auto"))
    with pytest.raises(ValueError, match=rf"^{name}: a text file holds no conversations"):
        list(corpus.parts())


def many_conversations(count: int) -> tuple[list[dict], list[list[Message]]]:
    expected = [
        [Message("user", f"question {i}"), Message("assistant", f"answer {i}")] * (1 + i % 3)
        for i in range(count)
    ]
    records = [{"messages": [message(*m) for m in found]} for found in expected]
    return records, expected


@pytest.mark.parametrize("container", ["jsonl", "parquet"])
def test_the_split_holds_out_whole_conversations_by_their_hash(tmp_path, container):
    """Each conversation is one part, all its messages in one split, which a hash of (its file,
    its record) chooses; a bad record keeps its place in the count."""
    records, expected = many_conversations(200)
    records[7] = BAD[0][0]
    folder = tmp_path / "corpus"
    folder.mkdir()
    file = write(folder, container, records)
    corpus = Corpus.open(folder, DEFAULT_GLOB, 0.2, Formats(chat_format="messages"))
    parts = list(corpus.parts())
    assert [p.messages for p in parts] == [*expected[:7], None, *expected[8:]]
    held = [record_fraction(Path(file.name), i) < 0.2 for i in range(200)]
    assert [p.split for p in parts] == ["val" if h else "train" for h in held]
    assert 20 < sum(held) < 60 and all(p.ends for p in parts)
    assert parts[7].problem.startswith(f"{file.name}: {where(container, 7)}: message 1: ")


def test_a_bpe_learns_from_the_training_conversations_contents_a_line_apart(tmp_path):
    records, expected = many_conversations(50)
    records[3] = BAD[1][0]
    file = write(tmp_path, "jsonl", records)
    corpus = Corpus.open(file, "*", 0.2, Formats(chat_format="auto"))
    train = [
        "\n".join(m.content for m in found).encode()
        for index, found in enumerate(expected)
        if index != 3 and record_fraction(Path("c.jsonl"), index) >= 0.2
    ]
    assert list(corpus.training_texts(sample=None)) == train


def test_the_options_of_a_chat_corpus_name_its_format_and_a_plain_one_s_are_unchanged(tmp_path):
    file = write(tmp_path, "jsonl", CASES["messages"][0])
    assert Corpus.open(file, "*", 0.1).options == {"text_field": "text", "separator": None}
    chat = Corpus.open(file, "*", 0.1, Formats(chat_format="sharegpt", strict=True))
    assert chat.options == {
        "text_field": "text",
        "separator": None,
        "chat_format": "sharegpt",
        "strict": True,
    }


def test_a_run_s_chat_format_and_strict_reach_the_corpus(tmp_path):
    file = write(tmp_path, "jsonl", CASES["messages"][0])
    run = RunConfig(data=str(file))
    assert Corpus.of(run).formats == Formats()
    run = replace(run, chat=True, chat_format="alpaca", strict=True)
    assert Corpus.of(run).formats == Formats(chat_format="alpaca", strict=True)
    run = replace(run, chat=False)  # a chat format is read only by a --chat run
    assert Corpus.of(run).formats == Formats(strict=True)


def test_a_chat_format_is_one_the_readers_know():
    assert tuple(conversations.FIELDS) == CHAT_FORMATS[1:]
    with pytest.raises(
        ValueError, match=r"chat_format must be one of auto, messages, .* got 'chatml'"
    ):
        Formats(chat_format="chatml")
    with pytest.raises(ValueError, match=r"strict must be True or False, got 'yes'"):
        Formats(strict="yes")
