"""Hosts as Linux network namespaces on a private switch, all inside this machine.

A :class:`Network` is one switch namespace holding a bridge, and one namespace per "host"
joined to it by a veth pair (``eth0`` inside the host, on ``10.77.0.0/24`` by default). The
bridge lives in its own namespace, not the machine's, so the subnet exists nowhere else: two
networks (two test runs) never collide, and no traffic reaches the machine's own interfaces.

Namespaces are named ``gfmh<owner pid>x<serial>-<host>``; :func:`clean_leftovers` removes
those whose owner process is gone (a crashed run), with everything still running in them.
Needs root, ``ip`` (iproute2).

Processes are started in a host with :meth:`Network.popen` (``ip netns exec``, which execs
the command: the pid is the command's own). :meth:`Network.call_in` runs a Python function in
a host's namespace, on a thread that entered it (``setns``), so a test can use httpx or boto3
against the hosts' addresses without a subprocess.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ipaddress
import itertools
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
PREFIX = "gfmh"
_serial = itertools.count()
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-")


class NetnsError(RuntimeError):
    """An ``ip`` command failed (its command line and stderr in the message)."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Run ``ip ARGS`` (in ``netns`` when given); its stdout. Raises NetnsError on failure."""
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


def _namespaces() -> list[str]:
    out = ip("netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace(ns: str, *, grace_s: float = 2.0) -> None:
    """SIGTERM every process in ``ns``, SIGKILL what is left after ``grace_s``, delete it."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        pids = _pids_in(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _pid_alive(p)]
            time.sleep(0.05)
    ip("netns", "delete", ns, check=False)


def _pids_in(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def clean_leftovers() -> list[str]:
    """Delete the namespaces (and kill their processes) of networks whose owner process is
    gone; returns their names."""
    gone = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            kill_namespace(ns, grace_s=0.5)
            gone.append(ns)
    return gone


@dataclass
class Host:
    """One host: its namespace, address and the name of its interface (``eth0``)."""

    name: str
    netns: str
    address: str
    iface: str = "eth0"


@dataclass
class Network:
    """A switch (bridge in its own namespace) and hosts on ``subnet``.

    Args:
        subnet: the private subnet, e.g. ``10.77.0.0/24`` (exists only in these namespaces).
        owner_pid: the process whose death makes the namespaces leftovers (default: this one).
    """

    subnet: str = "10.77.0.0/24"
    owner_pid: int = field(default_factory=os.getpid)
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tag = f"{PREFIX}{self.owner_pid}x{next(_serial)}"
        self.switch = f"{self.tag}-sw"
        self._net = ipaddress.ip_network(self.subnet)
        self._workers: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._veths = itertools.count()

    # -- building and tearing down ---------------------------------------------------------

    def create(self) -> Network:
        """Make the switch namespace and its bridge (cleans leftovers of crashed runs first)."""
        clean_leftovers()
        ip("netns", "add", self.switch)
        ip("link", "set", "lo", "up", netns=self.switch)
        ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        ip("link", "set", "br0", "up", netns=self.switch)
        return self

    def add_host(self, name: str, last_octet: int) -> Host:
        """A host namespace with ``eth0`` at the subnet's address ``.last_octet``, on the
        switch."""
        if name in self.hosts:
            raise ValueError(f"host {name} exists")
        address = str(self._net.network_address + last_octet)
        ns = f"{self.tag}-{name}"
        ip("netns", "add", ns)
        ip("link", "set", "lo", "up", netns=ns)
        n = next(self._veths)
        outer, inner = f"v{self.owner_pid % 100000}s{n}", f"v{self.owner_pid % 100000}h{n}"
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", outer, "netns", self.switch)
        ip("link", "set", outer, "master", "br0", netns=self.switch)
        ip("link", "set", outer, "up", netns=self.switch)
        ip("link", "set", inner, "netns", ns)
        ip("link", "set", inner, "name", "eth0", netns=ns)
        ip("addr", "add", f"{address}/{self._net.prefixlen}", "dev", "eth0", netns=ns)
        ip("link", "set", "eth0", "up", netns=ns)
        host = Host(name, ns, address)
        self.hosts[name] = host
        return host

    def destroy(self) -> None:
        """Kill everything in the hosts and delete every namespace of this network."""
        for worker in self._workers.values():
            worker.shutdown(wait=False, cancel_futures=True)
        self._workers.clear()
        for host in self.hosts.values():
            kill_namespace(host.netns)
        kill_namespace(self.switch)
        self.hosts.clear()

    # -- links -----------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Take the host's link down (``ip link set eth0 down`` in its namespace): it can
        reach nobody and nobody can reach it; its processes keep running."""
        ip("link", "set", self.hosts[name].iface, "down", netns=self.hosts[name].netns)

    def restore(self, name: str) -> None:
        """Bring the host's link back up."""
        ip("link", "set", self.hosts[name].iface, "up", netns=self.hosts[name].netns)

    # -- running things in a host ----------------------------------------------------------

    def argv(self, name: str, cmd: list[str], *, user: str | None = None) -> list[str]:
        """The command line that runs ``cmd`` in host ``name`` (as ``user`` when given)."""
        prefix = ["ip", "netns", "exec", self.hosts[name].netns]
        if user:
            prefix += ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"]
        return prefix + cmd

    def popen(
        self,
        name: str,
        cmd: list[str],
        *,
        log: Path,
        env: dict[str, str] | None = None,
        user: str | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` in host ``name`` in its own session, output appended to ``log``."""
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.argv(name, cmd, user=user),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )

    def run(
        self,
        name: str,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout_s: float = 60,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in host ``name`` to completion; raises AssertionError naming its output
        when ``check`` and it fails."""
        r = subprocess.run(
            self.argv(name, cmd, user=user),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"{name}: {' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
            )
        return r

    def call_in(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a thread that lives in host ``name``'s network namespace
        (one thread per host, kept): sockets it opens are that host's."""
        worker = self._workers.get(name)
        if worker is None:
            worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"netns-{name}",
                initializer=_enter,
                initargs=(self.hosts[name].netns,),
            )
            self._workers[name] = worker
        return worker.submit(fn, *args, **kwargs).result()


def _enter(netns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)
