"""The agent's controllers: a list of addresses and failover between them.

``--controller`` takes a comma-separated list of ``host:port`` (:func:`parse_controllers`);
a host name that resolves to several addresses stands for each of them
(:func:`expand_targets`). :class:`ControllerPool` is the agent's channel to the control
plane: every call goes to the current controller and, when that one cannot be reached
(UNAVAILABLE: refused, reset, a dead connection found by keepalive), to the next ones in
turn within the same call; a call that times out (DEADLINE_EXCEEDED) is not repeated but the
next call goes to the next controller. Every controller replica serves every agent call
(registration, heartbeats, confirmations, completions: facts the agent reports, recorded by
whichever replica hears them; the leader's epoch is read from the database), so a standby is
as good as the leader and "not the leader" is never a reason to move on.

The join service of each controller is its port + 1 unless ``--join-address`` names them
(:func:`join_addresses`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from gpufleet.agent.identity import ControllerChannel
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc

logger = logging.getLogger("gpufleet.agent")

FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Codes after which the same call is tried on the next controller at once (nothing was
done, or the agent cannot know and every agent call is idempotent)."""
MOVE_ON_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Codes after which the next call goes to the next controller."""
RESOLVE_EVERY_S = 5.0
"""Host names are resolved again at most this often (seconds), when every target failed."""
OLD_CHANNEL_GRACE_S = 30.0


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` -> ``(host, port)``.

    Raises:
        ValueError: no port, or a port that is not 1..65535 (the message names the address).
    """
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"controller address {address!r}: expected host:port")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_controllers(spec: str) -> list[str]:
    """The addresses of a ``--controller`` value: comma-separated ``host:port``, in order,
    each once.

    Raises:
        ValueError: an empty list or an entry without a valid port.
    """
    out: list[str] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        host, port = split_host_port(entry)
        address = join_host_port(host, port)
        if address not in out:
            out.append(address)
    if not out:
        raise ValueError(f"controller address {spec!r}: expected host:port[,host:port...]")
    return out


def join_addresses(controllers: Sequence[str], explicit: str | None) -> list[str]:
    """The join services to try: ``explicit`` (comma-separated ``host:port``) when given,
    else each controller's host with its port + 1.

    Raises:
        ValueError: a malformed entry.
    """
    if explicit:
        return parse_controllers(explicit)
    out = []
    for address in controllers:
        host, port = split_host_port(address)
        out.append(join_host_port(host, port + 1))
    return out


def expand_targets(addresses: Sequence[str]) -> list[str]:
    """Each address, a host name that resolves to several IP addresses replaced by all of
    them (in the resolver's order); a name that resolves to one address, or not at all (yet),
    is kept as it is (gRPC resolves it again at each connect)."""
    out: list[str] = []
    for address in addresses:
        host, port = split_host_port(address)
        ips: list[str] = []
        try:
            for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
                ip = str(sockaddr[0])
                if ip not in ips:
                    ips.append(ip)
        except OSError:
            ips = []
        found = [join_host_port(ip, port) for ip in ips] if len(ips) > 1 else [address]
        out.extend(a for a in found if a not in out)
    return out


class ControllerPool(ControllerChannel):
    """The agent's channel to the control plane, usable as a ``ControllerStub``: attribute
    access gives a method that calls the current controller and fails over (module doc).

    Args:
        addresses: the controllers' ``host:port``, in order of preference.
        make: builds a channel to one address (TLS or plaintext).
        resolve: expands host names (:func:`expand_targets`; tests pass ``list``).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        make: Callable[[str], grpc.Channel],
        resolve: Callable[[Sequence[str]], list[str]] = expand_targets,
    ) -> None:
        # the base class's single channel is not used: every attribute is overridden here
        self._addresses = list(addresses)
        self._make_for = make
        self._resolve = resolve
        self._lock = threading.Lock()
        self._targets = resolve(self._addresses) or list(self._addresses)
        self._resolved_at = time.monotonic()
        self._current = 0
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.ControllerStub]] = {}

    @property
    def targets(self) -> list[str]:
        """The addresses calls may go to, in order (host names expanded)."""
        with self._lock:
            return list(self._targets)

    @property
    def current(self) -> str:
        """The address the next call goes to first."""
        with self._lock:
            return self._targets[self._current % len(self._targets)]

    def _stub_for(self, address: str) -> pb_grpc.ControllerStub:
        with self._lock:
            found = self._channels.get(address)
            if found is None:
                channel = self._make_for(address)
                found = (channel, pb_grpc.ControllerStub(channel))
                self._channels[address] = found
            return found[1]

    def _order(self) -> list[str]:
        with self._lock:
            n = len(self._targets)
            return [self._targets[(self._current + i) % n] for i in range(n)]

    def _moved_on(self, failed: str) -> None:
        """``failed`` could not be reached: later calls start at the one after it (unless
        another thread already moved on)."""
        with self._lock:
            n = len(self._targets)
            if self._targets[self._current % n] == failed:
                self._current = (self._current + 1) % n
                if n > 1:
                    logger.warning(
                        "controller %s not reachable: using %s",
                        failed,
                        self._targets[self._current],
                    )

    def _all_failed(self) -> None:
        """Every target failed: resolve the host names again (a controller moved)."""
        now = time.monotonic()
        with self._lock:
            if now - self._resolved_at < RESOLVE_EVERY_S:
                return
            self._resolved_at = now
        targets = self._resolve(self._addresses) or list(self._addresses)
        with self._lock:
            if targets != self._targets:
                logger.info("controllers resolve to %s now", ", ".join(targets))
                self._targets, self._current = targets, 0

    def call(self, method: str, request: Any, **kwargs: Any) -> Any:
        """``method(request, **kwargs)`` on the current controller, then on the next ones
        while they are UNAVAILABLE.

        Raises:
            grpc.RpcError: the last controller's error (every one failed, or one answered
                with an error that is not UNAVAILABLE).
        """
        last: grpc.RpcError | None = None
        for address in self._order():
            try:
                return getattr(self._stub_for(address), method)(request, **kwargs)
            except grpc.RpcError as exc:
                last = exc
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                if code in MOVE_ON_CODES:
                    self._moved_on(address)
                if code not in FAILOVER_CODES:
                    raise
        self._all_failed()
        assert last is not None
        raise last

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def method(request: Any, **kwargs: Any) -> Any:
            return self.call(name, request, **kwargs)

        method.__name__ = name
        return method

    def bootstrap(self) -> pb_grpc.BootstrapStub:
        """The Bootstrap stub (certificate renewal) of the current controller."""
        address = self.current
        self._stub_for(address)
        with self._lock:
            return pb_grpc.BootstrapStub(self._channels[address][0])

    def reconnect(self) -> None:
        """New channels from the newest credentials (after a renewal); the old ones are
        closed a little later, so calls in flight finish."""
        with self._lock:
            old, self._channels = list(self._channels.values()), {}
        for channel, _ in old:
            timer = threading.Timer(OLD_CHANNEL_GRACE_S, channel.close)
            timer.daemon = True
            timer.start()

    def close(self) -> None:
        with self._lock:
            old, self._channels = list(self._channels.values()), {}
        for channel, _ in old:
            with contextlib.suppress(Exception):
                channel.close()
