"""``submit --export`` (Slurm's environment propagation), the idempotency key's visibility,
and the exit code of ``submit --wait``, against the in-test fake API of test_cli_client."""

from __future__ import annotations

import os

import httpx
import pytest

from gpufleet.cli.options import ClientError
from gpufleet.cli.submit import exit_code_of, export_env
from gpufleet.client._core import SUBMIT_RETRY_DELAYS_S
from tests.unit.test_cli_client import FakeApi, attempt, cli, job
from tests.unit.test_cli_client import api as api  # the `api` fixture, re-exported

SHELL = {"PATH": "/venv/bin:/usr/bin", "HOME": "/home/u", "LR": "0.1", "GPUFLEET_TOKEN": "t0"}


class TestExportEnv:
    @pytest.mark.parametrize(
        ("spec", "want"),
        [
            pytest.param("NONE", {}, id="NONE: nothing"),
            pytest.param(
                "ALL",
                {"PATH": "/venv/bin:/usr/bin", "HOME": "/home/u", "LR": "0.1"},
                id="ALL: everything but GPUFLEET_* (the CLI's token)",
            ),
            pytest.param(
                "ALL,LR=0.5,EXTRA=1",
                {"PATH": "/venv/bin:/usr/bin", "HOME": "/home/u", "LR": "0.5", "EXTRA": "1"},
                id="ALL plus values",
            ),
            pytest.param("LR,MODE=fast", {"LR": "0.1", "MODE": "fast"}, id="only the named ones"),
            pytest.param("UNSET_VAR", {}, id="an unset name is skipped"),
            pytest.param("all", dict(SHELL, GPUFLEET_TOKEN=None), id="case-insensitive ALL"),
        ],
    )
    def test_spec(self, spec: str, want: dict[str, str | None]) -> None:
        assert export_env(spec, dict(SHELL)) == {k: v for k, v in want.items() if v is not None}

    @pytest.mark.parametrize("spec", ["GPUFLEET_TOKEN", "LR,ALL", "", "=x"])
    def test_refused(self, spec: str) -> None:
        with pytest.raises(ClientError) as info:
            export_env(spec, dict(SHELL))
        assert info.value.field == "export"


class TestSubmitExport:
    def test_default_none_and_named(self, api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LR", "0.1")
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "j-1", "status": "P"}))
        assert cli("submit", "--env", "A=1", "--", "true").exit_code == 0
        assert cli("submit", "--export", "NONE", "--env", "A=1", "--", "true").exit_code == 0
        assert cli("submit", "--export", "LR,B=2", "--", "true").exit_code == 0
        assert cli("submit", "--export", "ALL", "--env", "LR=9", "--", "true").exit_code == 0
        default, none, named, everything = (b.get("env") for b in api.bodies())
        assert default == {"PATH": os.environ["PATH"], "A": "1"}  # the job's env + PATH
        assert none == {"A": "1"}
        assert named == {"LR": "0.1", "B": "2"}
        assert everything["LR"] == "9"  # the job's own env wins over the shell's
        assert everything["PATH"] == os.environ["PATH"]
        assert not [k for k in everything if k.startswith("GPUFLEET_")]

    def test_image_job_exports_only_when_asked(
        self, api: FakeApi, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("LR", "0.1")
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "j-1", "status": "P"}))
        assert cli("submit", "--image", "r/i:1", "--", "true").exit_code == 0
        assert cli("submit", "--image", "r/i:1", "--export", "LR", "--", "true").exit_code == 0
        plain, exported = api.bodies()
        assert "env" not in plain and exported["env"] == {"LR": "0.1"}


class TestIdempotencyKeyVisibility:
    def test_retry_after_a_503_reuses_and_shows_the_key(
        self, api: FakeApi, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr("gpufleet.client._sync.time.sleep", lambda _s: None)
        api.on(
            "POST",
            "/v1/jobs",
            httpx.Response(503, json={"error": "database_unavailable", "message": "down"}),
            httpx.Response(201, json={"job_id": "j-1", "status": "PENDING"}),
        )
        result = cli("submit", "--", "true")
        assert result.exit_code == 0, result.stderr
        keys = {r.headers["Idempotency-Key"] for r in api.requests}
        assert len(keys) == 1 and keys.pop() in result.stderr

    def test_a_server_down_for_15_s_gets_the_submit_with_one_key(
        self, api: FakeApi, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A restart of ``gpufleet up`` (API down for seconds) does not lose a submit: it is
        retried for ~20 s with the same key, then given up with exit 1."""
        slept: list[float] = []
        monkeypatch.setattr("gpufleet.client._sync.time.sleep", slept.append)

        def refuse(request: httpx.Request) -> httpx.Response:
            if sum(slept) < 15:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(201, json={"job_id": "j-1", "status": "PENDING"})

        api.on("POST", "/v1/jobs", refuse)
        result = cli("submit", "--", "true")
        assert result.exit_code == 0, result.stderr
        assert sum(slept) >= 15 and len({r.headers["Idempotency-Key"] for r in api.requests}) == 1
        slept.clear()
        down = [0]

        def always_refuse(request: httpx.Request) -> httpx.Response:
            down[0] += 1
            raise httpx.ConnectError("connection refused", request=request)

        api.on("POST", "/v1/jobs", always_refuse)
        result = cli("submit", "--", "true")
        assert result.exit_code == 1 and "cannot reach gpufleet" in result.stderr
        assert down[0] == len(SUBMIT_RETRY_DELAYS_S) + 1 and 19 <= sum(slept) <= 21
        key = api.requests[-1].headers["Idempotency-Key"]
        assert f"submit again with --idempotency-key {key}" in result.stderr

    def test_conflict_names_the_key(self, api: FakeApi) -> None:
        api.on(
            "POST",
            "/v1/jobs",
            httpx.Response(
                409,
                json={
                    "error": "idempotency_key_reused_with_different_payload",
                    "message": "key reused",
                    "field": "Idempotency-Key",
                },
            ),
        )
        result = cli("submit", "--idempotency-key", "k-9", "--", "true")
        assert result.exit_code == 2
        assert "k-9" in result.stderr and "Idempotency-Key" in result.stderr


class TestWaitExitCode:
    @pytest.mark.parametrize(
        ("status", "codes", "want"),
        [
            pytest.param("SUCCEEDED", [0], 0, id="succeeded"),
            pytest.param("FAILED", [7], 7, id="the job's own code"),
            pytest.param("FAILED", [3, 7], 7, id="the last attempt's code"),
            pytest.param("FAILED", [-9], 137, id="killed by SIGKILL: 128+9"),
            pytest.param("FAILED", [-15], 143, id="killed by SIGTERM: 128+15"),
            pytest.param("FAILED", [200], 200, id="the job's own code above 128"),
            pytest.param("FAILED", [255], 255, id="the job's own 255"),
            pytest.param("CANCELLED", [-15], 1, id="stopped on request: 1"),
            pytest.param("EXPIRED", [-9], 1, id="stopped at max_runtime_s: 1"),
            pytest.param("CANCELLED", [], 1, id="never ran: 1"),
        ],
    )
    def test_exit_code_of(self, status: str, codes: list[int], want: int) -> None:
        runs = [attempt(f"r{i}", "FAILED", exit_code=c) for i, c in enumerate(codes)]
        assert exit_code_of(job(status=status, attempts=runs)) == want

    def test_failed_wait_shows_the_log_tail(self, api: FakeApi) -> None:
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "j-1", "status": "P"}))
        failed = job("j-1", "FAILED", attempts=[attempt("r1", "FAILED", exit_code=5)])
        api.on("GET", "/v1/jobs/j-1", httpx.Response(200, json=failed))
        api.on("GET", "/v1/jobs/j-1/logs", httpx.Response(200, text="boom\n"))
        result = cli("submit", "--wait", "--", "false")
        assert result.exit_code == 5
        assert "boom" in result.stderr
        logs = next(r for r in api.requests if r.url.path.endswith("/logs"))
        assert logs.url.params["tail"] == "20"
