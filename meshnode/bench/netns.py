"""Nodes on their own addresses: Linux network namespaces joined by a bridge.

Loopback gives every node the same address and a link that never fails or slows down;
a LAN does neither. :class:`Netns` builds a small private LAN on one machine::

    hub namespace:  br0 ── v0 ─┐        (the bridge: a switch, nothing else)
                         ├ v1 ─┼─┐
    node 0 namespace: lo, eth0 10.213.0.1/24 ─┘ │
    node 1 namespace: lo, eth0 10.213.0.2/24 ───┘

Each node namespace has ``lo`` up (a node's HTTP endpoint stays on its own 127.0.0.1)
and one veth ``eth0`` with an address of :data:`SUBNET`, multicast on (real mDNS across
the bridge). No namespace has a default route and the hub has no uplink, and nothing is
created in the namespace the harness runs in, so no packet of these nodes can reach (or
come from) the machine's real network, or other harnesses running at the same time.

What tests and benchmarks do with it:

- :meth:`Netns.popen` / :meth:`Netns.run`: a command inside node ``i``'s namespace
  (``ip netns exec``); processes started by ``popen`` are killed on close.
- :meth:`Netns.inside`: the *calling thread* enters node ``i``'s namespace for a
  ``with`` block (``setns(2)`` is per thread), so this process can talk to a node's
  loopback-only HTTP endpoint, or open sockets on either side of a link.
- :meth:`Netns.shape`: ``tc tbf`` on both ends of node ``i``'s link (its uplink and
  downlink); :meth:`Netns.qdisc_stats` reads the counters back.
- :meth:`Netns.link_down` / :meth:`Netns.link_up`: the pulled cable of failover tests.

Cleanup: namespaces carry the prefix, this process's pid and a counter
(``meshnode-t-<pid>-<k>-<role>``). Closing (the ``with`` block, :func:`atexit`, or a
failed setup) kills the processes started inside and deletes every namespace, which
takes their veths and the bridge with it. At start, :func:`sweep` deletes namespaces of
the prefix whose process is gone (a run killed with SIGKILL), never those of a live one.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; :func:`unavailable` says why
not, for a test to skip with.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshnode.bench.errors import BenchError

__all__ = ["PREFIX", "SUBNET", "Netns", "NetnsHost", "QdiscStats", "sweep", "unavailable"]

log = logging.getLogger(__name__)

PREFIX = "meshnode-t"
# A private range used only inside these namespaces (none of them routes anywhere).
SUBNET = "10.213.0"
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/run/netns")
_counter = itertools.count()
_libc = None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise BenchError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def _setns(fd: int) -> None:
    global _libc
    if hasattr(os, "setns"):   # Python 3.12+
        os.setns(fd, _CLONE_NEWNET)
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def unavailable() -> str | None:
    """Why namespaces cannot be used here (a skip reason), or None when they can."""
    if not hasattr(os, "geteuid") or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs these tests as root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "network namespaces need iproute2 (`ip`, `tc`)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _ours(prefix: str) -> list[tuple[str, int]]:
    pat = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    out = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = pat.match(name)
        if m:
            out.append((name, int(m.group(1))))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces ``prefix`` left behind by processes that are gone; returns
    their names. Namespaces of live processes (parallel runs, this one) are kept."""
    gone = [name for name, pid in _ours(prefix) if pid != os.getpid() and not _alive(pid)]
    for name in gone:
        _ip("netns", "del", name, check=False)
    if gone:
        log.info("netns: removed %d leftover namespace(s): %s", len(gone), ", ".join(gone))
    return gone


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the namespaces of ``prefix`` that exist now (any process's)."""
    return [name for name, _ in _ours(prefix)]


@dataclass(frozen=True)
class NetnsHost:
    """One node's namespace: ``ns`` (its name), ``ip`` (its address), ``dev`` (its
    interface inside ``ns``) and ``port`` (the veth end on the bridge, in the hub)."""
    index: int
    ns: str
    ip: str
    dev: str
    port: str


@dataclass(frozen=True)
class QdiscStats:
    """Counters of a root qdisc (``tc -s qdisc``)."""
    kind: str
    sent_bytes: int
    sent_packets: int
    dropped: int
    overlimits: int


_QDISC_RE = re.compile(r"qdisc (\S+) .*?Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", re.S)


class Netns:
    """``n`` namespaces, each its own address on one bridge; see the module docstring.

    ``with Netns(2) as net: net.popen(0, [...]); with net.inside(1): ...``
    """

    def __init__(self, n: int, *, prefix: str = PREFIX, subnet: str = SUBNET) -> None:
        if not 1 <= n <= 250:
            raise ValueError("1 to 250 namespaces")
        self.prefix = prefix
        base = f"{prefix}-{os.getpid()}-{next(_counter)}"
        self.hub = f"{base}-hub"
        self.hosts = [NetnsHost(i, f"{base}-{i}", f"{subnet}.{i + 1}", "eth0", f"v{i}") for i in range(n)]
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._lock = threading.Lock()
        sweep(prefix)
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        # mDNS (224.0.0.251) is link-local and flooded anyway; no snooping keeps every
        # other multicast flowing too.
        _ip("-n", self.hub, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0", check=False)
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
            # Both ends are created in place: no interface ever appears in this namespace.
            _ip("-n", h.ns, "link", "add", h.dev, "type", "veth", "peer", "name", h.port, "netns", self.hub)
            _ip("-n", self.hub, "link", "set", h.port, "master", "br0", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", h.dev)
            _ip("-n", h.ns, "link", "set", h.dev, "multicast", "on", "up")
            # Multicast leaves through eth0 even for a program that does not pick the
            # interface; there is no default route, so nothing else leaves at all.
            _ip("-n", h.ns, "route", "add", "224.0.0.0/4", "dev", h.dev)

    # ---- running things inside -------------------------------------------------

    def host(self, i: int) -> NetnsHost:
        return self.hosts[i]

    def ip(self, i: int) -> str:
        return self.hosts[i].ip

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[i].ns, *argv]

    def run(self, i: int, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(self.argv(i, argv), **kw)

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside node ``i``'s namespace (``ip netns exec`` execs it, so
        the Popen's pid is the program's); it is killed on :meth:`close`."""
        proc = subprocess.Popen(self.argv(i, argv), **kw)
        with self._lock:
            self._procs.append(proc)
        return proc

    @contextlib.contextmanager
    def inside(self, i: int | None) -> Iterator[None]:
        """The calling thread works in node ``i``'s namespace (``None``: the hub's) for
        the block: sockets it creates there stay there after the block. Other threads
        are not affected (a namespace is per thread)."""
        ns = self.hub if i is None else self.hosts[i].ns
        with open("/proc/thread-self/ns/net") as home, open(_NETNS_DIR / ns) as target:
            _setns(target.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def tcp_rate(self, src: int, dst: int, nbytes: int) -> float:
        """Bits/s of one TCP stream of ``nbytes`` from node ``src`` to node ``dst``: the
        ceiling a transfer protocol can reach on that link. Both ends run in this
        process (each socket made inside its namespace); nothing else is started."""
        with self.inside(dst):
            srv = socket.create_server((self.ip(dst), 0))
        got: list[int] = []

        def drain() -> None:
            conn, _ = srv.accept()
            n = 0
            while chunk := conn.recv(1 << 16):
                n += len(chunk)
            got.append(n)
            conn.close()

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        try:
            with self.inside(src):
                c = socket.create_connection((self.ip(dst), srv.getsockname()[1]), timeout=30)
            block = b"\0" * (1 << 20)
            t0 = time.monotonic()
            with c:
                left = nbytes
                while left > 0:
                    c.sendall(block[:left])
                    left -= min(left, len(block))
                c.shutdown(socket.SHUT_WR)
                t.join(60)
            dt = time.monotonic() - t0
        finally:
            srv.close()
        if got != [nbytes]:
            raise BenchError(f"tcp_rate: {got} bytes arrived of {nbytes}")
        return nbytes * 8 / dt

    # ---- the link -----------------------------------------------------------------

    def shape(self, i: int, rate: str, *, burst: str | None = None, latency: str = "50ms",
              both: bool = True) -> None:
        """Limit node ``i``'s link to ``rate`` (tc syntax: ``1gbit``, ``50mbit``) with a
        token bucket on its side (uplink) and, ``both``, on the bridge's side (downlink).

        ``burst`` defaults to 10 ms of ``rate`` (at least 16 kB): large enough for the
        kernel's timer granularity, small enough that a transfer of a few MB sees the rate."""
        h = self.hosts[i]
        if burst is None:
            burst = str(max(16 * 1024, int(_rate_bps(rate) / 8 / 100)))
        for ns, dev in [(h.ns, h.dev)] + ([(self.hub, h.port)] if both else []):
            r = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                                "rate", rate, "burst", burst, "latency", latency],
                               capture_output=True, text=True, timeout=20)
            if r.returncode != 0:   # e.g. a kernel without sch_tbf: "qdisc kind is unknown"
                raise BenchError(f"tc tbf on {dev} of {ns}: {r.stderr.strip() or r.returncode}")

    def unshape(self, i: int) -> None:
        h = self.hosts[i]
        for ns, dev in ((h.ns, h.dev), (self.hub, h.port)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=20)

    def qdisc_stats(self, i: int, *, bridge_side: bool = False) -> QdiscStats:
        """The root qdisc's counters on node ``i``'s interface (``bridge_side``: on its
        veth end at the bridge, which carries what node ``i`` receives)."""
        h = self.hosts[i]
        ns, dev = (self.hub, h.port) if bridge_side else (h.ns, h.dev)
        out = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev, "root"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        m = _QDISC_RE.search(out)
        if not m:
            raise BenchError(f"no qdisc counters in: {out!r}")
        return QdiscStats(m.group(1), *(int(m.group(k)) for k in range(2, 6)))

    def link_down(self, i: int) -> None:
        """Pull node ``i``'s cable: its interface goes down (the bridge's end loses
        carrier too); nothing reaches it or leaves it until :meth:`link_up`."""
        h = self.hosts[i]
        _ip("-n", h.ns, "link", "set", h.dev, "down")

    def link_up(self, i: int) -> None:
        h = self.hosts[i]
        _ip("-n", h.ns, "link", "set", h.dev, "up")
        # An interface going down drops its routes other than the connected one.
        _ip("-n", h.ns, "route", "replace", "224.0.0.0/4", "dev", h.dev, check=False)

    # ---- cleanup -----------------------------------------------------------------

    def close(self) -> None:
        """Kill what :meth:`popen` started, delete every namespace (their veths and the
        bridge go with them). Idempotent; also runs at exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for name in [h.ns for h in self.hosts] + [self.hub]:
            if (_NETNS_DIR / name).exists():
                _ip("netns", "del", name, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> "Netns":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rate_bps(rate: str) -> float:
    """``tc`` rate syntax (``1gbit``, ``50mbit``, ``800kbit``, ``100mbps``) in bits/s."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use tc syntax, e.g. 1gbit or 50mbit")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return value * 8 if m.group(3) == "bps" else value
