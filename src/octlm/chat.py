"""A model's side of a conversation: its reply to the messages so far, rendered in ChatML
(:mod:`octlm.chatml`), decoded with the KV cache and streamed as text.

:func:`reply` answers once; :func:`fitted` trims a conversation to the model's context, oldest
turns first; :class:`Chat` keeps a conversation's history for ``octlm chat``.

A reply ends where the model ends its turn (``<|im_end|>``) or its text (the tokenizer's end of
text), neither of them in the reply, or where ``max_new_tokens`` or the model's ``max_length``
cut it: the prompt and the reply share the ``max_length`` positions a fine-tune's rows have.
Draws are :func:`octlm.model.sample`'s, as in :meth:`OctLM.generate`: temperature 0 is the
argmax, any other temperature a draw from a ``torch.Generator`` seeded with ``seed``.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch

from octlm import chatml
from octlm.chatml import Message
from octlm.model import KVCache, OctLM, is_int_at_least, sample

TURN_ENDED = "end of turn"  # the model wrote <|im_end|>
TEXT_ENDED = "end of text"  # the model wrote the tokenizer's end of text
MAX_NEW_TOKENS = "max_new_tokens"  # cut after max_new_tokens
CONTEXT = "context"  # cut at the model's max_length
STOPS = (TURN_ENDED, TEXT_ENDED, MAX_NEW_TOKENS, CONTEXT)


class Reply(NamedTuple):
    text: str  # the reply's UTF-8 (bad bytes replaced)
    ids: list[int]  # its tokens, without the one that ended it
    stopped: str  # why it ended: one of STOPS


def prompt(tokenizer, messages: Iterable[Mapping | Message]) -> list[int]:
    """The ids a reply to ``messages`` continues: the conversation (ending with a user message)
    in ChatML, then ``<|im_start|>assistant\\n``."""
    return chatml.render(tokenizer, _asking(messages), reply=True).ids


def reply(
    model: OctLM,
    tokenizer,
    messages: Iterable[Mapping | Message],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    on_text: Callable[[str], object] | None = None,
) -> Reply:
    """The model's reply to ``messages`` (an optional system message, then user and assistant
    in turn, ending with the user's), at most ``max_new_tokens`` tokens.

    ``on_text(piece)`` receives the text as it is decoded: a token's bytes once they complete
    UTF-8 characters, the bytes of a character split across tokens held back until its last;
    the pieces join to the reply's text. ``ValueError`` when the prompt leaves no position for
    a reply (trim it with :func:`fitted`), or when the tokenizer is not the model's or has no
    chat tokens. The model decodes in eval mode and is put back in its own mode after.
    """
    _check_model(model, tokenizer)
    _check_drawing(max_new_tokens, temperature, top_k, seed)
    if on_text is not None and not callable(on_text):
        raise TypeError(f"on_text must be None or callable, got {type(on_text).__name__}")
    _, im_end = chatml.chat_ids(tokenizer)
    ids = prompt(tokenizer, messages)
    max_length = model.config.max_length
    room = max_length - len(ids)  # the prompt and the reply share the max_length positions
    if room < 1:
        raise ValueError(
            f"the conversation's prompt takes {len(ids)} tokens, which leaves no room for a "
            f"reply within the model's max_length={max_length}: trim it with octlm.chat.fitted"
        )
    budget = min(max_new_tokens, room)
    device = next(model.parameters()).device
    cache = KVCache(model.config, capacity=len(ids) + budget)
    generator = torch.Generator(device=device).manual_seed(seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device), cache=cache)[:, -1]  # (1, V)
            while True:
                token = int(sample(logits, temperature, top_k, generator))
                if token == im_end:
                    stopped = TURN_ENDED
                    break
                if token == tokenizer.end_token:
                    stopped = TEXT_ENDED
                    break
                new.append(token)
                piece = decoder.decode(tokenizer.decode([token]))
                if piece and on_text is not None:
                    on_text(piece)
                if len(new) == budget:
                    stopped = MAX_NEW_TOKENS if budget == max_new_tokens else CONTEXT
                    break
                logits = model(torch.tensor([[token]], device=device), cache=cache)[:, -1]
    finally:
        model.train(was_training)
    tail = decoder.decode(b"", final=True)  # a character the reply left unfinished
    if tail and on_text is not None:
        on_text(tail)
    return Reply(tokenizer.decode(new).decode("utf-8", errors="replace"), new, stopped)


def fitted(
    tokenizer, messages: Iterable[Mapping | Message], max_length: int, room: int
) -> list[Message]:
    """``messages`` (ending with a user message) with their oldest user and assistant turns
    dropped until the prompt of a reply to them plus ``room`` new tokens fits ``max_length``
    positions. The system message and the last user message are always kept; ``ValueError``
    when they alone do not fit."""
    if not is_int_at_least(max_length, 1):
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if not is_int_at_least(room, 0):
        raise ValueError(f"room must be an int >= 0, got {room!r}")
    found = _asking(messages)
    rendered = chatml.render(tokenizer, found, reply=True)
    # Each message's ids depend on that message alone, so dropping messages takes out their ids
    # and leaves the others' as they were.
    starts = [0, *rendered.ends]  # where each message's ids begin
    first = 1 if found[0].role == "system" else 0
    for kept in range(first, len(found), 2):  # the first turn kept, after the system message
        if len(rendered.ids) - (starts[kept] - starts[first]) + room <= max_length:
            return found[:first] + found[kept:]
    least = len(rendered.ids) - (starts[-2] - starts[first])
    kept = (
        "the system message and the last user message take"
        if first
        else "the last user message takes"
    )
    raise ValueError(
        f"{kept} {least} tokens of prompt, and with room for {room} new tokens that is "
        f"more than max_length={max_length}: shorten them or leave less room"
    )


class Chat:
    """A conversation with a model: an optional system message, the turns so far, and the
    model's replies (:func:`reply`, drawn with the arguments it is given here).

    Before each reply the history is trimmed (:func:`fitted`) to leave the reply
    ``max_new_tokens`` positions, or half the model's ``max_length`` where that is fewer, so
    that room for a long reply does not push out every turn before it. A turn whose reply is
    empty (or only whitespace) is not kept: ChatML holds no empty answer.
    """

    def __init__(
        self,
        model: OctLM,
        tokenizer,
        system: str | None = None,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
    ):
        _check_model(model, tokenizer)
        chatml.chat_ids(tokenizer)  # a tokenizer without chat tokens is refused here, not later
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be None or text, got {type(system).__name__}")
        _check_drawing(max_new_tokens, temperature, top_k, seed)
        self.model, self.tokenizer = model, tokenizer
        self.drawing = dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
        )
        self.room = min(max_new_tokens, max(model.config.max_length // 2, 1))
        self.system = [] if system is None else [Message("system", system)]
        self.turns: list[Message] = []

    def say(self, text: str, on_text: Callable[[str], object] | None = None) -> Reply:
        """The model's reply to the user's ``text``, after the turns so far."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        asked = [*self.system, *self.turns, Message("user", text)]
        asked = fitted(self.tokenizer, asked, self.model.config.max_length, self.room)
        answer = reply(self.model, self.tokenizer, asked, **self.drawing, on_text=on_text)
        if answer.text.strip():
            self.turns = [*asked[len(self.system) :], Message("assistant", answer.text)]
        return answer

    def reset(self) -> None:
        """Forget the turns; the system message stays."""
        self.turns = []


def _asking(messages: Iterable[Mapping | Message]) -> list[Message]:
    """``messages`` checked to be a conversation that asks for a reply."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Iterable):
        raise TypeError(
            "messages must be a sequence of messages (mappings with role and content), got "
            f"{type(messages).__name__}"
        )
    return chatml.messages_of(messages, reply=True)


def _check_model(model: OctLM, tokenizer) -> None:
    if not isinstance(model, OctLM):
        raise TypeError(f"model must be an OctLM, got {type(model).__name__}")
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} tokens and the model "
            f"{model.config.vocab_size}: use the tokenizer of the model's run (octlm.load_run)"
        )


def _check_drawing(max_new_tokens: int, temperature: float, top_k: int | None, seed: int) -> None:
    if not is_int_at_least(max_new_tokens, 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be >= 0 and finite (0 is greedy), got {temperature!r}")
    if top_k is not None and not is_int_at_least(top_k, 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
