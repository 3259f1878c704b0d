"""Records -> conversations: the record shapes fine-tuning data comes in, each read into
ChatML's messages (:mod:`octlm.chatml`).

Formats (``--chat-format``), as TRL's ``SFTTrainer`` and the datasets people share spell them:

- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``; a content may also be a
  list of OpenAI-style parts, ``[{"type": "text", "text": ...}]``, joined by line breaks;
- ``sharegpt``: ``{"conversations": [{"from": ..., "value": ...}, ...]}``, ``from`` one of
  :data:`SPEAKERS`;
- ``prompt``: TRL's prompt-completion, ``{"prompt": ..., "completion": ...}``, each a text (the
  user's, the assistant's) or a list of messages (the prompt's, then the completion's);
- ``alpaca``: ``{"instruction": ..., "input": ..., "output": ...}`` and an optional ``system``;
  the user asks the instruction, then the input after a blank line where there is one;
- ``auto``: the first of these whose fields a record holds (not null), record by record.

A record without its format's fields, or whose messages are not a conversation by
:func:`chatml.messages_of`, is a ValueError saying what is wrong: the reader names the file and
the line or row.
"""

from __future__ import annotations

from collections.abc import Callable

from octlm.chatml import Message, messages_of

# Each format's fields: those a record must hold, and those it may.
FIELDS = {
    "messages": (("messages",), ()),
    "sharegpt": (("conversations",), ()),
    "prompt": (("prompt", "completion"), ()),
    "alpaca": (("instruction", "output"), ("input", "system")),
}
# ShareGPT's speakers (``from``) and the ChatML role each is.
SPEAKERS = {"human": "user", "gpt": "assistant", "system": "system"}
SPEAKERS |= {"user": "user", "assistant": "assistant"}


def conversation(record: object, chat_format: str) -> list[Message]:
    """The messages of one record in ``chat_format`` (a key of :data:`FIELDS`, or ``auto``:
    the first whose fields the record holds), checked to be a conversation; ValueError saying
    what is wrong with the record."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be an object of fields, got {type(record).__name__}")
    if chat_format == "auto":
        chat_format = _detected(record)
    needed, _ = FIELDS[chat_format]
    missing = [name for name in needed if record.get(name) is None]
    if missing:
        raise ValueError(
            f"no field {missing[0]!r} (it has {_names(record)}); a {chat_format} record holds "
            f"{', '.join(needed)}"
        )
    messages = READERS[chat_format](record)  # [{"role": ..., "content": ...}, ...]
    try:
        return messages_of(messages)
    except ValueError as error:
        raise ValueError(f"{error} (a {chat_format} record)") from None


def columns(names: list[str], chat_format: str) -> list[str]:
    """The columns of a table that its records in ``chat_format`` are read from: the format's
    fields among ``names``, or every column (for ``auto``, or where one the format needs is
    missing, so that the bad record names what a row holds)."""
    if chat_format == "auto":
        return list(names)
    needed, optional = FIELDS[chat_format]
    if not set(needed) <= set(names):
        return list(names)
    return [name for name in names if name in needed or name in optional]


def _detected(record: dict) -> str:
    for chat_format, (needed, _) in FIELDS.items():
        if all(record.get(name) is not None for name in needed):
            return chat_format
    expected = "; ".join(f"{name} ({', '.join(needed)})" for name, (needed, _) in FIELDS.items())
    raise ValueError(
        f"no chat format's fields (it has {_names(record)}); expected those of one of: {expected}"
    )


def _names(record: dict) -> str:
    """The fields of ``record`` that hold something, for an error."""
    return ", ".join(repr(name) for name, value in record.items() if value is not None) or "none"


def _messages(record: dict) -> list[dict]:
    return _listed(record["messages"], "messages")


def _sharegpt(record: dict) -> list[dict]:
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise ValueError(f"field 'conversations' holds {type(turns).__name__}, not a list of turns")
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(
                f"conversations[{index}] is {type(turn).__name__}, not a turn with from and value"
            )
        speaker = turn.get("from")
        if speaker not in SPEAKERS:
            raise ValueError(
                f"conversations[{index}]: 'from' must be one of {', '.join(SPEAKERS)}, "
                f"got {speaker!r}"
            )
        messages.append({"role": SPEAKERS[speaker], "content": turn.get("value")})
    return messages


def _prompt(record: dict) -> list[dict]:
    sides = (("prompt", "user"), ("completion", "assistant"))
    messages = []
    for name, role in sides:
        value = record[name]
        if isinstance(value, str):
            messages.append({"role": role, "content": value})
        elif isinstance(value, list):
            messages += _listed(value, name)
        else:
            raise ValueError(
                f"field {name!r} holds {type(value).__name__}, not text or a list of messages"
            )
    return messages


def _alpaca(record: dict) -> list[dict]:
    fields = {name: record.get(name) for name in ("system", "instruction", "input")}
    fields = {name: "" if value is None else value for name, value in fields.items()}
    for name, value in fields.items():
        if not isinstance(value, str):
            raise ValueError(f"field {name!r} holds {type(value).__name__}, not text")
    question = fields["instruction"] + (f"\n\n{fields['input']}" if fields["input"] else "")
    system = [{"role": "system", "content": fields["system"]}] if fields["system"] else []
    return [
        *system,
        {"role": "user", "content": question},
        {"role": "assistant", "content": record["output"]},
    ]


def _listed(messages: object, field: str) -> list[dict]:
    """The messages of a field that lists them, each content as text (OpenAI-style parts
    joined)."""
    if not isinstance(messages, list):
        raise ValueError(f"field {field!r} holds {type(messages).__name__}, not a list of messages")
    found = []
    for index, message in enumerate(messages):
        where = f"{field}[{index}]"
        if not isinstance(message, dict):
            raise ValueError(
                f"{where} is {type(message).__name__}, not a message with role and content"
            )
        found.append(
            {"role": message.get("role"), "content": _content(message.get("content"), where)}
        )
    return found


def _content(content: object, where: str) -> object:
    """A message's content: a text as it is (anything else but parts, for
    :func:`chatml.messages_of` to refuse), or the texts of a list of parts joined by line
    breaks."""
    if not isinstance(content, list):
        return content
    texts = []
    for index, part in enumerate(content):
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if not isinstance(text, str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"{where}: content part {index} is {kind!r}, not text "
                '({"type": "text", "text": ...})'
            )
        texts.append(text)
    return "\n".join(texts)


# Each format's reader: a record holding its fields -> its messages, as mappings.
READERS: dict[str, Callable[[dict], list[dict]]] = {
    "messages": _messages,
    "sharegpt": _sharegpt,
    "prompt": _prompt,
    "alpaca": _alpaca,
}
