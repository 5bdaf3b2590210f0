"""A deterministic node for UI tests: fixed snapshot, a short scripted event stream.

Only for UI unit and snapshot tests; it implements :class:`meshnode.state.NodeAPI`
and nothing else of the node. ``T0`` is the fixed "now" (pass ``clock=lambda: NOW`` to
the app so durations are stable).

Run ``python -m tests.fake_node assets/`` to regenerate the README screenshots.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from meshnode.state import (
    MeshModel,
    Capabilities,
    DraftVerified,
    HeldModel,
    LogEmitted,
    ModelInfo,
    NodeEvent,
    NodeInfo,
    NodeSnapshot,
    PeerInfo,
    RequestInfo,
    RequestStatus,
    SpecState,
    SpecStats,
    StageInfo,
    StageState,
    TelemetryPoint,
    TransferInfo,
)

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
NOW = T0 + 120.0
GB = 1024**3
MB = 1024**2
MODEL = "SmolLM2-135M-Instruct-Q4_1"
SHA = "a1" * 32
SMOL = HeldModel(MODEL, SHA, 30, 98 * MB)
GEMMA = HeldModel("gemma-3-270m-Q4_K_M", "b2" * 32, 18, 241 * MB)


def _telemetry(n: int = 60) -> tuple[TelemetryPoint, ...]:
    pts = []
    for i in range(n):
        wave = (i * 7) % 13  # a deterministic saw-tooth
        pts.append(
            TelemetryPoint(
                t=T0 + 2 * i,
                tokens_per_s=40.0 + 2.5 * wave,
                ttft_ms=None if i % 5 else 180.0 + 10 * wave,
                tpot_ms=24.0 - wave,
                hop_ms=0.7 + 0.05 * wave,
                link_bytes_per_s=150_000.0 + 9_000 * wave,
            )
        )
    return tuple(pts)


def make_snapshot() -> NodeSnapshot:
    me = NodeInfo(
        node_id="n-alpha",
        name="alpha",
        mesh_id="mesh-1234",
        address="192.168.1.10:7400",
        http_url="http://127.0.0.1:8642/v1",
        capabilities=Capabilities(free_ram_bytes=int(7.5 * GB), backend="cpu", cores=8, models=(SMOL,)),
        version="0.1.0",
    )
    peers = (
        PeerInfo("n-bravo", "bravo", "192.168.1.11:7400", 0.82, True,
                 Capabilities(int(11.2 * GB), 0, "cpu", 4, (SMOL,)), "S1 [10,20)", 182_000.0, 176_000.0),
        PeerInfo("n-charlie", "charlie", "192.168.1.12:7400", 1.94, True,
                 Capabilities(int(30.1 * GB), 24 * GB, "cuda", 16, (SMOL, GEMMA)), "S2 [20,30)",
                 175_000.0, 12_000.0),
        PeerInfo("n-delta", "delta", "192.168.1.13:7400", None, False, None, "", 0.0, 0.0),
    )
    stages = (
        StageInfo(0, "n-alpha", "alpha", 0, 10, StageState.READY),
        StageInfo(1, "n-bravo", "bravo", 10, 20, StageState.READY),
        StageInfo(2, "n-charlie", "charlie", 20, 30, StageState.LOADING, "loading 62%"),
    )
    requests = (
        RequestInfo("req-0007", MODEL, RequestStatus.DECODING, 412, 87, 51.3, 184.0, T0 + 110.0, None, "ngram"),
        RequestInfo("req-0006", MODEL, RequestStatus.PREFILL, 1900, 0, 0.0, None, T0 + 118.5, None, ""),
        RequestInfo("req-0005", MODEL, RequestStatus.DONE, 96, 256, 63.8, 142.5, T0 + 60.0, T0 + 64.2, "ngram"),
        RequestInfo("req-0004", MODEL, RequestStatus.ERROR, 50, 3, 12.0, 201.0, T0 + 40.0, T0 + 40.5, ""),
        RequestInfo("req-0003", MODEL, RequestStatus.CANCELLED, 33, 12, 44.1, 150.2, T0 + 20.0, T0 + 21.0, "draft"),
    )
    spec = (
        SpecStats("ngram", SpecState.ENABLED, 1840, 1214, 310, 6, 31.4, 96, 71,
                  step_ms=((0, 15.2), (1, 16.8), (2, 19.7), (3, 19.5)), acceptance_estimate=0.81),
        SpecStats("draft", SpecState.COLD, 96, 40, 24, 4, 22.9),
    )
    models = (
        ModelInfo(MODEL, "/home/u/.cache/meshnode/models/smollm2.gguf", SHA, 30, 98 * MB, "llama"),
        ModelInfo(f"{MODEL} [0,10)", "/home/u/.cache/meshnode/slices/smollm2-0-10.gguf", "c3" * 32, 30,
                  36 * MB, "llama", "slice", (0, 10)),
        ModelInfo(f"{MODEL} [20,30)", "/home/u/.cache/meshnode/slices/smollm2-20-30.gguf", "d4" * 32, 30,
                  41 * MB, "llama", "slice", (20, 30), "peer:charlie"),
    )
    transfers = (
        TransferInfo("gemma-3-270m-Q4_K_M.gguf", 151 * MB, 241 * MB, "download"),
        TransferInfo("smollm2 [20,30) -> charlie", 25 * MB, 41 * MB, "transfer"),
    )
    mesh_models = (
        MeshModel(MODEL, "n-alpha", "alpha", 2048, local=True),
        MeshModel("gemma-3-270m-q4_k_m", "n-charlie", "charlie", 4096),
    )
    return NodeSnapshot(me, peers, MODEL, 30, stages, requests, spec, _telemetry(), models, transfers,
                        mesh_models=mesh_models)


def make_events() -> list[NodeEvent]:
    d = DraftVerified
    return [
        LogEmitted(logging.INFO, "meshnode.node", "node alpha listening on 192.168.1.10:7400", T0 + 1),
        LogEmitted(logging.DEBUG, "meshnode.net", "mDNS announce sent", T0 + 1.5),
        LogEmitted(logging.INFO, "meshnode.mesh", "peer bravo joined (rtt 0.8 ms)", T0 + 2),
        LogEmitted(logging.WARNING, "meshnode.net", "peer delta failed authentication", T0 + 3),
        d("req-0007", "ngram", ("def", " fib", "(n", "):"), 4, "\n", T0 + 111),
        d("req-0007", "ngram", ("    if", " n", " <", " 2"), 2, " <=", T0 + 112),
        d("req-0007", "ngram", (":", "\n", "        return"), 3, " n", T0 + 113),
        d("req-0007", "draft", ("    return", " fib", "(n", " -", " 2"), 1, " f", T0 + 114),
        d("req-0007", "ngram", ("(n", " -", " 1", ")"), 0, "ib", T0 + 115),
        LogEmitted(logging.ERROR, "meshnode.serve", "request req-0004 failed: context overflow", T0 + 40.5),
        LogEmitted(logging.INFO, "meshnode.spec", "ngram: window 4 -> 6", T0 + 116),
    ]


class FakeNode:
    """NodeAPI with a fixed snapshot; ``events()`` yields the scripted events then idles."""

    def __init__(self, snapshot: NodeSnapshot | None = None, events: Sequence[NodeEvent] | None = None,
                 http_url: str | None = None) -> None:
        self._snapshot = snapshot or make_snapshot()
        self.scripted = list(make_events() if events is None else events)
        if http_url is not None:
            self._snapshot = replace(self._snapshot, node=replace(self._snapshot.node, http_url=http_url))
        self.started = False
        self.stopped = False

    @property
    def http_url(self) -> str:
        return self._snapshot.node.http_url

    def snapshot(self) -> NodeSnapshot:
        return self._snapshot

    def set_snapshot(self, snap: NodeSnapshot) -> None:
        self._snapshot = snap

    async def events(self) -> AsyncIterator[NodeEvent]:
        for ev in self.scripted:
            yield ev
        await asyncio.Event().wait()  # a live node's stream never ends

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


async def save_readme_screenshots(out_dir: str) -> list[str]:
    """Write the README screenshots (Mesh and Speculation at 100x30) into ``out_dir``."""
    import datetime as dt

    from ui.app import make_app

    node = FakeNode()
    app = make_app(node, clock=lambda: NOW, tz=dt.timezone.utc, cursor_blink=False)
    paths = []
    async with app.run_test(size=(100, 30)) as pilot:
        while app.feed.events_seen < len(node.scripted):
            await pilot.pause(0.05)
        await pilot.pause(0.3)
        paths.append(app.save_screenshot("tui-mesh.svg", out_dir))
        await pilot.press("3")
        await pilot.pause(0.3)
        paths.append(app.save_screenshot("tui-speculation.svg", out_dir))
    return paths


if __name__ == "__main__":
    import sys

    print("\n".join(asyncio.run(save_readme_screenshots(sys.argv[1] if len(sys.argv) > 1 else "assets"))))
