"""A tokenizer for model-server tests without a model: one token per character."""

from __future__ import annotations


class CharTokenizer:
    """One token per character (its code point); no end-of-generation token."""

    eog_ids: frozenset[int] = frozenset()

    def encode(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return "".join(chr(t) for t in tokens).encode()

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(t) for t in tokens)

    def apply_chat_template(self, messages: list[dict]) -> tuple[list[int], list[str]]:
        return self.encode("".join(m["content"] for m in messages)), []
