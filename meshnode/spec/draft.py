"""Draft-model proposer: a small model with the target's vocabulary guesses the window.

Theory of operation
-------------------
The draft is a whole model (token embedding + head) loaded with
:class:`~meshnode.engine.StageEngine` under its own session id. Drafts are its argmax
tokens, so the draft distribution is one-hot (``q = 1`` on the proposed token), which is
what the acceptance rule in ``acceptance.py`` assumes.

The proposer keeps:

* ``context`` -- what the target has produced so far (prompt + every accepted token and
  bonus, fed through :meth:`DraftModelProposer.accept`);
* ``kv`` -- the tokens whose keys/values sit in the draft's cache, positions 0..n-1;
* ``pred[i]`` -- the draft's argmax after ``kv[:i+1]``, where those logits were read
  (the last row of every decode call, every row of a GPU catch-up; prefill rows before
  the last have none).

:meth:`~DraftModelProposer.reset` prefills the prompt in chunks of ``n_batch`` rows
(logits for the last row only). :meth:`~DraftModelProposer.propose` first *syncs*: it
rolls the cache back to the longest common prefix of ``kv`` and ``context`` and feeds
only the context tokens after it, in one call, asking for the logits of the last row
only (on a GPU engine a short catch-up goes in calls shaped like its padded one-row steps,
so llama.cpp keeps replaying one CUDA graph: :data:`UNIFORM_CATCHUP_ROWS`). Then ``d1 = pred[len(context) - 1]`` costs nothing, and each further draft is one
single-row decode of the previous draft -- or nothing, when an earlier proposal already
cached it (cached drafts beyond the context are kept until the context contradicts
them). The last draft is never decoded: if it is accepted the next sync feeds it
together with the bonus (2 rows); if the target rejects ``d(m+1)`` the cache keeps
``d1..dm`` and the sync feeds the bonus alone (1 row). Nothing already cached is decoded
again. :meth:`~DraftModelProposer.accept` only records tokens: plain decoding
(speculation cold or off) then costs the draft nothing until it is asked again, and the
tokens it missed are caught up in one batch; :meth:`~DraftModelProposer.sync` does the
catch-up early.

Every method blocks on llama_decode: call them on the process's compute thread
(``meshnode.engine.worker.run_compute``), never from the event loop.

:func:`check_vocab` refuses a draft whose vocabulary differs from the target's (count or
any token text): a draft token id must mean the same text to the target. It reads
``tokenizer.ggml.tokens`` straight from the GGUF header (about 50 ms for a 49k
vocabulary; the ``gguf`` package's reader parses every field and took seconds).

This is the only ``spec`` module that imports :mod:`meshnode.engine`.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import numpy as np

from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.errors import MeshnodeError

__all__ = [
    "DraftModelProposer",
    "DraftStats",
    "DraftVocabMismatch",
    "check_vocab",
    "read_gguf_vocab",
]


class DraftVocabMismatch(MeshnodeError):
    """The draft model's vocabulary is not the target's: its token ids would be misread.

    The caller disables the draft (with a warning) and falls back to n-gram drafting.
    """


@dataclass(frozen=True, slots=True)
class DraftStats:
    """Work done by a :class:`DraftModelProposer` since it was created.

    ``rows``: token rows decoded (prefill, catch-up and drafting together);
    ``calls``: llama_decode calls; ``logit_rows``: rows whose logits were read;
    ``proposed``: draft tokens returned by ``propose``.
    """

    rows: int = 0
    calls: int = 0
    logit_rows: int = 0
    proposed: int = 0


class DraftModelProposer:
    """:class:`~meshnode.spec.strategy.Proposer` over a draft model (greedy drafts).

    ``model`` is a draft GGUF path (loaded here with ``n_ctx``, ``n_batch``,
    ``n_threads``, ``gpu_layers`` and one session slot; closed by :meth:`close`) or an
    already loaded :class:`~meshnode.engine.StageEngine` (shared: closed by :meth:`close`
    only with ``owns_engine``). Either way it must be a whole model (token input and
    head). ``session`` is the engine session this proposer uses (distinct from any other
    user of a shared engine). ``stop_ids``: token ids (end of generation) after which
    drafting stops: a draft past the end is wasted.

    Raises :class:`~meshnode.engine.ModelLoadError` when llama.cpp refuses the file;
    call :func:`check_vocab` first to refuse a draft of another vocabulary.
    Not thread-safe; blocking.
    """

    def __init__(
        self,
        model: StageEngine | str | PathLike[str],
        *,
        session: int = 0,
        owns_engine: bool = False,
        stop_ids: Collection[int] = (),
        n_ctx: int = 4096,
        n_batch: int = 256,
        n_threads: int | None = None,
        gpu_layers: int = 0,
    ) -> None:
        if isinstance(model, StageEngine):
            engine = model
        else:
            engine = StageEngine(EngineConfig(
                Path(model), takes_tokens=True, has_head=True, n_ctx=n_ctx, n_batch=n_batch,
                n_seq_max=1, n_threads=n_threads, gpu_layers=gpu_layers))
            owns_engine = True
        if not (engine.takes_tokens and engine.has_head):
            raise ValueError("a draft model must be a whole model (token input and head)")
        self.engine = engine
        self.session = session
        self._owns = owns_engine
        self._stop = frozenset(int(t) for t in stop_ids)
        self._context: list[int] = []
        self._kv: list[int] = []                 # tokens cached at positions 0..n-1
        self._pred: list[int | None] = []        # argmax after kv[:i+1], when read
        self._rows = self._calls = self._logit_rows = self._proposed = 0

    @classmethod
    def open(cls, path: str | PathLike[str], **kwargs) -> "DraftModelProposer":
        """Same as ``DraftModelProposer(path, **kwargs)``."""
        return cls(path, **kwargs)

    # ---- Proposer protocol ------------------------------------------------------------

    def reset(self, prompt: Sequence[int], *, sync: bool = True) -> None:
        """Start a request whose context is ``prompt``; prefill it now (``sync=False``:
        at the first :meth:`propose` instead, so a request that never drafts, e.g. while
        the auto policy cools down, costs the draft nothing).

        A cached prefix shared with the previous request (multi-turn chat) is kept and
        only the rest is decoded. Raises the engine's errors
        (:class:`~meshnode.engine.ContextOverflowError` when the prompt does not fit the
        draft's context: the caller should not use the draft for this request).
        """
        self._context = [int(t) for t in prompt]
        if sync:
            self._sync()

    def propose(self, context_tail: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` greedy drafts continuing the context (``context_tail`` is ignored).

        Catches the cache up with tokens accepted since the last call, then decodes at
        most ``k - 1`` single rows (drafts cached by an earlier call are reused). Returns
        fewer than ``k`` drafts when a stop token is proposed or the draft's context is
        full, ``[]`` for an empty context, a context too long for the draft, or ``k <= 0``.
        """
        if k <= 0 or not self._context:
            return []
        ctx_len = len(self._context)
        if ctx_len > self.engine.n_ctx:
            return []  # the draft's context is full: no more help for this request
        self._sync()
        drafts = [self._pred[ctx_len - 1]]
        while len(drafts) < k and drafts[-1] not in self._stop:
            p = ctx_len + len(drafts) - 1   # where drafts[-1] goes
            if p >= self.engine.n_ctx:
                break
            if not (p < len(self._kv) and self._kv[p] == drafts[-1] and self._pred[p] is not None):
                self._truncate(p)
                self._feed(p, drafts[-1:])
            drafts.append(self._pred[p])
        self._proposed += len(drafts)
        return drafts  # type: ignore[return-value]  # every _pred read here is set

    def accept(self, tokens: Sequence[int]) -> None:
        """Record the tokens the target emitted (accepted drafts, then the bonus).

        Costs nothing now: the next :meth:`propose` (or :meth:`sync`) rolls the cache back
        to the last position that agrees with the context and feeds the rest.
        """
        self._context.extend(int(t) for t in tokens)

    # ---- extras -------------------------------------------------------------------------

    def sync(self, max_rows: int | None = None) -> None:
        """Catch the draft's cache up with the context now (e.g. in idle time between
        :meth:`accept` and the next :meth:`propose`); with ``max_rows``, on at most that
        many tokens of it (a piece of a long catch-up: the rest waits for the next call).

        No-op when already in sync or when the context does not fit the draft.
        """
        if self._context and len(self._context) <= self.engine.n_ctx:
            self._sync(max_rows)

    @property
    def lag(self) -> int:
        """Context tokens not in the draft's cache yet: what the next call catches up on
        (a new request's prompt, the tokens of plain decoding meanwhile)."""
        return max(0, len(self._context) - len(self._kv))

    @property
    def context(self) -> Sequence[int]:
        """Prompt + accepted tokens as this proposer knows them (read-only view)."""
        return self._context

    @property
    def stats(self) -> DraftStats:
        return DraftStats(self._rows, self._calls, self._logit_rows, self._proposed)

    def close(self) -> None:
        """Free the session (and the engine when this proposer owns it)."""
        if self._owns:
            self.engine.close()
        else:
            self.engine.drop(self.session)
        self._kv = []
        self._pred = []

    def __enter__(self) -> "DraftModelProposer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------

    def _sync(self, max_rows: int | None = None) -> None:
        """Make ``kv`` start with the whole context and know the argmax after it (with
        ``max_rows``: with that many more tokens of it at most).

        Cached rows beyond the context (drafts decoded by an earlier propose that the
        context has not contradicted) are kept: the next propose reuses them.
        """
        ctx, kv = self._context, self._kv
        if not ctx:
            self.engine.drop(self.session)
            self._truncate(0)
            return
        n = min(len(ctx), len(kv))
        common = 0
        while common < n and ctx[common] == kv[common]:
            common += 1
        if common == len(ctx):
            if self._pred[common - 1] is not None:
                return
            common -= 1  # the logits of the context's last position were not kept: redo it
        self._truncate(common)
        self._feed(common, ctx[common:] if max_rows is None else ctx[common:common + max(1, max_rows)])

    def _truncate(self, n: int) -> None:
        if n < len(self._kv):
            self.engine.rollback(self.session, n)
            del self._kv[n:]
            del self._pred[n:]

    def _feed(self, pos: int, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` at ``pos`` in chunks of n_batch, logits of the last row only;
        on a padding (GPU) engine a short catch-up in calls shaped like its padded one-row
        steps instead (:data:`UNIFORM_CATCHUP_ROWS`)."""
        arr = np.asarray(tokens, dtype=np.int32)
        n = len(arr)
        pad = self.engine.pad_rows
        uniform = pad > 1 and n <= UNIFORM_CATCHUP_ROWS
        step = pad if uniform else self.engine.n_batch
        for start in range(0, n, step):
            chunk = arr[start:start + step]
            last = start + step >= n
            n_logits = len(chunk) if uniform else 1 if last else 0
            seg = Segment(self.session, pos + start, tokens=chunk, n_logits=n_logits)
            out = self.engine.forward([seg], rewind=True)  # on error the engine changed nothing
            self._kv.extend(int(t) for t in chunk)
            # the argmax after each row whose logits came back (its last n_logits)
            self._pred.extend([None] * (len(chunk) - n_logits) + np.argmax(out[0][:n_logits], axis=1).tolist())
            self._rows += len(chunk)
            self._calls += 1
            self._logit_rows += n_logits


# On a GPU llama.cpp replays a captured CUDA graph while consecutive calls have the same
# shape (rows, rows with logits) and captures a new one when it changes: SmolLM2's shape on
# an H200 took 1.5 ms a call in a run of one shape and 4.4-6 ms a call when a draft's
# pattern (a 2-row catch-up with one logits row, then one-row steps) alternated shapes,
# about what it takes with graphs off (packaging/gpu/step_probe.py). A GPU engine pads a
# one-row step to its pad width with logits for every row, so a catch-up of up to this
# many rows goes in calls of that shape too (each row's logits asked); a longer one (a
# prompt, a long run of n-gram windows) in one call of up to n_batch rows.
UNIFORM_CATCHUP_ROWS = 8


# ---- vocabulary check -------------------------------------------------------------------

VocabSource = str | PathLike[str] | Sequence[str]


def check_vocab(target: VocabSource, draft_path: str | PathLike[str]) -> None:
    """Raise :class:`DraftVocabMismatch` unless the draft shares the target's vocabulary.

    ``target`` is the target's GGUF path or its token texts (``tokenizer.ggml.tokens``
    order). Compares the number of tokens, then every token text; the message names the
    first difference. Raises :class:`DraftVocabMismatch` too when either file has no
    readable vocabulary (the draft cannot be used either way).
    """
    draft_path = Path(draft_path)
    if isinstance(target, (str, PathLike)):
        target_name = Path(target).name
        target_vocab = read_gguf_vocab(target)
    else:
        target_name = "the target"
        target_vocab = list(target)
    draft_vocab = read_gguf_vocab(draft_path)
    if len(target_vocab) != len(draft_vocab):
        raise DraftVocabMismatch(
            f"draft model {draft_path.name} has {len(draft_vocab)} tokens, {target_name} has "
            f"{len(target_vocab)}: a draft must share the target's vocabulary")
    for i, (a, b) in enumerate(zip(target_vocab, draft_vocab)):
        if a != b:
            raise DraftVocabMismatch(
                f"draft model {draft_path.name} is not tokenised like {target_name}: token {i} "
                f"is {b!r} in the draft and {a!r} in the target")


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_TOKENS_KEY = b"tokenizer.ggml.tokens"


def read_gguf_vocab(path: str | PathLike[str]) -> list[str]:
    """Token texts (``tokenizer.ggml.tokens``) of a GGUF, read from its header only.

    Raises :class:`DraftVocabMismatch` when the file is unreadable, not GGUF, or has no
    vocabulary (its message names the file).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse_tokens(m, path)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise DraftVocabMismatch(f"cannot read the vocabulary of {path}: {exc}") from None


def _parse_tokens(m: mmap.mmap, path: Path) -> list[str]:
    # GGUF v2/v3 header: magic, u32 version, u64 n_tensors, u64 n_kv, then n_kv entries of
    # (string key, u32 type, value); strings are u64 length + bytes (little-endian).
    if m[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    (version,) = struct.unpack_from("<I", m, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    (n_kv,) = struct.unpack_from("<Q", m, 16)
    off = 24
    u64, u32 = struct.Struct("<Q"), struct.Struct("<I")

    def skip_value(t: int, off: int) -> int:
        if t == _STRING:
            return off + 8 + u64.unpack_from(m, off)[0]
        if t == _ARRAY:
            sub = u32.unpack_from(m, off)[0]
            count = u64.unpack_from(m, off + 4)[0]
            off += 12
            if sub in _GGUF_SCALAR:
                return off + count * _GGUF_SCALAR[sub]
            for _ in range(count):
                off = skip_value(sub, off)
            return off
        return off + _GGUF_SCALAR[t]

    for _ in range(n_kv):
        klen = u64.unpack_from(m, off)[0]
        key = m[off + 8:off + 8 + klen]
        off += 8 + klen
        t = u32.unpack_from(m, off)[0]
        off += 4
        if key == _TOKENS_KEY and t == _ARRAY and u32.unpack_from(m, off)[0] == _STRING:
            count = u64.unpack_from(m, off + 4)[0]
            off += 12
            out = []
            for _ in range(count):
                n = u64.unpack_from(m, off)[0]
                out.append(m[off + 8:off + 8 + n].decode("utf-8"))
                off += 8 + n
            return out
        off = skip_value(t, off)
    raise ValueError(f"{path.name} has no tokenizer.ggml.tokens")
