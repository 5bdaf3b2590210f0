"""UdpDelayRelay: real UDP on loopback through the relay (delay, ordering, client isolation)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest

from meshnode.bench.relay import UdpDelayRelay, relay

LOCAL = ("127.0.0.1", 0)


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.transport.sendto(data, addr)


class _Client(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.received.put_nowait((time.perf_counter(), data))


async def _echo_server():
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(_Echo, local_addr=LOCAL)
    return transport, transport.get_extra_info("sockname")[:2]


async def _client(addr) -> tuple[asyncio.DatagramTransport, _Client]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(_Client, remote_addr=addr)
    return transport, proto


def test_round_trip_takes_twice_the_delay():
    async def main():
        server, server_addr = await _echo_server()
        delay = 0.010
        async with relay(LOCAL, server_addr, delay_s=delay) as r:
            transport, client = await _client(r.address)
            rtts = []
            for i in range(20):
                t0 = time.perf_counter()
                transport.sendto(b"ping %d" % i)
                t1, data = await asyncio.wait_for(client.received.get(), 2)
                assert data == b"ping %d" % i
                rtts.append(t1 - t0)
            transport.close()
            c = r.counters
            assert (c.datagrams_up, c.datagrams_down, c.clients) == (20, 20, 1)
            assert c.bytes_up == c.bytes_down == sum(len(b"ping %d" % i) for i in range(20))
        server.close()
        print(f"\nrelay delay {delay * 1e3:.0f} ms each way: RTT min {min(rtts) * 1e3:.2f} "
              f"median {statistics.median(rtts) * 1e3:.2f} max {max(rtts) * 1e3:.2f} ms")
        assert min(rtts) >= 2 * delay
        assert statistics.median(rtts) < 2 * delay + 0.020

    asyncio.run(main())


def test_zero_delay_passes_through():
    async def main():
        server, server_addr = await _echo_server()
        async with relay(LOCAL, server_addr, delay_s=0.0) as r:
            transport, client = await _client(r.address)
            transport.sendto(b"x")
            _, data = await asyncio.wait_for(client.received.get(), 2)
            assert data == b"x"
            transport.close()
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("jitter", [0.0, 0.004])
def test_burst_keeps_order(jitter: float):
    async def main():
        server, server_addr = await _echo_server()
        async with relay(LOCAL, server_addr, delay_s=0.005, jitter_s=jitter,
                         rng=random.Random(7)) as r:
            transport, client = await _client(r.address)
            for i in range(200):
                transport.sendto(i.to_bytes(4, "big") + b"." * 100)
            got = []
            while len(got) < 200:
                _, data = await asyncio.wait_for(client.received.get(), 5)
                got.append(int.from_bytes(data[:4], "big"))
            assert got == list(range(200))
            transport.close()
        server.close()

    asyncio.run(main())


def test_spikes_hold_every_datagram_of_a_stall_until_it_ends():
    """Every 0.5 s the link stalls 0.2 s: a ping sent every 10 ms sees round trips up to
    the stall's length during stalls, ~the delay between them; nothing lost or reordered."""
    async def main():
        server, server_addr = await _echo_server()
        every, spike, delay = 0.5, 0.2, 0.002
        async with relay(LOCAL, server_addr, delay_s=delay, spike_every_s=every, spike_s=spike) as r:
            transport, client = await _client(r.address)
            t_start = time.perf_counter()
            sent = {}
            for i in range(140):                               # 1.4 s: stalls at 0.5 and 1.0 s
                sent[i] = time.perf_counter()
                transport.sendto(i.to_bytes(4, "big"))
                await asyncio.sleep(0.01)
            got = []
            while len(got) < 140:
                t, data = await asyncio.wait_for(client.received.get(), 5)
                got.append((int.from_bytes(data, "big"), t))
            transport.close()
            spiked = r.counters.spiked
        server.close()
        assert [i for i, _ in got] == list(range(140))
        rtt = {i: t - sent[i] for i, t in got}
        quiet = [i for i in rtt if 0.25 <= (sent[i] - t_start) % every < 0.45]
        print(f"\nspike {spike * 1e3:.0f} ms every {every} s: max RTT {max(rtt.values()) * 1e3:.0f} ms, "
              f"between stalls median {statistics.median(rtt[i] for i in quiet) * 1e3:.1f} ms; "
              f"{spiked} datagrams held by a stall")
        assert max(rtt.values()) < spike + 2 * delay + 0.05
        assert max(rtt.values()) > spike - 0.05
        assert statistics.median(rtt[i] for i in quiet) < 0.05
        assert spiked >= 20                                    # ~2 stalls x 20 pings (plus echoes)

    asyncio.run(main())


def test_spike_settings_are_checked():
    with pytest.raises(ValueError):
        UdpDelayRelay(LOCAL, LOCAL, spike_every_s=0.2, spike_s=0.2)
    with pytest.raises(ValueError):
        UdpDelayRelay(LOCAL, LOCAL, spike_s=-1.0)


def test_clients_are_kept_apart():
    async def main():
        seen_by_server: set = set()

        class _Recording(_Echo):
            def datagram_received(self, data: bytes, addr) -> None:
                seen_by_server.add(addr)
                super().datagram_received(data, addr)

        loop = asyncio.get_running_loop()
        rec, _ = await loop.create_datagram_endpoint(_Recording, local_addr=LOCAL)
        rec_addr = rec.get_extra_info("sockname")[:2]
        async with relay(LOCAL, rec_addr, delay_s=0.003) as r:
            clients = [await _client(r.address) for _ in range(8)]
            for round_ in range(10):
                for n, (transport, _) in enumerate(clients):
                    transport.sendto(f"{n}:{round_}".encode())
            for n, (transport, proto) in enumerate(clients):
                got = []
                for _ in range(10):
                    _, data = await asyncio.wait_for(proto.received.get(), 5)
                    got.append(data.decode())
                assert got == [f"{n}:{k}" for k in range(10)]
                assert proto.received.empty()
                transport.close()
            assert r.counters.clients == 8
            assert r.counters.datagrams_up == r.counters.datagrams_down == 80
        assert len(seen_by_server) == 8  # one upstream address per client
        rec.close()

    asyncio.run(main())


def test_stop_drops_held_datagrams_and_is_idempotent():
    async def main():
        server, server_addr = await _echo_server()
        r = UdpDelayRelay(LOCAL, server_addr, delay_s=0.5)
        await r.start()
        transport, client = await _client(r.address)
        transport.sendto(b"late")
        await asyncio.sleep(0.05)
        await r.stop()
        await r.stop()
        await asyncio.sleep(0.6)
        assert client.received.empty()
        assert r.counters.datagrams_up == 0
        transport.close()
        server.close()
        with pytest.raises(ValueError):
            UdpDelayRelay(LOCAL, server_addr, delay_s=-1)

    asyncio.run(main())


def _self_signed(tmp_path):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "c.pem", tmp_path / "k.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _free_udp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_quic_through_the_relay(tmp_path):
    aioquic = pytest.importorskip("aioquic")
    del aioquic
    import ssl

    from aioquic.asyncio import connect, serve
    from aioquic.quic.configuration import QuicConfiguration

    cert, key = _self_signed(tmp_path)

    async def main():
        server_cfg = QuicConfiguration(is_client=False, alpn_protocols=["relay-test"])
        server_cfg.load_cert_chain(cert, key)
        server_addr = ("127.0.0.1", _free_udp_port())
        server = await serve(*server_addr, configuration=server_cfg)
        delay = 0.008
        async with relay(LOCAL, server_addr, delay_s=delay) as r:
            client_cfg = QuicConfiguration(is_client=True, alpn_protocols=["relay-test"],
                                           verify_mode=ssl.CERT_NONE)
            t0 = time.perf_counter()
            async with connect("127.0.0.1", r.port, configuration=client_cfg) as conn:
                handshake = time.perf_counter() - t0
                pings = []
                for _ in range(5):
                    t1 = time.perf_counter()
                    await asyncio.wait_for(conn.ping(), 2)
                    pings.append(time.perf_counter() - t1)
            assert r.counters.datagrams_up > 0 and r.counters.datagrams_down > 0
        server.close()
        print(f"\nQUIC through relay ({delay * 1e3:.0f} ms each way): handshake "
              f"{handshake * 1e3:.1f} ms, ping median {statistics.median(pings) * 1e3:.2f} ms")
        assert min(pings) >= 2 * delay
        assert handshake >= 2 * delay

    asyncio.run(main())
