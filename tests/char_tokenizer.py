"""A tokenizer for model-server tests without a model: one token per character."""

from __future__ import annotations


class CharTokenizer:
    """One token per character (its code point); no end-of-generation token."""

    eog_ids: frozenset[int] = frozenset()
    n_vocab = 0x110000
    eos_id = bos_id = -1
    add_bos = False
    chat_template = ""

    def encode(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return "".join(chr(t) for t in tokens).encode()

    def decode(self, tokens: list[int], *, special: bool = False) -> str:
        return "".join(chr(t) for t in tokens)

    def token_text(self, token: int) -> str:
        return chr(token)

    def apply_chat_template(self, messages: list[dict]) -> tuple[list[int], list[str]]:
        return self.encode("".join(m["content"] for m in messages)), []
