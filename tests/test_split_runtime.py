"""Stage negotiation over real QUIC + mDNS on loopback with real llama.cpp stages.

Several nodes (fabric + StageServerRuntime + CoordinatorRuntime each, own home with the
SmolLM2 model in its store) run in one process. The coordinator plans a split, the
negotiation reaches PlanReady, and greedy decoding through the MeshPipeline equals the
whole model on one node token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from meshnode.mesh.coordinator import CoordinatorRuntime
from meshnode.mesh.fabric import MeshFabric
from meshnode.mesh.pipeline import LocalPipeline, MeshPipeline, Step
from meshnode.mesh.planner import PlanError
from meshnode.mesh.runtime import (
    NegotiationError,
    ServeOptions,
    TermStore,
    model_shape,
    node_capabilities,
)
from meshnode.mesh.stage_control_coordinator import CoordinatorState
from meshnode.mesh.stage_server import StageServerRuntime
from meshnode.net.secret import new_secret
from meshnode.paths import NodePaths
from meshnode.state import StageChanged, StageState
from nodeproc import lo_multicast, until

pytestmark = [pytest.mark.net, pytest.mark.slow]

log = logging.getLogger(__name__)

N_CTX, N_BATCH, N_NEW = 512, 64, 24
PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Explain in a few sentences why the sky is blue, and then why sunsets are red. Mention "
    "Rayleigh scattering, the wavelength of light and the path through the atmosphere.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
SECRET = new_secret()


def _opts(**kw) -> ServeOptions:
    return ServeOptions(n_ctx=N_CTX, n_batch=N_BATCH, n_seq_max=1, **kw)


def _install(model, paths: NodePaths) -> None:
    """Put ``model`` (and its hash record) into the store of ``paths`` (hardlink or copy)."""
    folder = paths.models / model.name
    folder.mkdir(parents=True, exist_ok=True)
    for src in (model.path, model.path.with_name(model.path.name + ".meta.json")):
        dest = folder / src.name
        if dest.exists():
            continue
        try:
            os.link(src, dest)
        except OSError:
            shutil.copy2(src, dest)


@pytest.fixture(scope="module")
def homes(tmp_path_factory, smollm2) -> dict[str, NodePaths]:
    """Homes a, b, c hold the model; d holds none. Module-scoped: slices are reused."""
    root = tmp_path_factory.mktemp("split")
    out = {}
    for name in "abcd":
        paths = NodePaths.resolve(root / name).ensure()
        if name != "d":
            _install(smollm2, paths)
        out[name] = paths
    return out


@pytest.fixture(scope="module")
def prompt_tokens(smollm2) -> list[int]:
    from meshnode.engine.tokenizer import Tokenizer

    tok = Tokenizer(smollm2.path)
    try:
        return tok.encode(PROMPT, add_bos=False)
    finally:
        tok.close()


@pytest.fixture(scope="module")
def reference(smollm2, prompt_tokens) -> list[int]:
    """Greedy tokens of the whole model on one node (LocalPipeline), same batch schedule."""
    from meshnode.engine import EngineConfig
    from meshnode.engine.worker import EngineWorker

    async def run() -> list[int]:
        config = EngineConfig(smollm2.path, n_ctx=N_CTX, n_batch=N_BATCH, n_seq_max=1, n_threads=1)
        pipe = LocalPipeline(await EngineWorker.load(config))
        try:
            return await _greedy(pipe, prompt_tokens)
        finally:
            await pipe.close()

    return asyncio.run(run())


async def _greedy(pipeline, prompt: list[int], n: int = N_NEW, session: int = 7) -> list[int]:
    """Prefill in chunks of N_BATCH, then decode one token per step."""
    pos, res = 0, None
    for i in range(0, len(prompt), N_BATCH):
        chunk = np.asarray(prompt[i:i + N_BATCH], dtype=np.int32)
        last = i + N_BATCH >= len(prompt)
        res = await pipeline.run([Step(session, pos, chunk, n_logits=1 if last else 0)])
        pos += len(chunk)
    out = [res[0].tokens[-1]]
    while len(out) < n:
        res = await pipeline.run([Step(session, pos, np.asarray(out[-1:], dtype=np.int32), n_logits=1)])
        pos += 1
        out.append(res[0].tokens[-1])
    await pipeline.end_session(session)
    return out


class _Node:
    """What node.py wires together: fabric, stage server, coordinator, one dispatcher."""

    def __init__(self, name: str, paths: NodePaths, static: list[str]) -> None:
        self.name = name
        self.fabric = MeshFabric(paths, secret=SECRET, interfaces=["127.0.0.1"], name=name,
                                 capabilities=node_capabilities(paths), static_peers=static,
                                 discovery=not static)
        self.coord_events: list[StageChanged] = []
        self.server_events: list[StageChanged] = []
        self.server = StageServerRuntime(self.fabric, paths, n_threads=1, publish=self.server_events.append)
        self.coord = CoordinatorRuntime(self.fabric, paths, n_threads=1, publish=self.coord_events.append)
        self.unhandled: list = []
        self.drop_forwards = False
        self.fabric.on_message(self._dispatch)

    def _dispatch(self, node_id: str, msg) -> None:
        if self.drop_forwards and type(msg).__name__ == "Forward":
            return
        # node.py asks the coordinator first; the order does not matter for these tests
        if not (self.server.handle(node_id, msg) or self.coord.handle(node_id, msg)):
            self.unhandled.append(msg)

    @property
    def id(self) -> str:
        return self.fabric.node_id


@contextlib.asynccontextmanager
async def _mesh(homes: dict[str, NodePaths], names: str):
    use_mdns = lo_multicast()
    nodes: list[_Node] = []
    try:
        for name in names:
            static = [] if use_mdns else [f"127.0.0.1:{n.fabric.port}" for n in nodes]
            node = _Node(name, homes[name], static)
            await node.fabric.start()
            nodes.append(node)
        await until(lambda: all(len(n.fabric.peers()) == len(nodes) - 1 for n in nodes), 10.0)
        yield nodes
    finally:
        for n in nodes:
            with contextlib.suppress(Exception):
                await n.coord.close()
        for n in nodes:
            with contextlib.suppress(Exception):
                await n.server.close()
        for n in nodes:
            await n.fabric.stop()


def _states(events: list[StageChanged], index: int) -> list[str]:
    """The distinct consecutive states stage ``index`` went through."""
    out: list[str] = []
    for ev in events:
        if ev.stage.index == index and (not out or out[-1] != ev.stage.state.value):
            out.append(ev.stage.state.value)
    return out


async def _split_and_decode(homes, names: str, split: int, reference, prompt_tokens) -> None:
    async with _mesh(homes, names) as nodes:
        coord, peers = nodes[0], nodes[1:]
        sm = await coord.coord.start_model(coord_model(homes[coord.name]), _opts(split=split))
        assert sm.state is CoordinatorState.READY
        assert [s.node_id for s in sm.plan.stages][0] == coord.id
        assert {s.node_id for s in sm.plan.stages[1:]} == {p.id for p in peers}
        assert [(s.start, s.end) for s in sm.plan.stages][0][0] == 0 and sm.plan.stages[-1].end == 30
        assert isinstance(sm.pipeline, MeshPipeline) and sm.pipeline.n_stages == split
        assert [s.state for s in sm.stages()] == [StageState.READY] * split

        # negotiation order: remote stages assigned -> preparing -> loading -> ready,
        # stage 0 assigned -> loading -> ready; it loads from the start, the others as
        # soon as their slices are present (the loads overlap).
        ev = coord.coord_events
        assert _states(ev, 0) == ["assigned", "loading", "ready"]
        for i in range(1, split):
            assert _states(ev, i) == ["assigned", "preparing", "loading", "ready"]
        order = [(e.stage.index, e.stage.state.value) for e in ev if e.stage.state.value in ("loading", "ready")]
        assert order[0] == (0, "loading")
        assert sorted(order) == sorted((i, st) for i in range(split) for st in ("loading", "ready"))
        for p in peers:
            (st,) = p.server.stages()
            assert st.state is StageState.READY and p.server.holds_engine
            assert [s.value for s in dict.fromkeys(e.stage.state for e in p.server_events)] == [
                "assigned", "preparing", "loading", "ready"]

        got = await _greedy(sm.pipeline, prompt_tokens)
        assert got == reference
        # the decode steps (not the prefill chunks) took the fast lane, and none was lost
        assert sm.pipeline.lane_steps == N_NEW - 1 and sm.pipeline.lane_resends == 0

        await sm.stop("test done")
        assert coord.coord.serving is None and coord.coord.stages() == []
        for p in peers:
            await p.server.wait_idle()
            (st,) = p.server.stages()
            assert st.state is StageState.STOPPED and not p.server.holds_engine
        assert not any(type(m).__name__ in ("Error", "DataError") for n in nodes for m in n.unhandled)


def coord_model(paths: NodePaths):
    from meshnode.models.store import list_models

    (ref,) = list_models(paths)
    return ref


async def test_split2_matches_whole_model(homes, reference, prompt_tokens):
    await _split_and_decode(homes, "ab", 2, reference, prompt_tokens)


async def test_split3_matches_whole_model(homes, reference, prompt_tokens):
    await _split_and_decode(homes, "abc", 3, reference, prompt_tokens)


async def test_a_replan_on_the_same_ranges_takes_the_engines_back_exactly(homes, reference, prompt_tokens,
                                                                         monkeypatch):
    """A failover that keeps the layer ranges (replan.substitute) re-plans onto the same
    slices: stage 0 and the stage servers take back the engines they freed (reset, no
    load) and the tokens stay exact; a plan of other ranges loads afresh."""
    async with _mesh(homes, "abc") as nodes:
        coord, peers = nodes[0], nodes[1:]
        model = coord_model(homes[coord.name])
        sm = await coord.coord.start_model(model, _opts(split=3))
        assert await _greedy(sm.pipeline, prompt_tokens) == reference
        plan = sm.plan
        await sm.stop("re-plan")
        for p in peers:
            await p.server.wait_idle()
            assert not p.server.holds_engine and p.server.shelf.held_bytes() > 0
        # a Load is sized with the parked engine's memory counted as free (it is reused
        # as it is, or freed before anything else loads)
        import types

        import meshnode.mesh.stage_server as stage_server_mod
        monkeypatch.setattr(stage_server_mod, "local_capabilities",
                            lambda: types.SimpleNamespace(free_ram_bytes=1 << 30))
        p = peers[0]
        limits = p.server._limits(model.path, model.path, plan.stages[1].start, plan.stages[1].end)
        assert limits.budget_bytes == (1 << 30) + p.server.shelf.held_bytes()
        monkeypatch.undo()
        sm = await coord.coord.start_model(model, _opts(split=3), keep=plan)
        assert [(s.node_id, s.start, s.end) for s in sm.plan.stages] == [
            (s.node_id, s.start, s.end) for s in plan.stages]
        assert coord.coord.shelf.reused == 1 and [p.server.shelf.reused for p in peers] == [1, 1]
        assert await _greedy(sm.pipeline, prompt_tokens) == reference
        await sm.stop("re-plan")
        sm = await coord.coord.start_model(model, _opts(split=2))
        assert (sm.plan.stages[0].start, sm.plan.stages[0].end) != (plan.stages[0].start, plan.stages[0].end)
        assert coord.coord.shelf.reused == 1
        assert await _greedy(sm.pipeline, prompt_tokens) == reference
        await sm.stop("test done")


async def test_lost_lane_frames_are_resent_and_the_tokens_stay_exact(homes, reference, prompt_tokens,
                                                                   monkeypatch, caplog):
    import meshnode.mesh.pipeline as pipeline_mod

    monkeypatch.setattr(pipeline_mod, "LANE_RETRY_MIN_S", 0.1)
    async with _mesh(homes, "ab") as (a, b):
        sm = await a.coord.start_model(coord_model(homes["a"]), _opts(split=2))
        await until(lambda: a.fabric.lane_ready(b.id) and b.fabric.lane_ready(a.id), 5.0)
        # every 4th lane packet reaching either node is lost: Forwards at b, TokenReturns at a
        for node in (a, b):
            def lossy(data, addr, take=node.fabric.lane_datagram, seen=[0]):
                seen[0] += 1
                if seen[0] % 4:
                    take(data, addr)
            node.fabric.lane_datagram = lossy
        resent = sm.pipeline.lane_resends
        got = await _greedy(sm.pipeline, prompt_tokens)
        assert got == reference
        # a frame in four lost is a path QUIC serves faster: the second loss switched the
        # lane off (lane_control.py), and the steps after it took the stream
        assert sm.pipeline.lane_resends - resent >= 2
        assert "using QUIC streams" in caplog.text
        await sm.stop("test done")


async def test_one_session_failing_at_the_final_stage_leaves_its_batch_neighbour_exact(
        homes, reference, prompt_tokens, monkeypatch):
    """#17 finding 6 on a split: two sessions decode in the same batches; the final
    stage's sampler fails on purpose for one of them (its seed marks it). That step alone
    fails (a DataError naming its session, then the TokenReturn of the other); the other
    session decodes on with exactly the whole model's greedy tokens."""
    from meshnode.mesh.final import FinalSampler, Sampling
    from meshnode.mesh.pipeline import StepFailedError

    poison = 666
    real = FinalSampler.finalize
    calls: list[int] = []

    def finalize(self, session, logits, drafts, sampling: Sampling, *rest):
        if sampling.seed == poison:
            calls.append(session)
            if len(calls) >= 3:          # prefill, then decodes beside the other session
                raise ValueError("sampling poisoned on purpose")
        return real(self, session, logits, drafts, sampling, *rest)

    monkeypatch.setattr(FinalSampler, "finalize", finalize)
    good, bad = 7, 8
    bad_sampling = Sampling(seed=poison)   # greedy; the seed only marks it
    async with _mesh(homes, "ab") as (a, b):
        sm = await a.coord.start_model(coord_model(homes["a"]),
                                       ServeOptions(n_ctx=N_CTX, n_batch=N_BATCH, n_seq_max=2, split=2))
        pipe = sm.pipeline
        # prefill both (the good one in the reference's chunks)
        pos, res = 0, None
        for i in range(0, len(prompt_tokens), N_BATCH):
            chunk = np.asarray(prompt_tokens[i:i + N_BATCH], dtype=np.int32)
            res = await pipe.run([Step(good, pos, chunk, n_logits=1 if i + N_BATCH >= len(prompt_tokens) else 0)])
            pos += len(chunk)
        out = [res[0].tokens[-1]]
        bad_prompt = np.asarray(prompt_tokens[:20], dtype=np.int32)
        (r,) = await pipe.run([Step(bad, 0, bad_prompt, sampling=bad_sampling)])
        bad_last, bad_pos, failed = r.tokens[-1], len(bad_prompt), None
        shared = 0
        while len(out) < N_NEW:
            steps = [Step(good, pos, np.asarray(out[-1:], dtype=np.int32))]
            if failed is None:
                steps.append(Step(bad, bad_pos, np.asarray([bad_last], dtype=np.int32), sampling=bad_sampling))
            results = await pipe.run(steps)
            pos += 1
            assert not isinstance(results[0], Exception), results[0]
            out.append(results[0].tokens[-1])
            if len(results) == 2:
                shared += 1
                if isinstance(results[1], StepFailedError):
                    failed = results[1]
                    await pipe.end_session(bad)
                else:
                    bad_last, bad_pos = results[1].tokens[-1], bad_pos + 1
        await pipe.end_session(good)
        assert out == reference
        assert isinstance(failed, StepFailedError) and failed.session == bad
        assert "poisoned on purpose" in str(failed) and shared == 2
        assert not any(type(m).__name__ in ("Error", "DataError") for n in (a, b) for m in n.unhandled)
        await sm.stop("test done")


async def test_single_stage_is_local(homes, reference, prompt_tokens):
    async with _mesh(homes, "a") as (a,):
        sm = await a.coord.start_model(coord_model(homes["a"]), _opts(split=1))
        assert isinstance(sm.pipeline, LocalPipeline) and sm.plan.n_stages == 1
        assert await _greedy(sm.pipeline, prompt_tokens) == reference
        await sm.stop()


async def test_second_coordinator_is_fenced_then_busy(homes):
    async with _mesh(homes, "abc") as (a, b, c):
        TermStore(homes["a"]).advance_to(1000)
        TermStore(homes["c"]).advance_to(10)
        sm = await a.coord.start_model(coord_model(homes["a"]), _opts(explicit="a=0:15,b=15:30"))
        assert sm.term == 1001 and b.server.control.term == 1001
        # c claims b with a stale term: FENCED, and b keeps serving a.
        with pytest.raises(NegotiationError) as err:
            await c.coord.start_model(coord_model(homes["c"]), _opts(explicit="c=0:15,b=15:30"))
        assert err.value.stage_index == 1 and "fenced" in err.value.reason
        assert b.server.stages()[0].state is StageState.READY and b.server.holds_engine
        # a higher term cannot take a node that serves someone else either: BUSY.
        TermStore(homes["c"]).advance_to(5000)
        with pytest.raises(NegotiationError) as err:
            await c.coord.start_model(coord_model(homes["c"]), _opts(explicit="c=0:15,b=15:30"))
        assert "busy" in err.value.reason
        assert b.server.control.coordinator_id == a.id
        # once a stops, c's higher term claims b.
        await sm.stop()
        await b.server.wait_idle()
        sm2 = await c.coord.start_model(coord_model(homes["c"]), _opts(explicit="c=0:15,b=15:30"))
        assert sm2.term == 5002 and b.server.control.coordinator_id == c.id
        await sm2.stop()


async def test_model_not_held_by_peer(homes):
    async with _mesh(homes, "ad") as (a, d):
        model = coord_model(homes["a"])
        # automatic plans only consider peers that hold the model
        with pytest.raises(PlanError, match="do not hold"):
            await a.coord.start_model(model, _opts(split=2))
        # an explicit plan names d anyway: d refuses with a clear reason
        with pytest.raises(NegotiationError) as err:
            await a.coord.start_model(model, _opts(explicit="a=0:15,d=15:30"))
        assert err.value.stage_index == 1
        assert "is not in the store of d" in err.value.reason
        assert [s.state for s in a.coord.stages()] == []   # forgotten after the failure
        await d.server.wait_idle()
        (st,) = d.server.stages()   # FAILED, then STOPPED by the coordinator's Stop
        assert st.state is StageState.STOPPED and "not in the store of d" in st.detail
        assert [e.stage.state.value for e in d.server_events][-2:] == ["failed", "stopped"]
        assert not d.server.holds_engine


def test_term_store_is_persistent_and_increasing(tmp_path):
    paths = NodePaths.resolve(tmp_path / "n").ensure()
    assert TermStore(paths).next_term() == 1
    assert TermStore(paths).next_term() == 2          # a "restarted" coordinator
    assert TermStore(paths).advance_to(1) == 2        # never lowered
    assert TermStore(paths).next_term() == 3


def test_model_shape_of_smollm2(smollm2):
    shape = model_shape(smollm2.path, 512)
    assert shape.n_layers == 30 and shape.n_embd == 576
    assert shape.kv_bytes_per_token == 3 * 64 * 2 * 2      # n_head_kv * head_dim * (K+V) * f16
    assert shape.embed_bytes > 0 and shape.head_bytes >= shape.embed_bytes   # tied head
    assert sum(shape.layer_bytes) + shape.embed_bytes < Path(smollm2.path).stat().st_size


def test_a_gguf_header_is_parsed_once_per_version_of_the_file(smollm2, tmp_path, monkeypatch):
    """A re-plan asks every stage server for its load limits and the coordinator for the
    model's shape; the header (tokenizer arrays included) is parsed once, and again only
    when the file changes."""
    import meshnode.models.gguf_info as gguf_info
    from meshnode.mesh.runtime import load_limits, trained_context

    copy = tmp_path / "m.gguf"
    shutil.copyfile(smollm2.path, copy)
    opened: list = []
    real = gguf_info.open_gguf
    monkeypatch.setattr(gguf_info, "open_gguf", lambda p: opened.append(p) or real(p))
    first = model_shape(copy, 512)
    lim = load_limits(copy, copy, 10, 20, budget_bytes=1 << 30)
    assert trained_context(copy) == lim.n_ctx_train > 0
    assert model_shape(copy, 512) == first and len(opened) == 1
    assert lim.kv_bytes_per_cell == first.kv_bytes_per_token * 10 and lim.n_vocab == 0
    os.utime(copy, ns=(1, 1))                      # another version of the file
    assert model_shape(copy, 512) == first and len(opened) == 2


def test_a_node_parses_its_models_headers_ahead_of_need(smollm2, model_store_paths, monkeypatch):
    import meshnode.mesh.runtime as runtime
    import meshnode.models.gguf_info as gguf_info

    monkeypatch.setattr(runtime, "_headers", {})
    runtime.warm_headers(model_store_paths)           # (Node does it when it advertises its models)
    monkeypatch.setattr(gguf_info, "open_gguf", lambda p: pytest.fail(f"{p} parsed again"))
    assert model_shape(smollm2.path, 512).n_layers == 30


async def test_stage_node_lost_fails_the_plan(homes):
    from meshnode.mesh.pipeline import PipelineUnavailableError

    async with _mesh(homes, "ab") as (a, b):
        sm = await a.coord.start_model(coord_model(homes["a"]), _opts(split=2))
        pipe = sm.pipeline
        b.drop_forwards = True                     # the step below waits for its tokens
        waiting = asyncio.ensure_future(pipe.run([Step(3, 0, np.asarray([1, 2, 3], np.int32))]))
        await until(lambda: pipe._pending, 5.0)  # noqa: SLF001 - the Forward went out
        await b.fabric.stop()                      # the stage's node leaves the mesh
        await until(lambda: sm.state is CoordinatorState.FAILED, 5.0)
        assert sm.stages()[1].state is StageState.FAILED and "link lost" in sm.failure
        assert sm.stages()[0].state is StageState.STOPPED
        with pytest.raises(PipelineUnavailableError):
            await waiting
        with pytest.raises(PipelineUnavailableError, match="link lost"):   # stage 0 was freed too
            await pipe.run([Step(4, 0, np.asarray([1], np.int32))])
        # b lost its coordinator (its own links closed): its stage fails and frees the engine
        await until(lambda: b.server.stages()[0].state is StageState.FAILED, 5.0)
        await b.server.wait_idle()
        assert "coordinator" in b.server.stages()[0].detail and not b.server.holds_engine
        await sm.stop()
