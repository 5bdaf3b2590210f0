"""EngineShelf: an engine freed by one owner is taken back by the next load of the same
config (pure logic, fake engines); the real engines and a re-plan: test_split_runtime.py,
test_failover.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshnode.engine import EngineConfig, EngineError
from meshnode.engine.shelf import EngineShelf
from meshnode.engine.worker import EngineWorker


@dataclass
class _Engine:
    config: EngineConfig
    sessions: list[int] = field(default_factory=lambda: [1, 2])
    closed: bool = False
    fail_reset: bool = False
    copies_queued: bool = False

    def threads_for(self, rows: int) -> int:
        return 1

    def reset(self) -> None:
        if self.fail_reset:
            raise RuntimeError("llama.cpp refused")
        self.sessions = []

    def close(self) -> None:
        self.closed = True

    def work(self) -> str:
        return "done"


A = EngineConfig(Path("a.gguf"), n_ctx=64)
B = EngineConfig(Path("b.gguf"), n_ctx=64)


@pytest.fixture
def loads(monkeypatch) -> list[_Engine]:
    """Every fresh load makes a fake engine (listed here) instead of calling llama.cpp."""
    made: list[_Engine] = []

    async def load(cls, config, name="engine", **kw):
        made.append(_Engine(config))
        return cls(made[-1], name, **kw)

    monkeypatch.setattr(EngineWorker, "load", classmethod(load))
    return made


def test_a_freed_engine_is_reset_and_taken_back_by_the_same_config(loads):
    async def go():
        shelf = EngineShelf()
        w1 = await shelf.load(A, "stage1", held_bytes=1000)
        await w1.step(1, w1.engine.work)           # measured: the new owner keeps it
        await w1.close()                           # parks
        assert shelf.held_bytes() == 1000 and shelf.holds(A)
        assert loads[0].sessions == [] and not loads[0].closed
        w2 = await shelf.load(A, "stage1")
        assert w2.engine is loads[0] and len(loads) == 1 and shelf.reused == 1
        assert w2.runs_inline(1)                   # its step timings came along
        assert shelf.held_bytes() == 0
        # the old owner's worker refuses every call: it can never compute on the new KV
        with pytest.raises(EngineError, match="another owner"):
            await w1.step(1, w1.engine.work)
        with pytest.raises(EngineError, match="another owner"):
            await w1.call(w1.engine.work)
        assert not w1.runs_inline(1)
        await w1.close()                           # a no-op: not its engine any more
        assert not loads[0].closed
        await shelf.close()
        await w2.close()                           # the shelf is closed: really closed
        assert loads[0].closed

    asyncio.run(go())


def test_a_load_of_another_config_closes_the_parked_engines_first(loads):
    async def go():
        shelf = EngineShelf()
        w = await shelf.load(A, "s")
        await w.close()
        await shelf.load(B, "s")
        assert loads[0].closed and len(loads) == 2 and shelf.reused == 0
        assert shelf.held_bytes() == 0 and not shelf.holds(A)

    asyncio.run(go())


def test_a_parked_engine_is_closed_after_keep_s(loads):
    async def go():
        shelf = EngineShelf(keep_s=0.05)
        w = await shelf.load(A, "s")
        await w.close()
        await asyncio.sleep(0.2)
        assert loads[0].closed and not shelf.holds(A)
        await shelf.load(A, "s")
        assert len(loads) == 2 and shelf.reused == 0

    asyncio.run(go())


def test_an_engine_that_cannot_be_reset_is_closed_not_kept(loads):
    async def go():
        shelf = EngineShelf()
        w = await shelf.load(A, "s")
        loads[0].fail_reset = True
        await w.close()
        assert loads[0].closed and not shelf.holds(A)

    asyncio.run(go())


def test_a_load_waits_for_an_engine_on_its_way_to_the_shelf(loads):
    """A re-plan's Load can arrive while the old stage's engine is still being parked."""
    async def go():
        shelf = EngineShelf()
        w = await shelf.load(A, "s")
        parking = asyncio.ensure_future(w.close())
        await asyncio.sleep(0)                     # the reset is running on the thread
        w2 = await shelf.load(A, "s")
        await parking
        assert w2.engine is loads[0] and len(loads) == 1

    asyncio.run(go())


def test_closing_twice_parks_once_and_keep_0_never_parks(loads):
    async def go():
        shelf = EngineShelf()
        w = await shelf.load(A, "s")
        await asyncio.gather(w.close(), w.close())
        assert shelf.holds(A) and shelf.held_bytes() == 0
        off = EngineShelf(keep_s=0)
        w = await off.load(B, "s")
        await w.close()
        assert loads[-1].closed and not off.holds(B)

    asyncio.run(go())


def test_a_node_advertises_its_parked_engines_memory_as_free(tmp_path, monkeypatch):
    """Peers plan with it: a parked engine is closed before anything else loads."""
    import dataclasses

    import meshnode.mesh.runtime as runtime
    from meshnode.paths import NodePaths

    real = runtime.local_capabilities   # free RAM fixed: the test compares readings
    monkeypatch.setattr(runtime, "local_capabilities",
                        lambda held=(): dataclasses.replace(real(held), free_ram_bytes=4 << 30))
    paths = NodePaths.resolve(tmp_path / "home").ensure()
    parked = runtime.node_capabilities(paths, models=[], parked_bytes=(256 << 20) + 5)
    assert parked["free_ram"] == (4 << 30) + (256 << 20)
    capped = runtime.node_capabilities(paths, models=[], parked_bytes=1 << 40, max_memory=1 << 30)
    assert capped["free_ram"] == 1 << 30     # --max-memory still caps it


def test_a_parked_gpu_engine_gives_back_the_vram_its_load_took(loads, monkeypatch):
    """On a GPU the device memory a load took (free VRAM before against after) comes back
    to the node's free VRAM while the engine is parked, across owners; a CPU engine's
    load is not measured."""
    import dataclasses

    import meshnode.engine.shelf as shelf_mod

    free = iter([10 << 30, 7 << 30])            # before and after the GPU engine's load
    monkeypatch.setattr(shelf_mod, "_free_vram", lambda: next(free))
    gpu = dataclasses.replace(A, gpu_layers=99)

    async def go():
        shelf = EngineShelf()
        w = await shelf.load(gpu, "s", held_bytes=100)
        assert w.held_vram == 3 << 30 and shelf.held_vram() == 0   # in use: not free
        await w.close()
        assert shelf.held_vram() == 3 << 30 and shelf.held_bytes() == 100
        w2 = await shelf.load(gpu, "s")            # taken back, parked again: still known
        assert shelf.held_vram() == 0
        await w2.close()
        assert shelf.held_vram() == 3 << 30
        cpu = await shelf.load(B, "s")             # another config: the GPU engine closes
        assert shelf.held_vram() == 0 and cpu.held_vram == 0
        await shelf.close()

    asyncio.run(go())


def test_a_node_advertises_its_parked_engines_vram_as_free_only_with_a_gpu(tmp_path, monkeypatch):
    import dataclasses

    import meshnode.mesh.runtime as runtime
    from meshnode.paths import NodePaths

    paths = NodePaths.resolve(tmp_path / "home").ensure()
    real = runtime.local_capabilities
    for backend, vram, want in (("cuda", 8 << 30, (8 << 30) + (512 << 20)), ("cpu", 0, 0)):
        monkeypatch.setattr(runtime, "local_capabilities", lambda held=(), b=backend, v=vram:
                            dataclasses.replace(real(held), backend=b, free_vram_bytes=v))
        caps = runtime.node_capabilities(paths, models=[], parked_vram=(512 << 20) + 7)
        assert caps["free_vram"] == want, (backend, caps["free_vram"])
