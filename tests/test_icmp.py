"""ICMP errors on UDP sockets (meshnode.net.icmp): which queue records count, and a real
"port unreachable" from this host's kernel read off a real socket."""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
import sys

import pytest

from meshnode.net import icmp
from nodeproc import until

_EE = struct.Struct("=IBBBBII")


def _record(ee_errno: int, origin: int, level: int = socket.IPPROTO_IP, kind: int = 11) -> tuple:
    return (level, kind, _EE.pack(ee_errno, origin, 3, 3, 0, 0, 0))


@pytest.mark.parametrize("ancdata, want", [
    ([_record(errno.ECONNREFUSED, 2)], errno.ECONNREFUSED),                      # ICMP port unreachable
    ([_record(errno.ECONNREFUSED, 3, socket.IPPROTO_IPV6, 25)], errno.ECONNREFUSED),  # ICMPv6
    ([_record(errno.EHOSTUNREACH, 2)], errno.EHOSTUNREACH),
    ([_record(errno.EMSGSIZE, 2)], None),               # fragmentation needed: the path lives
    ([_record(errno.ECONNREFUSED, 1)], None),           # a local error, not from the network
    ([(socket.IPPROTO_IP, 11, b"short")], None),        # truncated record
    ([(socket.SOL_SOCKET, 11, _EE.pack(111, 2, 3, 3, 0, 0, 0))], None),   # another cmsg
    ([], None),
])
def test_only_unreachable_errors_from_icmp_count(ancdata, want):
    assert icmp.unreachable_errno(ancdata) == want


@pytest.mark.net
async def test_icmp_port_unreachable_reaches_the_error_queue_and_is_drained():
    """A datagram to a closed port on this host: asyncio reports the error to the
    protocol, ErrorQueue names the refused address, and the queue ends empty (else the
    socket would poll ready forever and the event loop spin)."""
    if sys.platform != "linux":
        pytest.skip("ICMP errors are read on Linux only")
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()   # nobody listens there now
    loop = asyncio.get_running_loop()
    seen: list = []

    class Proto(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.errors = icmp.ErrorQueue(transport)

        def error_received(self, exc):
            seen.append((exc.errno, self.errors.read()))

    transport, proto = await loop.create_datagram_endpoint(Proto, local_addr=("127.0.0.1", 0))
    try:
        assert proto.errors.enabled
        transport.sendto(b"x", ("127.0.0.1", port))
        await until(lambda: seen, 2.0)
        assert seen[0] == (errno.ECONNREFUSED, [("127.0.0.1", port)])
        reads = len(seen)
        await asyncio.sleep(0.2)
        assert len(seen) == reads and proto.errors.read() == []   # drained: no more wake-ups
    finally:
        transport.close()
        proto.errors.close()
