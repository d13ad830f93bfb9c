"""The container engine adapter's hardening flags, user-namespace maps and the blame of a
failed pull (the engine CLI replaced by a script that fails with a given message)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufleet.agent.runtime.container_engine import (
    USERNS_HOST_BASE,
    ContainerEngine,
    ContainerSecurity,
    EngineError,
    ImageUnavailable,
    id_map,
    security_args,
)


def test_defaults_drop_every_capability_and_forbid_new_privileges() -> None:
    args = security_args("podman", ContainerSecurity())
    assert args[:4] == ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    assert "--cap-add" not in args and "--read-only" not in args and "--uidmap" not in args
    assert args[args.index("--pids-limit") + 1] == "4096"


def test_the_job_ids_map_to_themselves_and_nothing_maps_to_host_root() -> None:
    uid, gid = 1_900_000_123, 999
    args = security_args("podman", ContainerSecurity(userns=True, keep_ids=(uid, gid)))
    uids = [args[i + 1] for i, a in enumerate(args) if a == "--uidmap"]
    gids = [args[i + 1] for i, a in enumerate(args) if a == "--gidmap"]
    assert uids == [f"0:{USERNS_HOST_BASE}:65536", f"{uid}:{uid}:1"]
    # a gid inside 0..65535 splits the range (maps may not overlap)
    assert gids == [
        f"0:{USERNS_HOST_BASE}:999",
        "999:999:1",
        f"1000:{USERNS_HOST_BASE + 1000}:64536",
    ]
    for m in uids + gids:
        _inside, host, count = (int(x) for x in m.split(":"))
        assert not host <= 0 < host + count  # host root is never mapped
    assert id_map(None) == [f"0:{USERNS_HOST_BASE}:65536"] == id_map(0)
    # docker has no per-container user namespace: no maps, the rest alike
    assert "--uidmap" not in security_args("docker", ContainerSecurity(userns=True))


def _failing_engine(tmp_path: Path, message: str) -> ContainerEngine:
    script = tmp_path / "fake-podman"
    script.write_text(f"#!/bin/sh\necho {message!r} >&2\nexit 125\n")
    script.chmod(0o755)
    return ContainerEngine("podman", state_dir=tmp_path / "s", binary=str(script))


@pytest.mark.parametrize(
    "message",
    [
        "Error: initializing source docker://127.0.0.1:1/x:latest: pinging container registry"
        ' 127.0.0.1:1: Get "http://127.0.0.1:1/v2/": dial tcp 127.0.0.1:1: connect: connection'
        " refused",
        "Error: reading manifest 1 in 127.0.0.1:5000/gpufleet/nope: manifest unknown",
        "Error: unauthorized: authentication required",
        "Error: x509: certificate signed by unknown authority",
        "Error: something nobody has seen before",
    ],
)
def test_a_pull_failure_is_the_jobs_unless_the_node_storage_failed(
    tmp_path: Path, message: str
) -> None:
    with pytest.raises(ImageUnavailable):
        _failing_engine(tmp_path, message).pull("127.0.0.1:1/x:1")


@pytest.mark.parametrize(
    "message",
    [
        "Error: writing blob: adding layer: write /var/lib/containers/x: no space left on device",
        "Error: creating overlay mount to /var/lib/containers/storage/overlay/x: input/output"
        " error",
    ],
)
def test_a_pull_failure_of_the_nodes_storage_is_the_nodes(tmp_path: Path, message: str) -> None:
    with pytest.raises(EngineError) as exc:
        _failing_engine(tmp_path, message).pull("127.0.0.1:5000/x:1")
    assert not isinstance(exc.value, ImageUnavailable)


def test_an_invalid_reference_never_reaches_the_engine(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "fake-podman"
    script.write_text(f"#!/bin/sh\ntouch {marker}\nexit 0\n")
    script.chmod(0o755)
    engine = ContainerEngine("podman", state_dir=tmp_path / "s", binary=str(script))
    for bad in ("--help", "--volume=/:/host", "UPPER/case"):
        with pytest.raises(ImageUnavailable):
            engine.pull(bad)
        assert engine.has_image(bad) is False
    assert not os.path.exists(marker)


def test_the_jobs_pids_limit_wins_over_the_nodes(tmp_path: Path) -> None:
    """A job spec's ``pids_limit`` (carried on the attempt's record) sets ``--pids-limit``;
    without one the node's ``--container-pids-limit`` applies."""
    from types import SimpleNamespace

    from gpufleet.agent.runtime.base import JobUser
    from gpufleet.agent.runtime.container import ContainerLaunch, ContainerRuntime
    from gpufleet.agent.workdir import RunPaths

    engine = _failing_engine(tmp_path, "unused")
    rt = ContainerRuntime(engine, cdi=False, userns="off", pids_limit=512)
    launch = ContainerLaunch(
        paths=RunPaths(tmp_path / "r"),
        image="busybox",
        command=("true",),
        env={},
        user=JobUser(1_900_000_001, 999),
    )
    assert rt.security_for(SimpleNamespace(pids_limit=77), launch).pids_limit == 77
    assert rt.security_for(SimpleNamespace(pids_limit=0), launch).pids_limit == 512
    assert rt.security_for(SimpleNamespace(), launch).pids_limit == 512
    sec = rt.security_for(SimpleNamespace(), launch)
    assert sec.keep_ids == (1_900_000_001, 999) and not sec.userns and not sec.read_only
    with pytest.raises(ValueError, match="userns"):
        ContainerRuntime(engine, cdi=False, userns="maybe")
