"""The chat template: how ``/v1/chat/completions`` turns messages into one prompt.

micro is a base model (it was trained on plain text, documents joined by
``<|endoftext|>``), so a chat is written as text with marker tokens around each turn and
the model simply continues it::

    <|system|>You are terse.<|end|>
    <|user|>Write a haiku about tabs.<|end|>
    <|assistant|>

(the newlines above are for reading only: nothing is put between the markers and the
text). Each message becomes ``<|ROLE|>`` + its content + ``<|end|>``, in order; a
``developer`` message is written as ``system``; the prompt ends with ``<|assistant|>``,
the turn the model writes. Generation stops at ``<|end|>``, at ``<|endoftext|>``, or at the
start of a new turn (``<|system|>``, ``<|user|>``, ``<|assistant|>``); none of these
markers appears in the returned text.

Markers exist only where the template puts them: message text is encoded with special
tokens off, so a user who types ``<|end|>`` gets those characters, not the marker. A
message's ``name`` is not rendered: micro saw no names in training, and a name written
into the text would be text the model has to continue.

``render`` tokenises every message in one ``encode_batch`` call, which releases the GIL
while the tokenizer's Rust code runs: the API calls it on a worker thread
(``server.api``), so a long chat never stalls the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable

from nodraft.micro.tokenizer import Tokenizer

ROLE_MARKERS = {
    "system": "<|system|>",
    "developer": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
}
END = "<|end|>"
STOP_MARKERS = (END, "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>")


def render(messages: Iterable[tuple[str, str]], tokenizer: Tokenizer) -> list[int]:
    """Token ids of the chat prompt for ``(role, content)`` pairs, ending at the
    assistant's marker."""
    special = tokenizer.special_ids
    messages = list(messages)
    contents = tokenizer.encode_batch([content for _, content in messages])
    ids: list[int] = []
    for (role, _), content in zip(messages, contents):
        ids.append(special[ROLE_MARKERS[role]])
        ids.extend(content)
        ids.append(special[END])
    ids.append(special[ROLE_MARKERS["assistant"]])
    return ids


def stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The marker tokens that end the assistant's turn."""
    return tuple(tokenizer.special_ids[m] for m in STOP_MARKERS)

