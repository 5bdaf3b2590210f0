"""What holds a node's event loop that is not its own work, on this machine:
``python packaging/gpu/pause_probe.py``.

Two measurements behind two defaults of a served node (docs/mesh.md, "Failure detection"
and "Fast lane"), each against its baseline in the same run:

* **A full garbage collection** over a started node's heap (a real :class:`Node`, no
  model, no discovery, in this process), median of 5 ``gc.collect()``: as the heap is
  after start-up, then after :func:`meshnode.node.freeze_startup_heap` (what ``meshnode
  serve`` and the TUI call once the node is up). A full collection stops every thread.
* **A burst at a busy socket**: 64 datagrams of 16 KB (a 64-row prompt chunk of an 8B in
  f32) sent by another process at an asyncio UDP socket whose loop is held 200 ms (a step
  computing on it); how many arrive with the kernel's default receive buffer and with
  ``limits.SOCKET_BUFFER`` (what a node's QUIC sockets ask for), and the buffer granted.
"""
from __future__ import annotations

import asyncio
import gc
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshnode.limits import SOCKET_BUFFER  # noqa: E402
from meshnode.node import Node, freeze_startup_heap  # noqa: E402
from meshnode.paths import NodePaths  # noqa: E402

BURST, DATAGRAM, HELD_S = 64, 16384, 0.2


def full_collection_ms() -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


async def collections() -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as home:
        node = Node(NodePaths.resolve(Path(home)).ensure(), http_port=0, interfaces=["127.0.0.1"],
                    discovery=False, share=False, name="probe")
        await node.start()
        try:
            before = full_collection_ms()
            freeze_startup_heap()
            after = full_collection_ms()
            frozen = gc.get_freeze_count()
        finally:
            await node.stop()
            gc.unfreeze()
    return before, after, frozen


async def burst(buffer: int | None) -> tuple[int, int]:
    got = [0]

    class Count(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr) -> None:
            got[0] += 1

    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Count, local_addr=("127.0.0.1", 0))
    try:
        sock = transport.get_extra_info("socket")
        if buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        port = transport.get_extra_info("sockname")[1]
        sender = subprocess.Popen([sys.executable, "-c", (
            "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"for _ in range({BURST}): s.sendto(bytes({DATAGRAM}), ('127.0.0.1', {port}))")])
        time.sleep(HELD_S)          # the loop is held, as by a step computing on it
        sender.wait()
        await asyncio.sleep(0.3)    # the loop reads what the socket kept
        return got[0], granted
    finally:
        transport.close()


async def main() -> None:
    before, after, frozen = await collections()
    print(f"full garbage collection of a started node's heap: {before:.1f} ms; "
          f"after the start-up heap is frozen ({frozen} objects): {1e3 * after:.1f} us")
    for label, buffer in (("the default buffer", None), (f"SOCKET_BUFFER ({SOCKET_BUFFER >> 20} MiB asked)", SOCKET_BUFFER)):
        n, granted = await burst(buffer)
        print(f"a burst of {BURST} x {DATAGRAM // 1024} KB at a socket whose loop is held {1e3 * HELD_S:.0f} ms, "
              f"{label}, {granted // 1024} KB granted (as the kernel reports it): {n} of {BURST} arrived")


if __name__ == "__main__":
    asyncio.run(main())
