"""Byte-level BPE over the train split (vocabulary 4096), with end-of-text and chat markers.

Byte-level means every Unicode string round-trips exactly: text -> UTF-8 bytes -> one
symbol per byte -> merges; decoding reverses it. Special tokens are only produced for
text we build ourselves (the chat template, document separators): user text is encoded
with ``encode_special_tokens`` on, so a literal ``<|endoftext|>`` typed by a user stays
ordinary text and cannot end a generation early.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 4096
EOT = "<|endoftext|>"
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (EOT, *CHAT_MARKERS)


class Tokenizer:
    """A thin wrapper: ids in, ids out, exact round trip, special ids by name."""

    def __init__(self, hf: HFTokenizer):
        self.hf = hf
        self.vocab_size = hf.get_vocab_size()
        self.eot_id = hf.token_to_id(EOT)
        self.special_ids = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS}

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)))

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings count only if ``allow_special``."""
        self.hf.encode_special_tokens = not allow_special
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.hf.encode_special_tokens = True
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The exact bytes of ``ids`` (a streamed token may end inside a UTF-8 character)."""
        out = bytearray()
        for i in ids:
            out += self.token_bytes(i)
        return bytes(out)

    def token_bytes(self, token_id: int) -> bytes:
        cache = getattr(self, "_bytes", None)
        if cache is None:
            byte_of = {c: b for b, c in _bytes_to_unicode().items()}
            specials = set(self.special_ids.values())
            cache = self._bytes = [
                self.hf.id_to_token(i).encode() if i in specials
                else bytes(byte_of[c] for c in self.hf.id_to_token(i))
                for i in range(self.vocab_size)
            ]
        return cache[token_id]

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which ByteLevel uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)
