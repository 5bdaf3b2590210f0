"""What the final stage does with its logits: sample, or verify a draft window.

One function for every topology: a single node runs it right after its whole-model
forward, a split runs it on the last stage, which then returns the tokens straight to
stage 0. Random state lives here, per session, seeded by the request's seed, so a split
samples exactly what a single node would.

It is part of the mesh's data plane: the stage host of a final stage
(:mod:`meshnode.mesh.stage_host`) and the pipelines at stage 0
(:mod:`meshnode.mesh.pipeline`) both run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshnode.spec.acceptance import verify_logits


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = Sampling()


@dataclass(frozen=True, slots=True)
class Finalized:
    tokens: tuple[int, ...]   # accepted drafts, then the bonus (or the one sampled token)
    n_accepted: int
    n_drafted: int


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
        res = verify_logits(logits[-(len(drafts) + 1):], drafts, temperature=sampling.temperature,
                            top_k=sampling.top_k, top_p=sampling.top_p, rng=rng)
        return Finalized(res.tokens, res.n_accepted, len(drafts))

    def forget(self, session: int) -> None:
        self._rngs.pop(session, None)
