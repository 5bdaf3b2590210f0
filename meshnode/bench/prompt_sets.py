"""The speculation benchmarks' prompt sets (``meshnode/bench/prompts/*.json``).

Two workloads, each a JSON file ``{"workload": ..., "prompts": [...]}``:

- ``code_edit``: a file of 50-210 lines (Python, JavaScript, TypeScript, Go, Rust, C,
  Java, SQL) with a request of one *kind*: ``rename``, ``add_types``, ``refactor``,
  ``fix_bug`` (the file carries the bug), ``translate`` (to another language),
  ``add_tests``, and ``editor``: sequences where the same file comes back a little
  changed with the same request (``sequence`` names it, ``step`` orders it); a
  sequence is sent in order, as one client.
- ``mixed_chat``: questions, explanations, stories, advice, summaries of a given text,
  and multi-turn conversations (system / user / assistant messages).

Every prompt belongs to one fixed half, ``split``: ``tune`` or ``heldout``. Within each
kind, prompts alternate in file order (the first is ``tune``); a sequence goes whole
to one half. Settings (the auto policy's thresholds, the history proposer's minimum
match) are settled on ``tune``; reports quote ``heldout``. ``quick`` marks the small
subset ``--quick`` keeps. The prompts were written for this project.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SPLITS", "WORKLOADS", "BenchPrompt", "load", "select"]

WORKLOADS = ("code_edit", "mixed_chat")
SPLITS = ("tune", "heldout", "all")
_DIR = Path(__file__).with_name("prompts")
_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    workload: str
    kind: str
    split: str                                   # "tune" or "heldout"
    messages: tuple[tuple[str, str], ...]        # (role, content)
    quick: bool = False
    sequence: str | None = None                  # editor sequences: sent in step order
    step: int = 0

    def chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]

    @property
    def client(self) -> str:
        """Requests of one client: a sequence's steps share it, other prompts do not."""
        return self.sequence or self.id


def load(workload: str, directory: Path = _DIR) -> list[BenchPrompt]:
    """The prompts of ``workload``, in file order (sequences by step); ValueError on a
    malformed file (checked whole: the files are part of the product)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    data = json.loads((directory / f"{workload}.json").read_text(encoding="utf-8"))
    out: list[BenchPrompt] = []
    for i, p in enumerate(data.get("prompts") or []):
        where = f"{workload}.json prompt {i + 1}"
        msgs = p.get("messages")
        if not isinstance(msgs, list) or not msgs or any(
                not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str)
                for m in msgs):
            raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}")
        if msgs[-1]["role"] != "user":
            raise ValueError(f"{where}: the last message must be the user's")
        if p.get("split") not in ("tune", "heldout"):
            raise ValueError(f"{where}: split must be 'tune' or 'heldout'")
        if not p.get("id") or not p.get("kind"):
            raise ValueError(f"{where}: id and kind are required")
        out.append(BenchPrompt(str(p["id"]), workload, str(p["kind"]), p["split"],
                               tuple((m["role"], m["content"]) for m in msgs), bool(p.get("quick")),
                               p.get("sequence"), int(p.get("step", 0))))
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{workload}.json: duplicate prompt ids")
    for name in {p.sequence for p in out if p.sequence}:
        steps = [p for p in out if p.sequence == name]
        if len({p.split for p in steps}) != 1 or [p.step for p in steps] != list(range(len(steps))):
            raise ValueError(f"{workload}.json: sequence {name!r} must be in one half, steps 0..n in order")
    return out


def select(prompts: list[BenchPrompt], split: str, *, quick: bool = False,
           limit: int | None = None) -> list[BenchPrompt]:
    """The prompts of ``split`` ("tune", "heldout" or "all"), only the ``quick`` ones when
    asked, at most ``limit`` (a sequence is never cut: it counts as one)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    chosen = [p for p in prompts if (split == "all" or p.split == split) and (p.quick or not quick)]
    if limit is None:
        return chosen
    out: list[BenchPrompt] = []
    units: list[str] = []
    for p in chosen:
        if p.client not in units:
            if len(units) == limit:
                break
            units.append(p.client)
        out.append(p)
    return out
