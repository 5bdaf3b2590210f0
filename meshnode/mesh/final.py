"""What the final stage does with its logits: sample, or verify a draft window.

One function for every topology: a single node runs it right after its whole-model
forward, a split runs it on the last stage, which then returns the tokens straight to
stage 0. Random state lives here, per session, seeded by the request's seed, so a split
samples exactly what a single node would.

It is part of the mesh's data plane: the stage host of a final stage
(:mod:`meshnode.mesh.stage_host`) and the pipelines at stage 0
(:mod:`meshnode.mesh.pipeline`) both run it.

Sampling is per session, so its failures are too: a session whose logits or sampling
parameters make it raise (NaN logits, a value the sampler cannot take) fails alone, and
the other sessions of the same engine call keep their tokens (:meth:`FinalSampler.finalize_isolated`,
used by both callers). Only a failure of the engine call itself fails the whole batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from meshnode.mesh.logprobs import TokenLogprobs, token_logprobs
from meshnode.spec.acceptance import verify_logits

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # None: no logprobs; 0..20: the sampled tokens' logprobs and this many alternatives
    top_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = Sampling()


@dataclass(frozen=True, slots=True)
class Finalized:
    tokens: tuple[int, ...]   # accepted drafts, then the bonus (or the one sampled token)
    n_accepted: int
    n_drafted: int
    logprobs: TokenLogprobs | None = None   # when the step's sampling asked for them


@dataclass(frozen=True, slots=True)
class SamplingFailed:
    """One session's sampling raised: why (the session's own failure, not the batch's)."""

    reason: str


class FinalSampler:
    """Per-session random generators for the final stage."""

    def __init__(self) -> None:
        self._rngs: dict[int, np.random.Generator] = {}

    def finalize(self, session: int, logits: np.ndarray, drafts: tuple[int, ...],
                 sampling: Sampling) -> Finalized:
        """``logits``: ``(len(drafts) + 1, V)`` rows for ``[last, d1..dk]``."""
        rng = None
        if not sampling.greedy:
            rng = self._rngs.get(session)
            if rng is None:
                rng = self._rngs[session] = np.random.default_rng(sampling.seed)
        rows = logits[-(len(drafts) + 1):]
        res = verify_logits(rows, drafts, temperature=sampling.temperature,
                            top_k=sampling.top_k, top_p=sampling.top_p, rng=rng)
        lp = None
        if sampling.top_logprobs is not None:
            # row i is what the i-th emitted token (accepted draft or bonus) came from
            lp = token_logprobs(rows, res.tokens, sampling.top_logprobs)
        return Finalized(res.tokens, res.n_accepted, len(drafts), lp)

    def finalize_isolated(self, session: int, logits: np.ndarray, drafts: tuple[int, ...],
                          sampling: Sampling) -> Finalized | SamplingFailed:
        """:meth:`finalize`, with a failure returned instead of raised, so that the caller,
        which finalizes every session of one engine call in turn, hands it to this session
        alone. The session's generator is dropped: it may have advanced part way, and the
        request fails anyway."""
        try:
            return self.finalize(session, logits, drafts, sampling)
        except Exception as exc:  # noqa: BLE001 - this session's failure, never its batch's
            log.warning("session %x: sampling failed: %s", session, exc, exc_info=not isinstance(exc, ValueError))
            self.forget(session)
            return SamplingFailed(f"sampling failed: {exc}")

    def forget(self, session: int) -> None:
        self._rngs.pop(session, None)
