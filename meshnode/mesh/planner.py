"""Stage planner: which nodes run which contiguous layer ranges of a model.

Theory of operation. The planner is a pure function: :func:`plan` takes the model's
shape (:class:`ModelShape`) and what the peers offer (:class:`Candidate`) and returns a
:class:`Plan` (ordered stages, each a node and a half-open layer range) or raises
:class:`PlanError` whose message says what is missing. No I/O, no clock, no randomness:
the same inputs always give the same plan (candidates are sorted by node id first and
every tie is broken by node id).

Rules, in order (see ``docs/planning.md``):

1. A node's *capacity* is its free memory, capped by its ``--max-memory`` budget. A
   stage fits when ``est_bytes * (1 + headroom) <= capacity``, where ``est_bytes`` is
   the weights of its layers + their KV cache for ``n_ctx`` tokens + a per-stage
   overhead, plus the embeddings on stage 0 and the output head on the last stage.
2. The coordinator is always stage 0 and holds the first layers.
3. Fewer stages are preferred: if the whole model fits on the coordinator it runs
   there alone; otherwise 2 stages are tried, then 3, ... up to every candidate.
4. For a given number of stages every choice of nodes (and of which one is last) is
   tried. Layers are shared in proportion to each node's speed, with memory as a cap
   (water-filling: a node whose share does not fit is clamped to what fits and the
   rest is shared among the others), then rounded to whole layers under exact fit
   checks. Among the feasible arrangements the one with the lowest estimated time
   per token (compute share / speed + link RTT) wins; ties go to node ids.
5. A node with a GPU (``free_vram`` > 0) adds its free VRAM to its capacity and runs
   the layers that fit there at ``vram_speed`` (default: ``GPU_SPEEDUP`` times its CPU
   speed), the rest at its CPU speed: in the water-fill it is two slots, a fast one
   capped by its VRAM and a slow one for what spills to RAM.
6. ``split=N`` forces exactly N stages; ``explicit`` takes given ranges on given
   nodes and only checks them (coverage, coordinator first, memory fit).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.config import parse_size  # re-exported: the CLI reads --max-memory with it
from meshnode.errors import MeshnodeError

__all__ = [
    "Candidate",
    "ModelShape",
    "Plan",
    "PlanError",
    "PlannedStage",
    "StageAssignment",
    "format_size",
    "parse_explicit",
    "parse_size",
    "plan",
]

DEFAULT_HEADROOM = 0.1
# Decode speed of layers held in VRAM against the same node's CPU figure when the node
# does not say (Candidate.vram_speed). An estimate, not a measurement: decoding is
# memory-bound, and a GPU's memory bandwidth is roughly 10-20x a desktop's DRAM.
GPU_SPEEDUP = 16.0
# At most this many remote candidates are considered for automatic plans (the ones with
# the most capacity); keeps the search over node subsets small on a large LAN.
MAX_REMOTE_POOL = 8


class PlanError(MeshnodeError):
    """No plan satisfies the inputs; the message says what is missing."""


# ---- inputs -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes the planner needs, in bytes.

    ``layer_bytes`` is one int per layer, or a single int for a model whose layers are
    all the same size. ``kv_bytes_per_token`` is the K+V cache of *one layer* for one
    token (``2 * n_embd_kv * dtype size``); None assumes f16 K and V of width n_embd
    (no GQA), an upper bound. ``head_bytes`` is what the last stage holds beyond its
    layers (output norm + output matrix; for tied embeddings, the embedding matrix).
    ``overhead_bytes`` is charged once per stage (compute buffers, logits).
    """

    n_layers: int
    layer_bytes: tuple[int, ...] | int
    embed_bytes: int
    head_bytes: int
    n_embd: int
    n_ctx: int
    kv_bytes_per_token: int | None = None
    overhead_bytes: int = 0

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")
        sizes = self.layer_bytes
        if isinstance(sizes, int):
            sizes = (sizes,) * self.n_layers
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != self.n_layers:
            raise ValueError(f"layer_bytes has {len(sizes)} entries for {self.n_layers} layers")
        if any(s < 0 for s in sizes) or min(self.embed_bytes, self.head_bytes, self.overhead_bytes) < 0:
            raise ValueError("sizes must be >= 0")
        if self.n_ctx < 1 or self.n_embd < 1:
            raise ValueError("n_ctx and n_embd must be >= 1")
        object.__setattr__(self, "layer_bytes", sizes)

    def kv_bytes_per_layer(self, n_ctx: int | None = None) -> int:
        """KV cache bytes of one layer for ``n_ctx`` tokens (default: the model's n_ctx)."""
        per_token = self.kv_bytes_per_token
        if per_token is None:
            per_token = 2 * self.n_embd * 2
        return per_token * (self.n_ctx if n_ctx is None else n_ctx)

    def stage_bytes(self, start: int, end: int, *, first: bool, last: bool) -> int:
        """Estimated memory of a stage holding layers [start, end)."""
        sizes: tuple[int, ...] = self.layer_bytes  # type: ignore[assignment]
        total = sum(sizes[start:end]) + (end - start) * self.kv_bytes_per_layer() + self.overhead_bytes
        if first:
            total += self.embed_bytes
        if last:
            total += self.head_bytes
        return total

    @property
    def total_bytes(self) -> int:
        """The whole model on one node (weights, KV, embeddings, head, one overhead)."""
        return self.stage_bytes(0, self.n_layers, first=True, last=True)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that could run a stage.

    ``speed`` is the tokens/s this node would reach running the whole model (a relative
    score is fine: only ratios and the time estimate use it); None or <= 0 means
    unknown and counts as the mean of the known speeds. ``rtt_ms`` is the link round
    trip from the coordinator (None: unknown, counted as 1 ms; the coordinator's own is
    ignored). ``fetch_bytes_per_s``: None when the node holds the model; otherwise it
    must fetch its stage's layer package from a holder at this rate (bytes/s), and the
    planner counts that time (:func:`plan`).
    """

    node_id: str
    name: str
    free_memory: int
    budget: int | None = None
    speed: float | None = None
    rtt_ms: float | None = None
    is_coordinator: bool = False
    fetch_bytes_per_s: float | None = None
    free_vram: int = 0                 # bytes of GPU memory this node offloads into
    vram_speed: float | None = None    # speed of layers in VRAM (None: GPU_SPEEDUP x speed)

    @property
    def capacity(self) -> int:
        """Bytes this node may use: free memory, capped by its budget, plus free VRAM."""
        cap = max(0, int(self.free_memory))
        if self.budget is not None:
            cap = min(cap, max(0, int(self.budget)))
        return cap + max(0, int(self.free_vram))


@dataclass(frozen=True, slots=True)
class StageAssignment:
    """One entry of an explicit plan: ``node`` (node id or name) runs [start, end)."""

    node: str
    start: int
    end: int


# ---- outputs ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedStage:
    node_id: str
    name: str
    start: int
    end: int          # exclusive
    est_bytes: int    # estimated memory before headroom

    @property
    def n_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Plan:
    stages: tuple[PlannedStage, ...]
    reason: str
    est_ms: float = 0.0   # rough time per token (compute share / speed + link RTT)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def coordinator(self) -> PlannedStage:
        return self.stages[0]

    def describe(self) -> str:
        """One line per stage, e.g. ``stage 0 alpha [0,12) 3.1 GB``."""
        return "\n".join(
            f"stage {i} {s.name} [{s.start},{s.end}) {format_size(s.est_bytes)}"
            for i, s in enumerate(self.stages)
        )


# ---- helpers for the CLI -------------------------------------------------------

def format_size(n: float) -> str:
    """Bytes as decimal units with one decimal, rounded *up* (never under-reports)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale or unit == "KB" and n > 0:
            return f"{math.ceil(round(n / scale * 10, 6)) / 10:.1f} {unit}"
    return f"{int(n)} B"


def parse_explicit(text: str) -> tuple[StageAssignment, ...]:
    """``"nodeA=0:10,nodeB=10:30"`` -> stage assignments in that order.

    Only the syntax is checked here; coverage, overlaps and bounds are checked by
    :func:`plan`, which knows the model. Raises :class:`PlanError`.
    """
    assignments = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        node, sep, rng = part.rpartition("=")
        lo, colon, hi = rng.partition(":")
        if not sep or not node.strip() or not colon or not lo.strip().isdigit() or not hi.strip().isdigit():
            raise PlanError(f"cannot read stage {part!r} (expected NODE=START:END, e.g. nodeA=0:10)")
        assignments.append(StageAssignment(node.strip(), int(lo), int(hi)))
    if not assignments:
        raise PlanError("empty explicit plan (expected e.g. nodeA=0:10,nodeB=10:30)")
    return tuple(assignments)


# ---- the planner ---------------------------------------------------------------


def plan(
    model: ModelShape,
    candidates: Sequence[Candidate],
    *,
    split: int | None = None,
    explicit: Sequence[StageAssignment] | str | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """Choose stages for ``model`` over ``candidates`` (exactly one is the coordinator).

    Returns a :class:`Plan` whose first stage is the coordinator. Raises
    :class:`PlanError` when no plan fits, saying what is missing, and ``ValueError``
    for inputs that are the caller's bug (no coordinator, duplicate node ids).
    """
    if split is not None and explicit is not None:
        raise PlanError("--split and an explicit plan cannot be combined")
    if headroom < 0:
        raise ValueError("headroom must be >= 0")
    cands = sorted(candidates, key=lambda c: c.node_id)
    ids = [c.node_id for c in cands]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate node ids among candidates: {ids}")
    coords = [c for c in cands if c.is_coordinator]
    if len(coords) != 1:
        raise ValueError(f"exactly one candidate must be the coordinator, got {len(coords)}")
    ctx = _Context(model, cands, coords[0], headroom)
    if explicit is not None:
        if isinstance(explicit, str):
            explicit = parse_explicit(explicit)
        return ctx.explicit(explicit)
    if split is not None:
        if split < 1:
            raise PlanError(f"--split must be >= 1, got {split}")
        if split > len(cands):
            raise PlanError(f"--split {split} needs {split} nodes, {len(cands)} available")
        found = ctx.best(split)
        if found is None:
            raise PlanError(f"--split {split}: {ctx.why_not(split)}")
        return ctx.to_plan(found, f"--split {split}")
    if ctx.fits(ctx.coord, 0, model.n_layers, first=True, last=True):
        return ctx.to_plan(((ctx.coord, 0, model.n_layers),), "fits on the coordinator alone")
    for k in range(2, len(cands) + 1):
        found = ctx.best(k)
        if found is not None:
            why = (
                f"{k} stages: the model needs {format_size(ctx.with_headroom(model.total_bytes))} "
                f"with headroom, the coordinator offers {format_size(ctx.coord.capacity)}"
            )
            return ctx.to_plan(found, why)
    raise PlanError(ctx.why_not(None))


_Arrangement = tuple[tuple[Candidate, int, int], ...]


class _Context:
    """One planning call's inputs and the searches over them."""

    def __init__(self, model: ModelShape, cands: list[Candidate], coord: Candidate, headroom: float):
        self.model = model
        self.cands = cands
        self.coord = coord
        self.headroom = headroom
        self.n = model.n_layers
        sizes: tuple[int, ...] = model.layer_bytes  # type: ignore[assignment]
        kv = model.kv_bytes_per_layer()
        self.prefix = [0]
        for s in sizes:
            self.prefix.append(self.prefix[-1] + s + kv)
        self.wprefix = [0]   # weights only: what a layer package carries
        for s in sizes:
            self.wprefix.append(self.wprefix[-1] + s)
        known = [c.speed for c in cands if c.speed is not None and c.speed > 0]
        self.default_speed = sum(known) / len(known) if known else 1.0

    # -- sizes

    def with_headroom(self, n: float) -> float:
        return n * (1.0 + self.headroom)

    def usable(self, c: Candidate) -> float:
        return c.capacity / (1.0 + self.headroom)

    def bytes(self, start: int, end: int, *, first: bool, last: bool) -> int:
        m = self.model
        return (self.prefix[end] - self.prefix[start] + m.overhead_bytes
                + (m.embed_bytes if first else 0) + (m.head_bytes if last else 0))

    def fits(self, c: Candidate, start: int, end: int, *, first: bool, last: bool) -> bool:
        return self.bytes(start, end, first=first, last=last) <= self.usable(c)

    def speed(self, c: Candidate) -> float:
        return c.speed if c.speed is not None and c.speed > 0 else self.default_speed

    def vram_layers(self, c: Candidate) -> float:
        """Layers (of average size) this node holds in VRAM."""
        if c.free_vram <= 0:
            return 0.0
        return c.free_vram / (1.0 + self.headroom) / max(1.0, self.prefix[self.n] / self.n)

    def vram_speed(self, c: Candidate) -> float:
        if c.vram_speed is not None and c.vram_speed > 0:
            return c.vram_speed
        return self.speed(c) * GPU_SPEEDUP

    def stage_ms(self, c: Candidate, layers: float) -> float:
        """Compute time of ``layers`` layers on ``c``: the VRAM part at GPU speed."""
        fast = min(layers, self.vram_layers(c))
        return 1000.0 / self.n * (fast / self.vram_speed(c) + (layers - fast) / self.speed(c))

    def rtt(self, c: Candidate) -> float:
        if c.is_coordinator:
            return 0.0
        return c.rtt_ms if c.rtt_ms is not None else 1.0

    # -- automatic plans

    def best(self, k: int) -> _Arrangement | None:
        """The best feasible arrangement of exactly ``k`` stages, or None."""
        if k == 1:
            ok = self.fits(self.coord, 0, self.n, first=True, last=True)
            return ((self.coord, 0, self.n),) if ok else None
        if k > self.n:
            return None
        remotes = [c for c in self.cands if not c.is_coordinator]
        if len(remotes) > MAX_REMOTE_POOL:
            remotes = sorted(remotes, key=lambda c: (-c.capacity, c.node_id))[:MAX_REMOTE_POOL]
            remotes.sort(key=lambda c: c.node_id)
        best: tuple[tuple[float, tuple[str, ...]], _Arrangement] | None = None
        for subset in itertools.combinations(remotes, k - 1):
            for last in subset:
                middle = sorted((c for c in subset if c is not last), key=lambda c: (self.rtt(c), c.node_id))
                order = [self.coord, *middle, last]
                arr = self.arrange(order)
                if arr is None:
                    continue
                # the one-off fetch first: a plan on holders beats one that must download
                key = (round(self.fetch_s(arr), 3), round(self.est_ms(arr), 9), tuple(c.node_id for c, _, _ in arr))
                if best is None or key < best[0]:
                    best = (key, arr)
        return None if best is None else best[1]

    def arrange(self, order: list[Candidate]) -> _Arrangement | None:
        """Contiguous ranges for nodes in ``order``: speed-proportional, memory-capped."""
        k, n = len(order), self.n
        last = k - 1
        # maxend[i][s]: the largest end such that stage i fits [s, end), leaving >= 1
        # layer per later stage; s itself when not even one layer fits. Fit is monotone
        # in both ends, so a moving pointer finds it in O(n) per stage.
        maxend: list[list[int]] = []
        for i, c in enumerate(order):
            row, e = [], 0
            limit = n - (last - i)
            for s in range(n):
                e = max(e, s)
                while e < limit and self.fits(c, s, e + 1, first=i == 0, last=i == last):
                    e += 1
                row.append(e)
            maxend.append(row)
        # feasible[i][s]: stages i.. can cover [s, n).
        feasible = [[False] * (n + 1) for _ in range(k + 1)]
        feasible[k][n] = True
        for i in range(last, -1, -1):
            nxt = feasible[i + 1]
            count = [0]
            for v in nxt:
                count.append(count[-1] + v)
            for s in range(n):
                e = maxend[i][s]
                feasible[i][s] = e > s and count[e + 1] - count[s + 1] > 0
        if not feasible[0][0]:
            return None
        targets = self.targets(order)
        result, pos, acc = [], 0, 0.0
        for i, c in enumerate(order):
            if i == last:
                result.append((c, pos, n))
                break
            acc += targets[i]
            options = [e for e in range(pos + 1, maxend[i][pos] + 1) if feasible[i + 1][e]]
            end = min(options, key=lambda e: (abs(e - acc), e))
            result.append((c, pos, end))
            pos = end
        return tuple(result)

    def targets(self, order: list[Candidate]) -> list[float]:
        """Fractional layer counts: proportional to speed, clamped by memory (water-fill)."""
        k, n = len(order), self.n
        avg = max(1.0, self.prefix[n] / n)
        m = self.model
        caps = []
        for i, c in enumerate(order):
            fixed = m.overhead_bytes + (m.embed_bytes if i == 0 else 0) + (m.head_bytes if i == k - 1 else 0)
            caps.append(max(0.0, (self.usable(c) - fixed) / avg))
        # Slots: (node index, speed, cap). A GPU node has a VRAM slot and a RAM slot.
        slots: list[tuple[int, float, float]] = []
        for i, c in enumerate(order):
            fast = min(caps[i], self.vram_layers(c))
            if fast > 0:
                slots.append((i, self.vram_speed(c), fast))
            slots.append((i, self.speed(c), caps[i] - fast))
        got = [0.0] * len(slots)
        free = set(range(len(slots)))
        left = float(n)
        while free:
            total = sum(slots[j][1] for j in free)
            trial = {j: left * slots[j][1] / total for j in free}
            over = [j for j in sorted(free) if trial[j] > slots[j][2]]
            if not over:
                for j, v in trial.items():
                    got[j] = v
                break
            for j in over:
                got[j] = slots[j][2]
                left -= slots[j][2]
                free.discard(j)
        share = [0.0] * k
        for (i, _, _), v in zip(slots, got):
            share[i] += v
        return share

    def fetch_s(self, arr: _Arrangement) -> float:
        """Seconds the non-holders of ``arr`` spend fetching their packages (in parallel:
        the slowest one counts)."""
        m, last = self.model, len(arr) - 1
        worst = 0.0
        for i, (c, s, e) in enumerate(arr):
            if c.fetch_bytes_per_s is None:
                continue
            size = (self.wprefix[e] - self.wprefix[s] + (m.embed_bytes if i == 0 else 0)
                    + (m.head_bytes if i == last else 0))
            worst = max(worst, size / max(c.fetch_bytes_per_s, 1.0))
        return worst

    def est_ms(self, arr: _Arrangement) -> float:
        return sum(self.stage_ms(c, e - s) + self.rtt(c) for c, s, e in arr)

    # -- explicit plans

    def explicit(self, assignments: Sequence[StageAssignment]) -> Plan:
        by_id = {c.node_id: c for c in self.cands}
        by_name: dict[str, list[Candidate]] = {}
        for c in self.cands:
            by_name.setdefault(c.name, []).append(c)
        arr, pos = [], 0
        for i, sp in enumerate(assignments):
            c = by_id.get(sp.node)
            if c is None:
                named = by_name.get(sp.node, [])
                if len(named) > 1:
                    raise PlanError(f"node name {sp.node!r} is ambiguous; use a node id")
                if not named:
                    raise PlanError(f"explicit plan names {sp.node!r}, which is not an available node")
                c = named[0]
            if any(c is prev for prev, _, _ in arr):
                raise PlanError(f"explicit plan uses node {c.name!r} twice")
            if not 0 <= sp.start < sp.end <= self.n:
                raise PlanError(
                    f"range {sp.start}:{sp.end} for {sp.node!r} is out of bounds "
                    f"(the model has layers 0:{self.n})"
                )
            if sp.start > pos:
                raise PlanError(f"explicit plan leaves layers {pos}:{sp.start} unassigned")
            if sp.start < pos:
                raise PlanError(f"explicit plan assigns layers {sp.start}:{pos} twice")
            if i == 0 and c is not self.coord:
                raise PlanError(
                    f"explicit plan must start on the coordinator {self.coord.name!r} "
                    f"(it holds the first layers), not {c.name!r}"
                )
            arr.append((c, sp.start, sp.end))
            pos = sp.end
        if pos < self.n:
            raise PlanError(f"explicit plan leaves layers {pos}:{self.n} unassigned")
        last = len(arr) - 1
        for i, (c, s, e) in enumerate(arr):
            need = self.with_headroom(self.bytes(s, e, first=i == 0, last=i == last))
            if need > c.capacity:
                raise PlanError(
                    f"{c.name} needs {format_size(need - c.capacity)} more memory for layers "
                    f"{s}:{e} ({format_size(need)} with headroom, {format_size(c.capacity)} available)"
                )
        return self.to_plan(tuple(arr), "explicit")

    # -- results and refusals

    def to_plan(self, arr: _Arrangement, reason: str) -> Plan:
        last = len(arr) - 1
        stages = tuple(
            PlannedStage(c.node_id, c.name, s, e, self.bytes(s, e, first=i == 0, last=i == last))
            for i, (c, s, e) in enumerate(arr)
        )
        return Plan(stages, reason, round(self.est_ms(arr), 3))

    def why_not(self, k: int | None) -> str:
        """What is missing for a plan of ``k`` stages (None: any number)."""
        if k is None:
            pool, where = self.cands, "across the mesh"
        else:
            remotes = sorted((c for c in self.cands if not c.is_coordinator), key=lambda c: (-c.capacity, c.node_id))
            pool, where = [self.coord, *remotes[: k - 1]], f"across {k} nodes"
            if k > self.n:
                return f"the model has only {self.n} layers"
        stages = len(pool)
        need = self.with_headroom(self.prefix[self.n] + self.model.embed_bytes + self.model.head_bytes
                                  + stages * self.model.overhead_bytes)
        have = sum(c.capacity for c in pool)
        if need > have:
            return (
                f"needs {format_size(need - have)} more memory {where} "
                f"({format_size(need)} for weights and KV at n_ctx={self.model.n_ctx} with "
                f"{self.headroom:.0%} headroom; {len(pool)} node(s) offer {format_size(have)})"
            )
        biggest = max(range(self.n), key=lambda i: (self.prefix[i + 1] - self.prefix[i], -i))
        one = self.with_headroom(self.bytes(biggest, biggest + 1, first=False, last=False))
        if one > max(c.capacity for c in pool):
            return f"layer {biggest} alone needs {format_size(one)}, more than any node offers"
        first = self.with_headroom(self.bytes(0, 1, first=True, last=self.n == 1))
        if first > self.coord.capacity:
            return (
                f"the coordinator {self.coord.name} needs {format_size(first - self.coord.capacity)} more "
                f"memory to hold the embeddings and the first layer"
            )
        return (
            f"the free memory is too fragmented: no contiguous split over {stages} node(s) fits "
            f"({format_size(have)} offered, {format_size(need)} needed)"
        )
