"""Tokenizer and chat template of a model, without loading its weights.

Stage 0 needs text <-> tokens and the model's chat template; it reads them from the
source GGUF with a vocab-only llama.cpp model (milliseconds, a few MB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import llama_cpp
from llama_cpp import llama_chat_format

from .errors import ModelLoadError
from .llama_log import install_log_bridge

# Used when a GGUF carries no chat template (ChatML is what small instruct models expect).
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class FimTokens:
    """A model's fill-in-the-middle tokens as llama.cpp reads them (the GGUF's
    ``tokenizer.ggml.fim_*_token_id`` keys, the older ``prefix/suffix/middle_token_id``,
    or llama.cpp's recognition of well-known token texts); -1 where absent."""

    pre: int
    suf: int
    mid: int
    rep: int = -1
    sep: int = -1

    @property
    def usable(self) -> bool:
        return min(self.pre, self.suf, self.mid) >= 0


class Tokenizer:
    def __init__(self, path: Path) -> None:
        install_log_bridge()
        try:
            self._llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read the tokenizer of {path}: {exc}") from None
        meta = self._llm.metadata
        self.eos_id = int(self._llm.token_eos())
        self.bos_id = int(self._llm.token_bos())
        self.n_vocab = int(self._llm.n_vocab())
        template = meta.get("tokenizer.chat_template") or FALLBACK_TEMPLATE
        self.chat_template = template
        eos = self._piece(self.eos_id)
        bos = self._piece(self.bos_id) if self.bos_id >= 0 else ""
        self._chat = llama_chat_format.Jinja2ChatFormatter(
            template=template, eos_token=eos, bos_token=bos, stop_token_ids=[self.eos_id])
        self._chat_no_turn: llama_chat_format.Jinja2ChatFormatter | None = None
        self._lltok = None          # grammar_tokenizer(), built on first use
        self._tools_native: bool | None = None
        vocab = self._vocab()
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.fim = FimTokens(*(int(f(vocab)) for f in (
            llama_cpp.llama_vocab_fim_pre, llama_cpp.llama_vocab_fim_suf, llama_cpp.llama_vocab_fim_mid,
            llama_cpp.llama_vocab_fim_rep, llama_cpp.llama_vocab_fim_sep)))
        self.eog_ids = {i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab(), i)} \
            if self.n_vocab <= 300_000 else {self.eos_id}

    def _vocab(self):
        return llama_cpp.llama_model_get_vocab(self._llm.model)

    def _piece(self, token: int) -> str:
        return self._llm.detokenize([token], special=True).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        """A token's text, a special token's included (``<|endoftext|>``)."""
        return self._piece(token)

    def encode(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def decode_bytes(self, tokens: list[int]) -> bytes:
        """Bytes of ``tokens`` (a token may end mid UTF-8 character: join bytes, then decode)."""
        return self._llm.detokenize(tokens)

    def decode(self, tokens: list[int], *, special: bool = False) -> str:
        """``tokens``' text; with ``special``, special tokens' texts too (``<|im_end|>``)."""
        raw = self._llm.detokenize(tokens, special=True) if special else self.decode_bytes(tokens)
        return raw.decode("utf-8", "replace")

    def grammar_tokenizer(self):
        """llguidance's tokenizer of this vocabulary (built once, ~0.3 s for 49k tokens):
        what constrained sampling compiles grammars against. End-of-generation tokens
        end a grammar's output."""
        if self._lltok is None:
            from llguidance.llamacpp import lltokenizer_from_vocab

            self._lltok = lltokenizer_from_vocab(self._vocab(), eos_token=sorted(self.eog_ids) or self.eos_id)
        return self._lltok

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (a probe tool's name shows up)."""
        if self._tools_native is None:
            probe = "meshnode_probe_tool_7f3a"
            try:
                text = self._chat(messages=[{"role": "user", "content": "x"}], tools=[
                    {"type": "function", "function": {"name": probe, "parameters": {"type": "object"}}}]).prompt
            except Exception:  # noqa: BLE001 - a template that breaks on tools does not support them
                text = ""
            self._tools_native = probe in text
        return self._tools_native

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = True) -> tuple[list[int], list[str]]:
        """Prompt tokens for ``messages`` (and ``tools``, for a template that renders
        them; with ``add_generation_prompt``, what opens the assistant's turn) and the
        template's extra stop strings."""
        chat = self._chat if add_generation_prompt else self._chat_as_is()
        result = chat(messages=messages, tools=tools) if tools else chat(messages=messages)
        prompt = result.prompt
        # The template already writes BOS when the model wants it; don't add a second.
        add_bos = not (self.bos_id >= 0 and prompt.startswith(self._piece(self.bos_id)))
        tokens = self.encode(prompt, add_bos=add_bos, special=True)
        stops = result.stop if isinstance(result.stop, list) else ([result.stop] if result.stop else [])
        return tokens, [s for s in stops if s]

    def _chat_as_is(self) -> llama_chat_format.Jinja2ChatFormatter:
        """The chat template without the assistant turn's opening (built on first use)."""
        if self._chat_no_turn is None:
            self._chat_no_turn = llama_chat_format.Jinja2ChatFormatter(
                template=self.chat_template, eos_token=self._chat.eos_token, bos_token=self._chat.bos_token,
                stop_token_ids=[self.eos_id], add_generation_prompt=False)
        return self._chat_no_turn

    def close(self) -> None:
        self._llm.close()
