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


def _failing_engine(
    tmp_path: Path, message: str, *, graph_root: Path | None = None
) -> ContainerEngine:
    """An engine whose every call fails with ``message``, except ``info`` when ``graph_root``
    is given (it then names that directory as its graph root, as podman does)."""
    script = tmp_path / "fake-podman"
    info = (
        f'for a in "$@"; do [ "$a" = info ] && {{ echo {str(graph_root)!r}; exit 0; }}; done\n'
        if graph_root is not None
        else ""
    )
    script.write_text(f"#!/bin/sh\n{info}echo {message!r} >&2\nexit 125\n")
    script.chmod(0o755)
    return ContainerEngine("podman", state_dir=tmp_path / "s", binary=str(script))


def _sound_root(tmp_path: Path) -> Path:
    root = tmp_path / "graph"
    root.mkdir(exist_ok=True)
    return root


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
        # the registry's own answer carries the node-fault words: still the job's
        "Error: reading manifest 1 in 127.0.0.1:1/x: manifest unknown: write"
        " /var/lib/containers/storage: no space left on device",
        "Error: creating overlay mount to /var/lib/containers/storage/overlay/x: input/output"
        " error",
    ],
)
def test_a_pull_failure_is_the_jobs_while_the_nodes_own_check_passes(
    tmp_path: Path, message: str
) -> None:
    engine = _failing_engine(tmp_path, message, graph_root=_sound_root(tmp_path))
    with pytest.raises(ImageUnavailable) as exc:
        engine.pull("127.0.0.1:1/x:1")
    assert "no space" not in str(exc.value) and "overlay" not in str(exc.value)
    assert list((tmp_path / "graph").iterdir()) == []  # the probe file is removed


def test_a_pull_failure_is_the_nodes_when_the_engine_or_its_storage_fails(tmp_path: Path) -> None:
    msg = "Error: writing blob: no space left on device"
    # the engine does not answer info
    with pytest.raises(EngineError) as exc:
        _failing_engine(tmp_path, msg).pull("127.0.0.1:5000/x:1")
    assert not isinstance(exc.value, ImageUnavailable)
    assert "does not answer info" in str(exc.value)
    # its graph root cannot take a write (a file where the directory should be)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    with pytest.raises(EngineError) as exc:
        _failing_engine(tmp_path, msg, graph_root=blocked).pull("127.0.0.1:5000/x:1")
    assert not isinstance(exc.value, ImageUnavailable)
    assert "not writable" in str(exc.value)
    # too little free space
    engine = _failing_engine(tmp_path, msg, graph_root=_sound_root(tmp_path))
    engine.min_free_mb = 1 << 40
    with pytest.raises(EngineError) as exc:
        engine.pull("127.0.0.1:5000/x:1")
    assert not isinstance(exc.value, ImageUnavailable) and "MiB free" in str(exc.value)


@pytest.mark.parametrize(
    "message",
    [
        'Error: pinging container registry 127.0.0.1:5432: Get "http://127.0.0.1:5432/v2/":'
        " dial tcp 127.0.0.1:5432: connect: connection refused",
        'Error: pinging container registry 127.0.0.1:6379: Get "http://127.0.0.1:6379/v2/": EOF',
        "Error: pinging container registry 127.0.0.1:8000: invalid status code from registry 404"
        " (Not Found)",
        "Error: x509: certificate signed by unknown authority",
    ],
)
def test_the_reason_of_an_unreachable_registry_tells_no_service_apart(
    tmp_path: Path, message: str
) -> None:
    engine = _failing_engine(tmp_path, message, graph_root=_sound_root(tmp_path))
    with pytest.raises(ImageUnavailable) as exc:
        engine.pull("127.0.0.1:7/x:1")
    assert str(exc.value) == "registry 127.0.0.1:7 unreachable or not a registry"


def test_a_pull_from_the_deny_list_is_refused_before_any_connection(tmp_path: Path) -> None:
    from gpufleet.agent.runtime.jobnet import JobNet, NetPolicy, default_deny, parse_targets

    marker = tmp_path / "ran"
    script = tmp_path / "fake-podman"
    script.write_text(f"#!/bin/sh\ntouch {marker}\nexit 0\n")
    script.chmod(0o755)
    engine = ContainerEngine("podman", state_dir=tmp_path / "s", binary=str(script))
    deny = (*default_deny(["127.0.0.1:7443"]), *parse_targets("10.9.0.0/16,127.0.0.2"))
    engine.jobnet = JobNet("host", "t", NetPolicy(deny=deny, own_ports=(50051,)))
    for image in (
        "127.0.0.1:7443/x:1",  # the controller
        "169.254.169.254/x:1",  # the metadata range, default port
        "169.254.169.254:80/x:1",
        "10.9.3.4:5000/x:1",  # --job-egress-deny
        "127.0.0.2:5000/x:1",
        "localhost:50051/x:1",  # the agent's own port
    ):
        with pytest.raises(ImageUnavailable, match="deny list"):
            engine.pull(image)
    assert not marker.exists()
    engine.pull("127.0.0.1:5000/x:1")  # another port of the same host is allowed
    assert marker.exists()


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
