"""Ownership records of job-network objects (no root needed; the sweep itself runs on real
namespaces in tests/integration/test_job_network.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.agent import procfs
from gpufleet.agent.runtime import jobnet_owners as owners
from gpufleet.agent.runtime.jobnet import JobNet


@pytest.fixture(autouse=True)
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(owners, "REGISTRY_DIR", tmp_path / "registry")
    monkeypatch.setattr(owners, "HOST_LOCK", tmp_path / "lock")
    return tmp_path / "registry"


def live_other(tag: str) -> owners.Owner:
    """PID 1 as the owner: another process that runs."""
    return owners.Owner(tag, "node-x-1", 1, procfs.start_ticks(1) or 0, procfs.boot_id())


def dead_other(tag: str) -> owners.Owner:
    """A process that ran and was reaped."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ticks = procfs.start_ticks(child.pid) or 0
    child.kill()
    child.wait()
    return owners.Owner(tag, "node-x-1", child.pid, ticks, procfs.boot_id())


class TestOwner:
    def test_the_same_process_is_alive_and_a_reaped_one_or_an_ended_one_is_not(self) -> None:
        assert live_other("aaaa").alive()
        assert not dead_other("aaaa").alive()
        assert not live_other("aaaa").alive(ended=frozenset({1}))
        reused = owners.Owner("aaaa", "s", 1, (procfs.start_ticks(1) or 0) + 1, procfs.boot_id())
        assert not reused.alive(), "a pid with another start time is another process"
        assert not owners.Owner("aaaa", "s", 1, procfs.start_ticks(1) or 0, "old-boot").alive()


class TestClaim:
    @pytest.mark.parametrize(
        ("other", "take_over", "want_mine"),
        [
            pytest.param(None, False, True, id="a tag nobody owns is claimed"),
            pytest.param(live_other, False, False, id="a live owner keeps its tag"),
            pytest.param(live_other, True, True, id="an agent at its start takes its tag"),
            pytest.param(dead_other, False, True, id="a dead owner's tag is claimed"),
        ],
    )
    def test_claim(self, other: object, take_over: bool, want_mine: bool) -> None:
        if callable(other):
            owners.claim(other("beef"), take_over=True)
        mine = owners.me("beef", "node-a-1", [(999, 999)])
        owners.claim(mine, take_over=take_over)
        assert (owners.read("beef") == mine) is want_mine
        assert set(owners.owners()) == {"beef"}

    def test_release_keeps_a_live_other_owner_and_forgets_a_dead_one_or_this_one(self) -> None:
        owners.claim(live_other("0001"), take_over=True)
        owners.claim(dead_other("0002"), take_over=True)
        owners.claim(owners.me("0003", "s"), take_over=True)
        for tag in ("0001", "0002", "0003"):
            owners.release(tag)
        assert set(owners.owners()) == {"0001"}

    def test_a_sweep_without_gone_owners_runs_no_command(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def refuse() -> list[str]:
            raise AssertionError("listed the host's links or tables")

        monkeypatch.setattr(owners, "_links", refuse)
        monkeypatch.setattr(owners, "_tables", refuse)
        owners.claim(live_other("0001"), take_over=True)
        assert not owners.sweep()


def test_the_sweep_recognises_the_names_jobnet_makes() -> None:
    net = JobNet("netns", "node-a-1234")
    ns = owners.NS_RE.fullmatch(net.ns_name("r-1"))
    link = owners.LINK_RE.fullmatch(net.host_if("r-1"))
    table = owners.TABLE_RE.fullmatch(f"table inet {net.table}")
    assert ns and link and table
    assert ns[1] == link[1] == table[1] == net.tag and ns[2] == link[2]
