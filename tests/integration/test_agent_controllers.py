"""The agent's list of controllers (``agent.controllers``): parsing ``--controller`` and
``--join-address``, host names standing for several addresses, and failover between real
gRPC servers on loopback (a refused port, a server stopped, a server that answers an error)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from gpufleet.agent.controllers import (
    ControllerPool,
    expand_targets,
    join_addresses,
    parse_controllers,
)
from gpufleet.agent.main import _advertised
from gpufleet.rpc.channel_options import CLIENT_OPTIONS, SERVER_OPTIONS
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from tests.ports import free_port


def test_controller_lists_parse_in_order_once() -> None:
    assert parse_controllers("a:1, b:2,a:1,[::1]:3") == ["a:1", "b:2", "[::1]:3"]
    for bad in ("", " , ", "a", "a:", "a:0", "a:70000", "a:x"):
        with pytest.raises(ValueError, match="controller address"):
            parse_controllers(bad)


def test_join_addresses_are_each_controllers_port_plus_one_unless_given() -> None:
    controllers = parse_controllers("ctl-a:8421,10.0.0.2:9000,[fd00::1]:8421")
    assert join_addresses(controllers, None) == ["ctl-a:8422", "10.0.0.2:9001", "[fd00::1]:8422"]
    assert join_addresses(controllers, "j1:7000,j2:7001") == ["j1:7000", "j2:7001"]
    with pytest.raises(ValueError, match="expected host:port"):
        join_addresses(controllers, "j1")


def test_a_name_with_several_addresses_stands_for_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS is the external edge here: getaddrinfo answers as a resolver with two A records
    for ``ctl`` (and one for ``solo``, kept as a name) would."""

    def fake(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        ips = {"ctl": ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "solo": ["10.0.0.9"]}[host]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert expand_targets(["ctl:8421", "solo:8421"]) == [
        "10.0.0.1:8421",
        "10.0.0.2:8421",
        "solo:8421",
    ]


def test_advertise_address_host_or_host_port() -> None:
    assert _advertised(None, 0, "127.0.0.1:8421") == ("127.0.0.1", 0, 0)
    assert _advertised("10.1.2.3", 7000, "ctl:8421") == ("10.1.2.3", 7000, 0)
    assert _advertised("10.1.2.3:7001", 0, "ctl:8421") == ("10.1.2.3", 7001, 0)
    assert _advertised("10.1.2.3:7001", 7000, "ctl:8421") == ("10.1.2.3", 7000, 7001)
    assert _advertised("[fd00::5]:7001", 0, "ctl:8421") == ("fd00::5", 7001, 0)
    assert _advertised("fd00::5", 7000, "ctl:8421") == ("fd00::5", 7000, 0)
    for bad in ("", "10.1.2.3:x", "[fd00::5]"):
        with pytest.raises(ValueError, match="--advertise-address"):
            _advertised(bad, 0, "ctl:8421")


class _Heartbeats(pb_grpc.ControllerServicer):  # only Heartbeat; the rest answer UNIMPLEMENTED
    def __init__(self, name: str, error: grpc.StatusCode | None = None) -> None:
        self.name, self.error, self.calls = name, error, 0

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        if self.error is not None:
            context.abort(self.error, f"{self.name} refuses")
        return pb.HeartbeatResponse(leader_epoch=len(self.name))


def _serve(port: int, servicer: _Heartbeats) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=list(SERVER_OPTIONS))
    pb_grpc.add_ControllerServicer_to_server(servicer, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server


@pytest.fixture
def pool_and_ports() -> Iterator[tuple[ControllerPool, int, int]]:
    a, b = free_port(), free_port()
    pool = ControllerPool(
        [f"127.0.0.1:{a}", f"127.0.0.1:{b}"],
        lambda addr: grpc.insecure_channel(addr, options=list(CLIENT_OPTIONS)),
        resolve=list,
    )
    try:
        yield pool, a, b
    finally:
        pool.close()


def test_calls_fail_over_to_the_next_controller_within_the_call(
    pool_and_ports: tuple[ControllerPool, int, int],
) -> None:
    """The first controller refuses connections: the same call is answered by the second,
    and later calls go there first; when the second stops and the first comes up, the
    call after that moves back."""
    pool, a, b = pool_and_ports
    second = _Heartbeats("second")  # type: ignore[abstract]
    server_b = _serve(b, second)
    try:
        answer = pool.Heartbeat(pb.HeartbeatRequest(node_id="n1"), timeout=5)
        assert answer.leader_epoch == len("second")
        assert pool.current == f"127.0.0.1:{b}"
        pool.Heartbeat(pb.HeartbeatRequest(node_id="n1"), timeout=5)
        assert second.calls == 2
    finally:
        server_b.stop(grace=0).wait()
    first = _Heartbeats("first!")  # type: ignore[abstract]
    server_a = _serve(a, first)
    try:
        # the channel to the first may still wait out its reconnect backoff (at most ~1.2 s
        # with CLIENT_OPTIONS): the agent's next heartbeat, a second later, gets through
        deadline = time.monotonic() + 10
        answer, codes = None, []
        while answer is None and time.monotonic() < deadline:
            try:
                answer = pool.Heartbeat(pb.HeartbeatRequest(node_id="n1"), timeout=5)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                time.sleep(0.5)
        assert set(codes) <= {grpc.StatusCode.UNAVAILABLE}, codes
        assert answer is not None, "the first controller never answered"
        assert answer.leader_epoch == len("first!")
        assert pool.current == f"127.0.0.1:{a}"
    finally:
        server_a.stop(grace=0).wait()


def test_an_answered_error_is_not_failed_over(
    pool_and_ports: tuple[ControllerPool, int, int],
) -> None:
    """A controller that answers (here FAILED_PRECONDITION) is not skipped: the agent's
    callers see the refusal, and the next call goes to the same controller."""
    pool, a, b = pool_and_ports
    refusing, other = (
        _Heartbeats("refusing", grpc.StatusCode.FAILED_PRECONDITION),  # type: ignore[abstract]
        _Heartbeats("o"),  # type: ignore[abstract]
    )
    servers = [_serve(a, refusing), _serve(b, other)]
    try:
        with pytest.raises(grpc.RpcError) as err:
            pool.Heartbeat(pb.HeartbeatRequest(node_id="n1"), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (refusing.calls, other.calls) == (1, 0)
        assert pool.current == f"127.0.0.1:{a}"
    finally:
        for s in servers:
            s.stop(grace=0).wait()


def test_every_controller_down_raises_unavailable(
    pool_and_ports: tuple[ControllerPool, int, int],
) -> None:
    pool, _, _ = pool_and_ports
    with pytest.raises(grpc.RpcError) as err:
        pool.Heartbeat(pb.HeartbeatRequest(node_id="n1"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
