"""``gpufleet.netports``: ports for servers started a moment later come from outside the
kernel's ephemeral range, the range outgoing connections' local ports are drawn from."""

from __future__ import annotations

import socket

from gpufleet import netports
from tests.ports import free_port, free_port_pair


def test_a_free_port_lies_outside_the_ephemeral_range_and_binds() -> None:
    lo, hi = netports.ephemeral_range()
    for _ in range(20):
        port = netports.free_port()
        assert not lo <= port <= hi
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_skipped() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        other = netports.free_port(candidates=[taken, taken + 1 if taken < 65535 else taken - 1])
        assert other != taken


def test_connections_do_not_get_the_ports_handed_out() -> None:
    """Many outgoing connections' local ports never fall where the free ports come from."""
    ports = netports.outside_ephemeral()
    assert ports is not None  # (Linux's default range leaves room below it)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(256)
        clients = []
        try:
            for _ in range(200):
                c = socket.create_connection(server.getsockname())
                clients.append(c)
                assert c.getsockname()[1] not in ports
        finally:
            for c in clients:
                c.close()


def test_the_suite_s_ports_are_distinct_and_pairs_are_adjacent_and_free() -> None:
    got = [free_port() for _ in range(50)]
    assert len(set(got)) == 50
    p = free_port_pair()
    assert netports.bindable(p) and netports.bindable(p + 1)
