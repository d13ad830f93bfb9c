"""The namespace helper itself: hosts reach each other on the private subnet only, a cut link
cuts, and the namespaces of a run that died are found and removed with their processes."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multihost.netns import Network, clean_leftovers, ip


@pytest.fixture
def net() -> Iterator[Network]:
    assert os.geteuid() == 0, "network namespaces need root"
    n = Network().create()
    yield n
    n.destroy()


def _connect(address: str, port: int) -> str:
    with socket.create_connection((address, port), timeout=2) as c:
        c.sendall(b"ping")
        return "sent"


def test_hosts_talk_over_the_bridge_and_a_cut_link_cuts(net: Network) -> None:
    a, b = net.add_host("a", 2), net.add_host("b", 3)
    srv = net.call_in("b", lambda: socket.create_server((b.address, 7000)))
    try:
        assert net.call_in("a", _connect, b.address, 7000) == "sent"
        conn, peer = srv.accept()
        assert conn.recv(4) == b"ping" and peer[0] == a.address
        conn.close()
        net.cut("a")
        with pytest.raises(OSError, match="unreachable"):
            net.call_in("a", _connect, b.address, 7000)
        net.restore("a")
        assert net.call_in("a", _connect, b.address, 7000) == "sent"
    finally:
        srv.close()
    # the subnet is nowhere but in the namespaces: not in this machine's own routes
    assert "10.77.0." not in ip("route", "show")
    assert "10.77.0." not in ip("addr", "show")


def test_leftovers_of_a_dead_run_are_removed_with_their_processes(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: the "crashed" owner
    old = Network(owner_pid=dead.pid).create()
    old.add_host("h", 2)
    sleeper = old.popen("h", ["sleep", "600"], log=tmp_path / "sleep.log")
    names = {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}
    assert {old.switch, old.hosts["h"].netns} <= names
    removed = clean_leftovers()
    assert set(removed) >= {old.switch, old.hosts["h"].netns}
    sleeper.wait(timeout=10)  # killed with its namespace
    names = {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}
    assert not names & {old.switch, old.hosts["h"].netns}
    # a live run's namespaces are left alone
    live = Network().create()
    try:
        live.add_host("h", 2)
        time.sleep(0.1)
        assert live.hosts["h"].netns not in clean_leftovers()
    finally:
        live.destroy()
