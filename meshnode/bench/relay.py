"""A UDP relay that delays every datagram: network latency for nodes on one machine.

Many kernels have no netem (docs/testing.md), so benchmarks emulate a slower link
by pointing one node at this relay instead of at its peer. QUIC runs over UDP, so the
relay sees every packet of the connection.

Theory of operation: a client sends to the listen address; the relay holds each datagram
``delay_s`` (plus a uniform jitter in ``[-jitter_s, +jitter_s]``, never below zero) and
then sends it to ``target`` from an upstream socket of that client's own (so the target
sees one distinct address per client and its replies can be told apart). Replies reaching
an upstream socket are held the same way and sent back to their client from the listen
socket. A round trip through the relay therefore takes ``2 * delay_s`` plus processing.

Holding uses the event loop's timers, not a sleep per packet: each direction of each
client is a FIFO of ``(due, datagram)`` with one timer armed for its head. Due times are
made non-decreasing per direction (jitter can never reorder a flow), and a timer sends
everything due in FIFO order, so ordering is preserved even when several datagrams share
one due time. Datagrams still held at :meth:`UdpDelayRelay.stop` are dropped.

Latency spikes (``spike_every_s``, ``spike_s``): every ``spike_every_s`` seconds after
start the link stalls for ``spike_s``, both ways, the way a Wi-Fi hiccup or a full
buffer does. A datagram arriving during a stall is held until it ends (then the usual
delay), so the first one of a stall waits ``spike_s`` longer; nothing is lost or
reordered. :attr:`RelayCounters.spiked` counts the datagrams a stall held.

Say in any benchmark output that a relay was used and with what delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
import dataclasses
from dataclasses import dataclass

__all__ = ["RelayCounters", "UdpDelayRelay", "relay"]

log = logging.getLogger(__name__)

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class RelayCounters:
    """Datagrams and bytes forwarded so far. ``up``: client -> target, ``down``: target ->
    client. ``clients``: client addresses seen."""

    datagrams_up: int = 0
    bytes_up: int = 0
    datagrams_down: int = 0
    bytes_down: int = 0
    clients: int = 0
    spiked: int = 0


class _Flow:
    """One direction of one client: held datagrams and the timer of the head."""

    __slots__ = ("queue", "timer", "last_due")

    def __init__(self) -> None:
        self.queue: deque[tuple[float, bytes]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.last_due = 0.0


class _Client:
    __slots__ = ("addr", "up", "down", "transport", "ready")

    def __init__(self, addr: Address) -> None:
        self.addr = addr
        self.up = _Flow()
        self.down = _Flow()
        self.transport: asyncio.DatagramTransport | None = None
        self.ready: asyncio.Task[None] | None = None


class _ListenProtocol(asyncio.DatagramProtocol):
    def __init__(self, relay: "UdpDelayRelay") -> None:
        self.relay = relay

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.relay._from_client(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("relay listen socket: %s", exc)


class _UpstreamProtocol(asyncio.DatagramProtocol):
    def __init__(self, relay: "UdpDelayRelay", client: _Client) -> None:
        self.relay = relay
        self.client = client

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.relay._from_target(data, self.client)

    def error_received(self, exc: Exception) -> None:
        # e.g. ICMP port unreachable while the target is not up yet: UDP drops, so do we
        log.debug("relay upstream socket of %s: %s", self.client.addr, exc)


class UdpDelayRelay:
    """Delaying UDP relay from ``listen`` to ``target`` (see the module docstring).

    ``listen`` may use port 0 (see :attr:`port` after :meth:`start`). ``rng`` draws the
    jitter (seed it for reproducible runs).
    """

    def __init__(
        self,
        listen: Address,
        target: Address,
        delay_s: float = 0.005,
        jitter_s: float = 0.0,
        *,
        rng: random.Random | None = None,
        spike_every_s: float = 0.0,
        spike_s: float = 0.0,
    ) -> None:
        if delay_s < 0 or jitter_s < 0:
            raise ValueError("delay_s and jitter_s must be >= 0")
        if spike_s < 0 or (spike_s > 0 and not spike_s < spike_every_s):
            raise ValueError("spike_s must be >= 0 and shorter than spike_every_s")
        self.listen = listen
        self.target = target
        self.delay_s = float(delay_s)
        self.jitter_s = float(jitter_s)
        self._rng = rng or random.Random()
        self.spike_every_s = float(spike_every_s) if spike_s > 0 else 0.0
        self.spike_s = float(spike_s)
        self._t0 = 0.0   # the loop time of start(): stalls begin at t0 + k * spike_every_s, k >= 1
        self._spiked = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._clients: dict[Address, _Client] = {}
        self._counts = [0, 0, 0, 0]  # datagrams up, bytes up, datagrams down, bytes down
        # asyncio may run a timer up to the clock resolution early
        self._slack = time.get_clock_info("monotonic").resolution

    # ---- lifetime -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the listen socket. Raises OSError when the address is taken."""
        if self._transport is not None:
            raise RuntimeError("relay already started")
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        transport, _ = await self._loop.create_datagram_endpoint(
            lambda: _ListenProtocol(self), local_addr=self.listen)
        self._transport = transport

    async def stop(self) -> None:
        """Close every socket; datagrams still held are dropped. Idempotent."""
        for client in self._clients.values():
            for flow in (client.up, client.down):
                if flow.timer is not None:
                    flow.timer.cancel()
                flow.queue.clear()
            if client.ready is not None and not client.ready.done():
                client.ready.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await client.ready
            if client.transport is not None:
                client.transport.close()
        self._clients.clear()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        await asyncio.sleep(0)  # let the transports finish closing

    async def __aenter__(self) -> "UdpDelayRelay":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- introspection ----------------------------------------------------------------------

    @property
    def address(self) -> Address:
        """The bound listen address (host, port)."""
        if self._transport is None:
            raise RuntimeError("relay not started")
        host, port = self._transport.get_extra_info("sockname")[:2]
        return host, port

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def counters(self) -> RelayCounters:
        up_n, up_b, down_n, down_b = self._counts
        return RelayCounters(up_n, up_b, down_n, down_b, len(self._clients), self._spiked)

    # ---- forwarding ---------------------------------------------------------------------------

    def _from_client(self, data: bytes, addr: Address) -> None:
        client = self._clients.get(addr)
        if client is None:
            client = _Client(addr)
            self._clients[addr] = client
            # the upstream socket is ready long before the first datagram is due
            client.ready = asyncio.ensure_future(self._open_upstream(client))
        self._hold(client.up, data, lambda: self._drain_up(client))

    def _from_target(self, data: bytes, client: _Client) -> None:
        self._hold(client.down, data, lambda: self._drain_down(client))

    async def _open_upstream(self, client: _Client) -> None:
        assert self._loop is not None
        try:
            transport, _ = await self._loop.create_datagram_endpoint(
                lambda: _UpstreamProtocol(self, client), remote_addr=self.target)
        except OSError as exc:
            log.warning("relay: cannot open an upstream socket for %s: %s", client.addr, exc)
            return
        client.transport = transport
        self._drain_up(client)  # anything that fell due while the socket was opening

    def _hold(self, flow: _Flow, data: bytes, drain) -> None:
        assert self._loop is not None
        delay = self.delay_s
        if self.jitter_s:
            delay = max(0.0, delay + self._rng.uniform(-self.jitter_s, self.jitter_s))
        now = self._loop.time()
        due = max(now + delay + self._stall_left(now), flow.last_due)
        flow.last_due = due
        flow.queue.append((due, data))
        if flow.timer is None:
            flow.timer = self._loop.call_at(due, drain)

    def _stall_left(self, now: float) -> float:
        """How much longer the stall in progress at ``now`` lasts (0: none)."""
        if not self.spike_s or now - self._t0 < self.spike_every_s:
            return 0.0
        into = (now - self._t0) % self.spike_every_s
        if into >= self.spike_s:
            return 0.0
        self._spiked += 1
        return self.spike_s - into

    def _drain(self, flow: _Flow, send, drain) -> None:
        assert self._loop is not None
        flow.timer = None
        now = self._loop.time() + self._slack
        q = flow.queue
        while q and q[0][0] <= now:
            send(q.popleft()[1])
        if q:
            flow.timer = self._loop.call_at(q[0][0], drain)

    def _drain_up(self, client: _Client) -> None:
        transport = client.transport
        if transport is None:
            # upstream socket still opening: _open_upstream drains when it is ready
            if client.up.timer is not None:
                client.up.timer.cancel()
                client.up.timer = None
            return

        def send(data: bytes) -> None:
            transport.sendto(data)
            self._counts[0] += 1
            self._counts[1] += len(data)

        self._drain(client.up, send, lambda: self._drain_up(client))

    def _drain_down(self, client: _Client) -> None:
        listen = self._transport
        if listen is None:
            return

        def send(data: bytes) -> None:
            listen.sendto(data, client.addr)
            self._counts[2] += 1
            self._counts[3] += len(data)

        self._drain(client.down, send, lambda: self._drain_down(client))


@contextlib.asynccontextmanager
async def relay(
    listen: Address,
    target: Address,
    delay_s: float = 0.005,
    jitter_s: float = 0.0,
    *,
    rng: random.Random | None = None,
    spike_every_s: float = 0.0,
    spike_s: float = 0.0,
) -> AsyncIterator[UdpDelayRelay]:
    """``async with relay(("127.0.0.1", 0), peer, delay_s=0.01) as r:`` -- a started
    :class:`UdpDelayRelay`, stopped on exit; clients send to ``r.address``."""
    r = UdpDelayRelay(listen, target, delay_s, jitter_s, rng=rng,
                      spike_every_s=spike_every_s, spike_s=spike_s)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


# ---- a relay process (tests and benchmarks whose own process must not be its clock) -----


def _address(text: str) -> Address:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    """``python -m meshnode.bench.relay --target HOST:PORT [--listen HOST:PORT] [--delay-ms
    MS] [--jitter-ms MS] [--spike-every S --spike-ms MS]``: run a relay until SIGTERM or
    SIGINT. Prints ``listening on HOST:PORT`` once bound and, at the end, its counters as
    one JSON line. A process of its own keeps the relay's timing independent of whatever
    its user does (a test that holds the GIL would otherwise stall the link)."""
    import argparse
    import json
    import signal

    from meshnode.argtypes import non_negative_float

    p = argparse.ArgumentParser(prog="python -m meshnode.bench.relay", description=main.__doc__)
    p.add_argument("--target", type=_address, required=True, help="where datagrams go (HOST:PORT)")
    p.add_argument("--listen", type=_address, default=("127.0.0.1", 0), help="bind address (default 127.0.0.1:0)")
    p.add_argument("--delay-ms", type=non_negative_float, default=0.0, help="added one-way delay")
    p.add_argument("--jitter-ms", type=non_negative_float, default=0.0, help="uniform jitter around the delay")
    p.add_argument("--spike-every", type=non_negative_float, default=0.0, metavar="S",
                   help="every S seconds the link stalls for --spike-ms (both ways)")
    p.add_argument("--spike-ms", type=non_negative_float, default=0.0, help="length of each stall")
    args = p.parse_args(argv)

    async def run() -> RelayCounters:
        try:
            r = UdpDelayRelay(args.listen, args.target, args.delay_ms / 1e3, args.jitter_ms / 1e3,
                              spike_every_s=args.spike_every, spike_s=args.spike_ms / 1e3)
        except ValueError as exc:
            p.error(str(exc))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with r:
            host, port = r.address
            print(f"listening on {host}:{port}", flush=True)
            await stop.wait()
            return r.counters

    counters = asyncio.run(run())
    print(json.dumps(dataclasses.asdict(counters)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
