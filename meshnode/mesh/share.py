"""Model sharing between members: answering pulls, pulling whole models and layer packages.

Theory of operation
-------------------
Holder side: a ``ShareRequest`` from a member (the fabric only delivers messages of
authenticated links) names a model by sha256, whole or a layer range. When sharing is on
and the model is in this node's store, the answer is a ``ShareTicket``: the
:class:`~meshnode.models.transfer.Manifest` of the file (a layer package is the slice the
:class:`~meshnode.models.slicer.SliceCache` builds; slicing is deterministic, so every holder
produces the same bytes and the same manifest), the bulk channel's TCP port, this node's
certificate fingerprint and one single-use ticket per parallel connection. Anything else is
refused with an ``Error`` saying why (sharing off, unknown sha256, a range out of bounds).

Puller side (:meth:`ShareService.pull`): ask every candidate source for a ticket, keep the
sources whose manifest equals the first one's (for a whole model it must also name the
requested sha256), check free space, then run :data:`STREAMS` connection threads per
source over :class:`~meshnode.models.transfer.ChunkPlan` into a
:class:`~meshnode.models.transfer.PartFile`; each chunk is verified before it is written.
Two pulls of the same thing share one task. Cancelling the pull stops the threads between
chunks and keeps the part file for a later resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshnode import state, wire
from meshnode.errors import MeshnodeError
from meshnode.mesh.fabric_api import Fabric
from meshnode.mesh.runtime import find_held_model
from meshnode.models.errors import ModelFileError, SliceRangeError, UnsupportedArchitectureError
from meshnode.fsutil import sha256_files
from meshnode.gguf_files import MAX_SPLIT_PARTS, model_files, split_part_name
from meshnode.models.transfer import (
    CHUNK_SIZE,
    ChunkPlan,
    Manifest,
    PartFile,
    TransferError,
    cached_manifest,
    check_free_space,
    chunk_ok,
)
from meshnode.net.bulk import BulkClient, BulkError, BulkServer, TicketBook
from meshnode.net.identity import cert_fingerprint
from meshnode.paths import NodePaths

__all__ = ["ShareService", "TransferInfo", "TransferProgress"]

log = logging.getLogger(__name__)

STREAMS = 4                 # connections per source: their round trips and hashing overlap (1 Gbit link: 2 reached 0.66x of raw TCP, 4 reached 0.92x)
OFFER_TIMEOUT_S = 600.0     # a holder may have to slice a large model before it answers
PROGRESS_EVERY_S = 0.25
RATE_MIN_BYTES = 16 << 20     # pulls smaller than this do not update the measured fetch rate
RATE_EWMA = 0.5
SHARE_REF_BIT = 0x80000000


@dataclass(frozen=True, slots=True)
class TransferProgress:
    done: int
    total: int
    rate: float           # bytes/s over the transfer so far
    eta_s: float | None

    def describe(self) -> str:
        eta = f", ETA {self.eta_s:.0f} s" if self.eta_s is not None else ""
        return f"{self.done / 1e6:.0f}/{self.total / 1e6:.0f} MB ({self.rate / 1e6:.0f} MB/s{eta})"


ProgressCb = Callable[[TransferProgress], None]


@dataclass
class TransferInfo:
    """One pull in progress (for ``status``)."""

    name: str
    sha256: str
    what: str              # "model" or "layers [a, b)"
    sources: list[str]
    progress: TransferProgress | None = None
    listeners: list[ProgressCb] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        p = self.progress
        return {"name": self.name, "sha256": self.sha256, "what": self.what, "sources": self.sources,
                "done": p.done if p else 0, "total": p.total if p else 0,
                "rate": p.rate if p else 0.0, "eta_s": p.eta_s if p else None}


class _Refused(MeshnodeError):
    def __init__(self, code: wire.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _split_part(manifest: Any) -> tuple[int, int] | None:
    """(part, of how many) a holder's manifest says its file is of a split model, else None."""
    v = manifest.get("part") if isinstance(manifest, dict) else None
    if (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            and 1 <= v[0] <= v[1] <= MAX_SPLIT_PARTS and v[1] > 1):
        return v[0], v[1]
    return None


def split_hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class ShareService:
    """Both sides of model sharing on one node (module docstring)."""

    def __init__(self, fabric: Fabric, paths: NodePaths, *, enabled: bool = True,
                 streams: int = STREAMS, chunk_size: int = CHUNK_SIZE) -> None:
        self.fabric = fabric
        self.chunk_size = chunk_size
        self.paths = paths
        self.enabled = enabled
        self.streams = streams
        self.tickets = TicketBook()
        self._server: BulkServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._pulls: dict[tuple, asyncio.Task] = {}
        self.transfers: dict[tuple, TransferInfo] = {}
        # bytes/s of this node's latest pulls (EWMA; 0: none yet), advertised in its
        # capabilities: the planner's estimate of what a fetch here would take
        self.fetch_bytes_per_s = 0.0
        self.on_rate: Callable[[], None] | None = None   # called when it changes

    def progress(self) -> tuple[state.TransferInfo, ...]:
        """Pulls in progress as the snapshot's transfers (the TUI's transfers table)."""
        out = []
        for t in self.transfers.values():
            p = t.progress
            name = t.name if t.what == "model" else f"{t.name} {t.what}"
            out.append(state.TransferInfo(name, p.done if p else 0, p.total if p else 0, what="pull"))
        return tuple(out)

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self, port: int) -> None:
        """Listen for the bulk channel on TCP ``port`` (another port when it is taken)."""
        if self.enabled:
            self._server = await asyncio.to_thread(BulkServer, self.paths.identity, self.tickets, port=port)
            log.info("sharing models: bulk channel on TCP port %d", self._server.port)

    async def close(self) -> None:
        for t in list(self._tasks) + list(self._pulls.values()):
            t.cancel()
        for t in list(self._tasks) + list(self._pulls.values()):
            with contextlib.suppress(BaseException):
                await t
        if self._server is not None:
            await asyncio.to_thread(self._server.close)
            self._server = None

    @property
    def port(self) -> int | None:
        return self._server.port if self._server is not None else None

    # ---- holder side -------------------------------------------------------------------

    def handle(self, node_id: str, msg: wire.Message) -> bool:
        if not isinstance(msg, wire.ShareRequest):
            return False
        task = asyncio.get_running_loop().create_task(self._answer(node_id, msg), name="share-offer")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _answer(self, node_id: str, msg: wire.ShareRequest) -> None:
        reply: wire.Message
        try:
            reply = await self._offer(node_id, msg)
        except _Refused as exc:
            log.info("refused a share request from %s: %s", node_id, exc)
            reply = wire.Error(ref=msg.ref, code=exc.code, message=str(exc))
        except (MeshnodeError, OSError) as exc:
            reply = wire.Error(ref=msg.ref, code=wire.ErrorCode.INTERNAL, message=f"cannot share: {exc}")
        with contextlib.suppress(Exception):
            await self.fabric.send(node_id, reply)

    async def _offer(self, node_id: str, msg: wire.ShareRequest) -> wire.ShareTicket:
        from meshnode.models.slicer import SliceCache, check_range

        name = getattr(self.fabric, "name", "this node")
        if not self.enabled or self._server is None:
            raise _Refused(wire.ErrorCode.BUSY, f"{name} does not share models")
        from meshnode.models.sharing import unshared

        model = await asyncio.to_thread(find_held_model, self.paths, msg.model_sha256)
        if model is not None and model.sha256 in unshared(self.paths):
            raise _Refused(wire.ErrorCode.BUSY, f"{name} does not share {model.name}")
        if model is None:
            raise _Refused(wire.ErrorCode.BAD_FIELD, f"{name} holds no model with sha256 {msg.model_sha256[:16]}")
        split_part: list[int] | None = None
        if msg.whole:
            path, what = Path(model.path), "model"
            files = model_files(path)
            if len(files) > 1:
                # a split model: a transfer is one file, so each part is pulled on its own
                # (layer_start names the part, 1-based; 0 the first) and its manifest says
                # which part of how many it is
                no = msg.layer_start or 1
                if not 1 <= no <= len(files):
                    raise _Refused(wire.ErrorCode.BAD_FIELD, f"{model.name} has {len(files)} parts, not {no}")
                path, what, split_part = files[no - 1], f"part {no} of {len(files)}", [no, len(files)]
        else:
            try:
                check_range(msg.layer_start, msg.layer_end, model.n_layers, model.name)
                if msg.layer_start == msg.layer_end:
                    raise SliceRangeError(f"empty layer range [{msg.layer_start}, {msg.layer_end})")
                path = await asyncio.to_thread(SliceCache(self.paths).get, model, msg.layer_start, msg.layer_end)
            except (SliceRangeError, UnsupportedArchitectureError) as exc:
                raise _Refused(wire.ErrorCode.BAD_FIELD, str(exc)) from None
            except ModelFileError as exc:
                raise _Refused(wire.ErrorCode.INTERNAL, str(exc)) from None
            what = f"layers [{msg.layer_start}, {msg.layer_end})"
        manifest = await asyncio.to_thread(cached_manifest, Path(path), self.paths.cache / "manifests",
                                           self.chunk_size)
        now = time.monotonic()
        tickets = b"".join(self.tickets.issue(node_id, Path(path), manifest.size, manifest.chunk_size, 0,
                                              manifest.n_chunks, now) for _ in range(self.streams))
        ident = getattr(self.fabric, "identity")
        log.info("offering %s of %s to %s (%d bytes)", what, model.name, node_id, manifest.size)
        body = manifest.to_dict() if split_part is None else {**manifest.to_dict(), "part": split_part}
        return wire.ShareTicket(ref=msg.ref, port=self._server.port, cert_sha256=cert_fingerprint(ident.certificate),
                                tickets=tickets, manifest=body, name=model.name)

    # ---- puller side ---------------------------------------------------------------------

    def sources_for(self, sha256: str) -> list[str]:
        """Peers that advertise ``sha256`` as shared."""
        out = []
        for p in self.fabric.peers():
            caps = p.capabilities
            if caps is not None and any(m.sha256 == sha256 and m.shared for m in caps.models):
                out.append(p.node_id)
        return out

    async def pull(self, sha256: str, dest: Path, *, sources: list[str], whole: bool = True,
                   layer_start: int = 0, layer_end: int = 0, name: str = "",
                   progress: ProgressCb | None = None) -> tuple[Path, str]:
        """Fetch the model (``whole``) or the package of [layer_start, layer_end) to ``dest``;
        returns (``dest``, the model's name as the holder calls it). Raises
        :class:`TransferError`. A second pull of the same thing joins the first."""
        key = (sha256, whole, layer_start, layer_end)
        task = self._pulls.get(key)
        if task is None:
            what = "model" if whole else f"layers [{layer_start}, {layer_end})"
            info = TransferInfo(name or sha256[:12], sha256, what, list(sources))
            self.transfers[key] = info
            task = asyncio.get_running_loop().create_task(
                self._pull(info, sha256, dest, sources, whole, layer_start, layer_end), name="share-pull")
            self._pulls[key] = task

            def done(_t: asyncio.Task, key: tuple = key) -> None:
                self._pulls.pop(key, None)
                self.transfers.pop(key, None)

            task.add_done_callback(done)
        info = self.transfers.get(key)
        if progress is not None and info is not None:
            info.listeners.append(progress)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # the last one waiting cancels the download (the part file stays for a resume)
            if info is not None and progress in info.listeners:
                info.listeners.remove(progress)
            if info is None or not info.listeners:
                task.cancel()
            raise

    async def _offers(self, sha256: str, sources: list[str], whole: bool, start: int, end: int
                      ) -> tuple[Manifest, str, list[tuple[str, wire.ShareTicket]], tuple[int, int] | None]:
        """The sources' offers that agree, with their manifest, the model's name and, for
        a part of a split model, (part, of how many)."""
        from meshnode.mesh.fabric import PeerReplyError

        async def ask(src: str) -> tuple[str, Any]:
            # refs with the high bit: the stage-control machines number their requests from 1
            # in both directions of a link, so a link's own counter could meet theirs
            req = wire.ShareRequest(ref=SHARE_REF_BIT | secrets.randbits(31), model_sha256=sha256, whole=whole,
                                    layer_start=start, layer_end=end)
            try:
                return src, await self.fabric.request(src, req, timeout=OFFER_TIMEOUT_S)  # type: ignore[attr-defined]
            except PeerReplyError as exc:
                return src, f"{exc.error.message}"
            except (MeshnodeError, asyncio.TimeoutError, OSError) as exc:
                return src, str(exc) or type(exc).__name__

        answers = await asyncio.gather(*(ask(s) for s in sources))
        errors = [f"{s}: {a}" for s, a in answers if isinstance(a, str)]
        offers: list[tuple[str, wire.ShareTicket]] = []
        manifest: Manifest | None = None
        part: tuple[int, int] | None = None
        for src, a in answers:
            if not isinstance(a, wire.ShareTicket):
                if not isinstance(a, str):
                    errors.append(f"{src}: answered {type(a).__name__}")
                continue
            try:
                m = Manifest.from_dict(a.manifest)
            except TransferError as exc:
                errors.append(f"{src}: {exc}")
                continue
            got = _split_part(a.manifest) if whole else None
            if whole and (got is None and m.sha256 != sha256
                          or got is not None and (got[0] != max(start, 1) or end and got[1] != end)):
                # (a part's own sha256 is not the model's: the parts together are checked
                # against it once all are here)
                errors.append(f"{src}: offered a file whose sha256 is not the one asked for")
                continue
            if manifest is None:
                manifest, part = m, got
            if m != manifest or got != part:
                errors.append(f"{src}: its package differs from {offers[0][0]}'s")
                continue
            offers.append((src, a))
        if manifest is None:
            raise TransferError("no peer could offer it: " + ("; ".join(errors) or "no peer holds it"))
        for e in errors:
            log.warning("share: %s", e)
        return manifest, offers[0][1].name, offers, part

    async def _pull(self, info: TransferInfo, sha256: str, dest: Path, sources: list[str], whole: bool,
                    start: int, end: int) -> tuple[Path, str]:
        manifest, name, offers, split = await self._offers(sha256, sources, whole, start, end)
        if split is None:
            await self._fetch(info, manifest, name, offers, dest)
            return dest, name
        # a split model: its parts one by one, named as llama.cpp finds them beside ``dest``'s
        # place; then all of them together must hash to the model's sha256
        count = split[1]
        paths = [dest.with_name(split_part_name(dest.stem, k, count)) for k in range(1, count + 1)]
        for k, path in enumerate(paths, 1):
            if k > 1:
                manifest, name, offers, _ = await self._offers(sha256, sources, True, k, count)
            if not path.exists():   # (a part whole from an earlier, stopped pull is kept)
                info.what = f"model, part {k} of {count}"
                await self._fetch(info, manifest, name, offers, path)
        whole_sha = await asyncio.to_thread(sha256_files, paths)
        if whole_sha != sha256:
            for path in paths:
                path.unlink(missing_ok=True)
            raise TransferError(f"the parts of {name} hash to {whole_sha[:16]}, not the model's {sha256[:16]}: "
                                "deleted")
        return paths[0], name

    async def _fetch(self, info: TransferInfo, manifest: Manifest, name: str,
                     offers: list[tuple[str, wire.ShareTicket]], dest: Path) -> None:
        """One file of ``manifest`` from ``offers`` to ``dest`` (resumed when a part file is there)."""
        info.name = name
        part = await asyncio.to_thread(PartFile, dest, manifest)
        if part.done:
            log.info("resuming %s of %s: %d of %d chunks already here", info.what, name, len(part.done),
                     manifest.n_chunks)
        try:
            await asyncio.to_thread(check_free_space, dest.parent, manifest.size - part.bytes_held)
            plan = ChunkPlan(manifest.n_chunks, [s for s, _ in offers], done=part.done)
            stop = threading.Event()
            peers = {p.node_id: p for p in self.fabric.peers()}
            jobs = []
            for src, offer in offers:
                p = peers.get(src)
                if p is None:
                    plan.source_failed(src, "left the mesh")
                    continue
                host, _ = split_hostport(p.address)
                for i in range(len(offer.tickets) // wire.messages.SHARE_TICKET_LEN):
                    ticket = offer.tickets[i * 32:(i + 1) * 32]
                    jobs.append(asyncio.to_thread(self._worker, src, host, offer.port, offer.cert_sha256,
                                                  ticket, manifest, part, plan, stop))
            t0, base = time.monotonic(), part.bytes_held
            ticker = asyncio.get_running_loop().create_task(self._tick(info, part, manifest, t0, base))
            workers = asyncio.gather(*jobs)
            try:
                await asyncio.shield(workers)
            except asyncio.CancelledError:
                stop.set()
                with contextlib.suppress(BaseException):
                    await workers
                raise
            finally:
                ticker.cancel()
            if not plan.complete:
                raise TransferError(f"transfer of {name} stopped at {plan.done_count}/{manifest.n_chunks} "
                                    f"chunks: {plan.why_stuck()}")
            self._report(info, part, manifest, t0, base)
            await asyncio.to_thread(part.finish)
            self._measured(manifest.size - base, time.monotonic() - t0)
        except BaseException:
            await asyncio.to_thread(part.close)
            raise
        log.info("fetched %s of %s (%d bytes) from %s", info.what, name, manifest.size,
                 ", ".join(s for s, _ in offers))

    def _measured(self, moved: int, seconds: float) -> None:
        """Fold a finished pull into :attr:`fetch_bytes_per_s` (pulls too small to say
        anything about the link, whose fixed costs dominate, are left out)."""
        if moved < RATE_MIN_BYTES or seconds <= 0:
            return
        rate = moved / seconds
        old = self.fetch_bytes_per_s
        self.fetch_bytes_per_s = rate if old == 0 else old + RATE_EWMA * (rate - old)
        if self.on_rate is not None:
            self.on_rate()

    async def _tick(self, info: TransferInfo, part: PartFile, manifest: Manifest, t0: float, base: int) -> None:
        while True:
            self._report(info, part, manifest, t0, base)
            await asyncio.sleep(PROGRESS_EVERY_S)

    @staticmethod
    def _report(info: TransferInfo, part: PartFile, manifest: Manifest, t0: float, base: int) -> None:
        done = part.bytes_held
        dt = max(time.monotonic() - t0, 1e-6)
        rate = (done - base) / dt
        eta = (manifest.size - done) / rate if rate > 0 else None
        info.progress = TransferProgress(done, manifest.size, rate, eta)
        for cb in list(info.listeners):
            with contextlib.suppress(Exception):
                cb(info.progress)

    @staticmethod
    def _worker(src: str, host: str, port: int, cert: bytes, ticket: bytes, manifest: Manifest,
                part: PartFile, plan: ChunkPlan, stop: threading.Event) -> None:
        """One connection's loop (a thread): fetch, verify, write until nothing is left.

        The next chunk is asked for before this one is verified and written, so the holder
        sends it meanwhile (one request ahead: TCP's buffers hold it until it is read)."""
        try:
            client = BulkClient(host, port, cert, src, ticket)
        except BulkError as exc:
            plan.source_failed(src, str(exc))
            return
        buf = bytearray(manifest.chunk_size)
        asked: list[int] = []       # requested, not yet received (oldest first)
        try:
            while not stop.is_set():
                if not asked:
                    index = plan.next_for(src)
                    if index is None:
                        if plan.complete or not plan.busy or src not in plan.alive():
                            return
                        time.sleep(0.02)   # a chunk may come back from another source
                        continue
                    client.request(index)
                    asked.append(index)
                index = asked[0]
                view = client.receive(manifest.span(index)[1], buf)
                ahead = plan.next_for(src)
                if ahead is not None:
                    client.request(ahead)
                    asked.append(ahead)
                if chunk_ok(manifest, index, view):
                    part.write(index, view)
                    plan.chunk_done(index)
                else:
                    log.warning("chunk %d from %s failed its sha256: discarded, fetched again", index, src)
                    plan.chunk_bad(index, src, "sha256 mismatch")
                asked.pop(0)
            for index in asked:
                plan.source_failed(src, "stopped", index)
        except BulkError as exc:
            for index in asked or [None]:
                plan.source_failed(src, str(exc), index)
        finally:
            client.close()


# ---- what the mesh holds, pulls by name ---------------------------------------------------------


def mesh_models(fabric: Fabric) -> list[dict[str, Any]]:
    """Every model a member shares (one entry per sha256, with the nodes that hold it)."""
    out: dict[str, dict[str, Any]] = {}
    for p in fabric.peers():
        for m in (p.capabilities.models if p.capabilities is not None else ()):
            if not m.shared:
                continue
            e = out.setdefault(m.sha256, {"name": m.name, "sha256": m.sha256, "size": m.size_bytes,
                                          "architecture": m.architecture, "n_layers": m.n_layers,
                                          "packages": "any layer range", "holders": []})
            e["holders"].append({"node_id": p.node_id, "name": p.name})
    return sorted(out.values(), key=lambda e: e["name"])


def resolve_mesh_model(fabric: Fabric, query: str, source: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """(entry, source node ids) of the shared model named or hashed ``query``; ``source``:
    a node id, node name or prefix of an id to pull from. Raises :class:`TransferError`."""
    entries = [e for e in mesh_models(fabric)
               if query in (e["name"], e["sha256"]) or (len(query) >= 8 and e["sha256"].startswith(query))]
    if not entries:
        raise TransferError(f"no member shares a model named {query!r} (`meshnode models list --mesh`)")
    if len(entries) > 1:
        raise TransferError(f"{query!r} names {len(entries)} models; give the sha256")
    e = entries[0]
    ids = [h["node_id"] for h in e["holders"]]
    if source:
        ids = [h["node_id"] for h in e["holders"] if source in (h["name"], h["node_id"]) or h["node_id"].startswith(source)]
        if not ids:
            raise TransferError(f"{source!r} does not share {e['name']}")
    return e, ids
