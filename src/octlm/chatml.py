"""ChatML, octlm's one chat template: how a conversation becomes token ids, and which of them a
fine-tune learns to predict.

A conversation is an optional system message, then user and assistant messages in turn. Each
message is written ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``; a prompt for a reply ends with
``<|im_start|>assistant\\n``. ``<|im_start|>`` and ``<|im_end|>`` are special tokens of the
run's tokenizer (:data:`CHAT_TOKENS`); everything else is text, encoded a segment at a time
between them (``ROLE\\nCONTENT`` whole, then ``\\n``), as transformers' ``apply_chat_template``
encodes the rendered template, so both give the same ids for text that spells no special token.

octlm's encoder reads text as text: a message that spells ``<|im_end|>`` gets the tokens of
those characters, never the control token, so no message can end its turn early or forge
another role's. (transformers' tokenizers and llama.cpp read such text as the control token:
docs/chat.md.)

Supervised: the tokens of an assistant's content and its ``<|im_end|>``, the targets a
fine-tune learns (with ``--loss all``, every token). A conversation too long for a row is cut
after its last whole assistant turn that fits (:func:`cut`).

The same template, in the template languages of transformers (:data:`JINJA`) and Ollama
(:data:`OLLAMA`), travels with the exports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TOKENS = (IM_START, IM_END)
ROLES = ("system", "user", "assistant")
GENERATION_PROMPT = "assistant\n"  # after <|im_start|>: where a reply begins

# transformers' chat_template (tokenizer_config.json) and GGUF's tokenizer.chat_template.
JINJA = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Ollama's TEMPLATE (a Go template over the same messages).
OLLAMA = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n"
)


class Message(NamedTuple):
    role: str  # one of ROLES
    content: str


class Rendered(NamedTuple):
    """A conversation's token ids, whether each is a supervised target, and where each message
    ends (an index into ``ids``, one past its closing ``\\n``)."""

    ids: list[int]
    supervised: list[bool]
    ends: list[int]


def messages_of(messages: Iterable[Mapping | Message], *, reply: bool = False) -> list[Message]:
    """``messages`` (mappings with ``role`` and ``content``, or :class:`Message` s) checked to
    be a conversation: an optional system message first, then user and assistant in turn,
    ending with the assistant's (``reply``: with the user's, the assistant to answer), no
    content empty. ``ValueError`` naming the first message that breaks the rule."""
    found = []
    for index, message in enumerate(messages):
        role, content = (
            message
            if isinstance(message, Message)
            else (message.get("role"), message.get("content"))
        )
        if role not in ROLES:
            raise ValueError(f"message {index}: role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {index}: content must be text, got {type(content).__name__}")
        found.append(Message(role, content))
    first = 1 if found and found[0].role == "system" else 0
    for index, message in enumerate(found[first:], first):
        expected = ("user", "assistant")[(index - first) % 2]
        if message.role != expected:
            raise ValueError(
                f"message {index}: expected a {expected} message (after an optional system "
                f"message, user and assistant take turns), got {message.role}"
            )
        if not message.content.strip() and message.role == "assistant":
            raise ValueError(f"message {index}: the assistant's answer is empty")
    last = "user" if reply else "assistant"
    if len(found) == first or found[-1].role != last:
        raise ValueError(f"a conversation must end with a {last} message")
    return found


def chat_ids(tokenizer) -> tuple[int, int]:
    """The ids of ``<|im_start|>`` and ``<|im_end|>`` in ``tokenizer``; ValueError when it
    lacks them (a tokenizer without chat tokens: ``octlm finetune`` adds them)."""
    special = getattr(tokenizer, "special_ids", {})
    missing = [token for token in CHAT_TOKENS if token not in special]
    if missing:
        raise ValueError(
            f"the tokenizer ({tokenizer.name} of {tokenizer.vocab_size}) has no chat tokens "
            f"({', '.join(missing)}): fine-tune the model on conversations (octlm finetune)"
        )
    return special[IM_START], special[IM_END]


def render(tokenizer, messages: list[Message], *, reply: bool = False) -> Rendered:
    """The ids of ``messages`` (checked by :func:`messages_of`) in ChatML, with ``reply`` the
    prompt for the assistant's next message (``<|im_start|>assistant\\n`` last)."""
    start, end = chat_ids(tokenizer)
    ids, supervised, ends = [], [], []
    newline = tokenizer.encode(b"\n")
    for message in messages:
        head = tokenizer.encode(f"{message.role}\n".encode())
        body = tokenizer.encode(
            f"{message.role}\n{message.content}".encode("utf-8", "surrogatepass")
        )
        learned = message.role == "assistant"
        # the body's tokens past those it shares with the header alone are the content's
        shared = next(
            (i for i, (a, b) in enumerate(zip(head, body, strict=False)) if a != b),
            min(len(head), len(body)),
        )
        ids += [start, *body, end, *newline]
        supervised += [False] * (1 + shared) + [learned] * (len(body) - shared + 1)
        supervised += [False] * len(newline)
        ends.append(len(ids))
    if reply:
        ids += [start, *tokenizer.encode(GENERATION_PROMPT.encode())]
        supervised += [False] * (len(ids) - len(supervised))
    return Rendered(ids, supervised, ends)


def cut(rendered: Rendered, messages: list[Message], limit: int) -> Rendered | None:
    """``rendered`` within ``limit`` tokens: whole, or its system message and first turns up to
    the last assistant message that fits; None when not even one answer fits."""
    if len(rendered.ids) <= limit:
        return rendered
    kept = [
        end
        for end, message in zip(rendered.ends, messages, strict=True)
        if message.role == "assistant" and end <= limit
    ]
    if not kept:
        return None
    size = kept[-1]
    return Rendered(
        rendered.ids[:size],
        rendered.supervised[:size],
        [end for end in rendered.ends if end <= size],
    )
