"""POST /v1/jobs refuses empty and mistyped fields with a 422 naming the field itself
(never 201 for an empty image, array or dependency, never ``depends_on.str``), on both
databases."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_api import JOB, hdr
from tests.integration.test_api import api as api  # the `api` fixture, re-exported


class TestSubmitRefuses:
    @pytest.mark.parametrize(
        ("extra", "want_field"),
        [
            pytest.param({"image": ""}, "image", id="empty image"),
            pytest.param({"array": ""}, "array", id="empty array"),
            pytest.param({"depends_on": ""}, "depends_on", id="empty depends_on"),
            pytest.param({"depends_on": 5}, "depends_on", id="depends_on a number"),
            pytest.param({"depends_on": {"a": 1}}, "depends_on", id="depends_on a mapping"),
            pytest.param({"gpu_type": 5}, "gpu_type", id="gpu_type a number"),
            pytest.param({"gpu_type": ""}, "gpu_type", id="empty gpu_type"),
            pytest.param({"depends_on": ["j-1"]}, "depends_on", id="a dependency not a mapping"),
            pytest.param(
                {"depends_on": [{"type": "afterok", "job_id": ""}]},
                "depends_on",
                id="a dependency on an empty job id",
            ),
            pytest.param({"pids_limit": 0}, "pids_limit", id="pids_limit 0"),
            pytest.param({"pids_limit": -5}, "pids_limit", id="pids_limit negative"),
            pytest.param({"pids_limit": "64"}, "pids_limit", id="pids_limit a string"),
            pytest.param({"pids_limit": 64.5}, "pids_limit", id="pids_limit a float"),
            pytest.param({"pids_limit": 10**8}, "pids_limit", id="pids_limit above pid_max"),
            pytest.param({"disk_mb": 0}, "disk_mb", id="disk_mb 0"),
            pytest.param({"disk_mb": 15}, "disk_mb", id="disk_mb below 16"),
            pytest.param({"disk_mb": True}, "disk_mb", id="disk_mb a bool"),
            pytest.param({"disk_mb": 10**12}, "disk_mb", id="disk_mb above 64 TiB"),
        ],
    )
    def test_422_naming_the_field(self, api: Any, extra: dict[str, Any], want_field: str) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json={**JOB, **extra}, headers=hdr(tokens["vision"]))
        assert r.status_code == 422, r.text
        field = r.json()["field"]
        assert field.split(".")[0] == want_field
        assert ".str" not in field and "constrained" not in field

    def test_the_scalar_errors_name_exactly_the_field(self, api: Any) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json={**JOB, "depends_on": 5}, headers=hdr(tokens["vision"]))
        assert r.json()["field"] == "depends_on"
        # a message that starts with the field's name is not prefixed with it a second time
        assert r.json()["message"] == "depends_on must be a string or a list, not int"

    @pytest.mark.parametrize(
        ("extra", "field", "message"),
        [
            pytest.param(
                {"image": "busybox", "shm_size_mb": 10**11},
                "shm_size_mb",
                "shm_size_mb: 100000000000 is out of range: it must be at most 16777216",
                id="shm_size_mb too big",
            ),
            pytest.param(
                {"notify": ["notaurl"]},
                "notify",
                "notify URL 'notaurl' must be an http:// or https:// URL",
                id="notify not a URL",
            ),
            pytest.param(
                {"gpu_count": 0},
                "gpu_count",
                "gpu_count: 0 is out of range: it must be at least 1",
                id="gpu_count 0",
            ),
        ],
    )
    def test_plain_words_naming_the_field(
        self, api: Any, extra: dict[str, Any], field: str, message: str
    ) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json={**JOB, **extra}, headers=hdr(tokens["vision"]))
        assert r.status_code == 422, r.text
        assert r.json()["field"] == field and r.json()["message"] == message, r.text

    @pytest.mark.parametrize(
        "extra",
        [
            pytest.param({"image": "busybox"}, id="an image"),
            pytest.param({"array": "0-1"}, id="an array"),
            pytest.param({"image": None, "depends_on": None, "array": None}, id="nulls"),
            pytest.param({"name": ""}, id="an empty name is no name"),
            pytest.param({"pids_limit": 512, "disk_mb": 4096}, id="pids_limit and disk_mb"),
        ],
    )
    def test_valid_values_still_201(self, api: Any, extra: dict[str, Any]) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json={**JOB, **extra}, headers=hdr(tokens["vision"]))
        assert r.status_code == 201, r.text


def test_pids_limit_and_disk_mb_are_shown_on_the_job(api: Any) -> None:
    client, tokens = api
    body = {**JOB, "pids_limit": 300, "disk_mb": 2048}
    r = client.post("/v1/jobs", json=body, headers=hdr(tokens["vision"]))
    assert r.status_code == 201, r.text
    job = client.get(f"/v1/jobs/{r.json()['job_id']}", headers=hdr(tokens["vision"])).json()
    assert (job["pids_limit"], job["disk_mb"]) == (300, 2048)


class TestImageReferences:
    """An image reference is checked against the OCI distribution grammar at submit: never an
    engine option, never upper-case, no whitespace (before, these reached podman's argv and
    failed every node they were placed on)."""

    @pytest.mark.parametrize(
        ("image", "says"),
        [
            ("--help", "must not start with '-'"),
            ("--privileged", "must not start with '-'"),
            ("--volume=/:/host", "must not start with '-'"),
            ("-v", "must not start with '-'"),
            ("UPPER/case", "must be lower-case"),
            ("Busybox", "must be lower-case"),
            ("busy box", "whitespace"),
            ("a//b", "empty path component"),
            ("docker://busybox", "not a URL or transport"),
            ("busybox:", "empty tag"),
            ("busybox@sha256:12", "is not algorithm:hex"),
            ("127.0.0.1:99999/x", "not a TCP port"),
        ],
    )
    def test_a_bad_reference_is_a_422_naming_image(self, api: Any, image: str, says: str) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json={**JOB, "image": image}, headers=hdr(tokens["vision"]))
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "image" and says in r.json()["message"], r.json()

    @pytest.mark.parametrize(
        "image",
        [
            "busybox",
            "python:3.11",
            "127.0.0.1:5000/gpufleet/busybox:1",
            "127.0.0.1:1/x",  # valid, if unreachable: the attempt fails as the job's fault
            "localhost/a.b_c-d/e__f:TAG-1.x",
            "[::1]:5000/img",
            "ghcr.io/org/img@sha256:" + "0" * 64,
            "ghcr.io/org/img:1@sha256:" + "0" * 64,
        ],
    )
    def test_a_valid_reference_is_accepted(self, api: Any, image: str) -> None:
        client, tokens = api
        r = client.post("/v1/jobs", json={**JOB, "image": image}, headers=hdr(tokens["vision"]))
        assert r.status_code == 201, r.text

    def test_the_service_refuses_it_too(self) -> None:
        """Callers that bypass the REST model (the service layer itself) get the same 422."""
        from gpufleet.domain.errors import ValidationFailed
        from gpufleet.domain.images import check_reference

        with pytest.raises(ValidationFailed) as exc:
            check_reference("--help")
        assert exc.value.field == "image"
