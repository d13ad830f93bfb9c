"""The stored job spec and its idempotency hash do not change with how they are built: a
replay of a key submitted before an upgrade must hash to the same payload (409 otherwise)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import pytest

from gpufleet.domain.mounts import Mount
from gpufleet.domain.types import JobSpec, PriorityClass, Resources
from gpufleet.services.jobs import payload_sha256, spec_to_dict

MINIMAL = JobSpec(command=("true",), resources=Resources(1))
FULL = JobSpec(
    command=("python", "train.py"),
    resources=Resources(
        16,
        gpu_types=("H100", "A100"),
        gpu_memory_mb=40_000,
        cpu=2.5,
        memory_mb=9_000,
        nodes=2,
        gpus_per_node=8,
        allow_partial_nodes=True,
    ),
    priority=PriorityClass.HIGH,
    name="n",
    image="img:1",
    env={"A": "1"},
    max_retries=3,
    expected_duration_s=5.0,
    max_runtime_s=9.0,
    preemptible=False,
    node_selector={"zone": "a"},
    working_dir="/w",
)


def reference(spec: JobSpec) -> dict[str, Any]:
    """The original definition: ``dataclasses.asdict`` and the same adjustments."""
    data = asdict(spec)
    data["command"] = list(spec.command)
    data["resources"]["gpu_types"] = list(spec.resources.gpu_types)
    data["env"] = dict(spec.env)
    data["node_selector"] = dict(spec.node_selector)
    data["priority"] = spec.priority.value
    data["mounts"] = [dict(m) for m in data["mounts"]]
    data["notify"] = list(spec.notify)
    for key in ("pids_limit", "disk_mb", "shm_size_mb", "mounts", "notify"):  # added later:
        if data.get(key) in (None, []):  # stored only when set
            data.pop(key, None)
    r = data["resources"]
    for key, unset in (
        ("nodes", None),
        ("gpus_per_node", None),
        ("allow_partial_nodes", False),
        ("gpu_fraction", None),
    ):
        if r.get(key) == unset:
            r.pop(key, None)
    return data


BOUNDED = replace(MINIMAL, pids_limit=256, disk_mb=2048)
DATA = replace(
    MINIMAL,
    image="registry.local/x:1",
    mounts=(Mount("/data/a", "/a", True),),
    shm_size_mb=4096,
    notify=("https://hooks.example/x",),
)


@pytest.mark.parametrize("spec", [MINIMAL, FULL, BOUNDED, DATA])
def test_spec_dict_is_what_asdict_gave(spec: JobSpec) -> None:
    assert spec_to_dict(spec) == reference(spec)


def test_payload_hash_is_stable() -> None:
    # values computed by the asdict-based code (commit 074100a)
    assert payload_sha256(MINIMAL) == (
        "bb9bb12fbab17529ee61f3ac9d1bfce9f2bea8cc0c37e84c5c906586ac6552f3"
    )
    assert payload_sha256(FULL) == (
        "489f845de893018b712d173b3b76a57dc401f70903caa6bbc967bde20cbff404"
    )


def test_pids_limit_and_disk_mb_are_stored_when_given_and_change_the_payload() -> None:
    data = spec_to_dict(BOUNDED)
    assert (data["pids_limit"], data["disk_mb"]) == (256, 2048)
    assert "pids_limit" not in spec_to_dict(MINIMAL)
    assert payload_sha256(BOUNDED) != payload_sha256(MINIMAL)
