"""CLI answers found wrong by a new-user trial: bulk cancel matching nothing, empty job ids,
release/cancel of finished jobs, human values in ``update``, ``logs`` truncation and jobs that
end without running, prefix-too-short messages (against the fake API of test_cli_client)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.unit.test_cli_client import FakeApi, attempt, cli, job
from tests.unit.test_cli_client import api as api  # the `api` fixture, re-exported


class TestBulkCancelMatchingNothing:
    @pytest.mark.parametrize("extra", [["--yes"], []], ids=["--yes", "asks first"])
    def test_says_no_job_matched_and_exits_3(self, api: FakeApi, extra: list[str]) -> None:
        api.on(
            "POST", "/v1/jobs/cancel", httpx.Response(200, json={"cancelled": [], "skipped": []})
        )
        result = cli("cancel", "--name", "nosuchname", *extra)
        assert result.exit_code == 3
        assert "no job matched" in result.stderr

    def test_only_finished_matches_say_so(self, api: FakeApi) -> None:
        body = {"cancelled": [], "skipped": [{"job_id": "j-1", "status": "SUCCEEDED"}]}
        api.on("POST", "/v1/jobs/cancel", httpx.Response(200, json=body))
        result = cli("cancel", "--name", "done", "--yes")
        assert result.exit_code == 3
        assert "no job matched" in result.stderr and "1 matched but already finished" in (
            result.stderr
        )

    def test_a_match_still_exits_0(self, api: FakeApi) -> None:
        body = {"cancelled": [{"job_id": "j-1", "status": "PENDING"}], "skipped": []}
        api.on("POST", "/v1/jobs/cancel", httpx.Response(200, json=body))
        result = cli("cancel", "--name", "later", "--yes")
        assert result.exit_code == 0 and "cancel requested: j-1" in result.stdout


def _tail_server(log: bytes):  # type: ignore[no-untyped-def]
    """A logs handler with the server's ``tail`` semantics (the last N lines)."""

    def handle(request: httpx.Request) -> httpx.Response:
        tail = request.url.params.get("tail")
        if tail is None:
            return httpx.Response(200, content=log)
        lines = log.splitlines(keepends=True)
        n = int(tail)
        return httpx.Response(200, content=b"".join(lines[-n:] if n else []))

    return handle


class TestLogsTruncationNote:
    @pytest.mark.parametrize(
        ("total", "args", "note"),
        [
            pytest.param(
                5, ["-n", "3"], "(showing the last 3 lines; --all for everything)", id="cut"
            ),
            pytest.param(4, ["-n", "3"], "(showing the last 3 lines", id="one more line"),
            pytest.param(3, ["-n", "3"], None, id="exactly N lines: whole log"),
            pytest.param(2, ["-n", "3"], None, id="fewer lines"),
            pytest.param(5, ["--all"], None, id="--all"),
            pytest.param(1500, [], "(showing the last 1000 lines", id="default 1000"),
        ],
    )
    def test_note_only_when_truncated(
        self, api: FakeApi, total: int, args: list[str], note: str | None
    ) -> None:
        log = b"".join(f"line {i}\n".encode() for i in range(total))
        api.on("GET", "/v1/jobs/job_1/logs", _tail_server(log))
        result = cli("logs", "job_1", *args)
        assert result.exit_code == 0, result.stderr
        if note is None:
            assert "showing the last" not in result.stderr
        else:
            assert note in result.stderr and result.stderr.count("\n") == 1
        assert result.stdout.endswith(f"line {total - 1}\n")


class TestEmptyReferences:
    @pytest.mark.parametrize(
        "argv",
        [
            ["status", ""],
            ["status", "  "],
            ["logs", ""],
            ["why", ""],
            ["cancel", ""],
            ["cancel", "j-1", ""],
            ["hold", ""],
            ["release", ""],
            ["requeue", ""],
            ["update", "", "--priority", "HIGH"],
            ["artifacts", ""],
            ["admin", "token", "revoke", ""],
        ],
    )
    def test_refused_before_any_request(self, api: FakeApi, argv: list[str]) -> None:
        from typer.testing import CliRunner

        from gpufleet.cli.main import app

        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2, result.output
        assert re.search(
            r"Invalid value for '(job|jobs|token_id)': must not be empty", result.stderr
        )
        assert api.requests == []

    @pytest.mark.parametrize(
        "argv",
        [
            ["admin", "team", "set", "qt", "--weight", "nan"],
            ["admin", "team", "set", "qt", "--weight", "inf"],
            ["admin", "team", "create", "qt", "--weight", "-inf"],
        ],
    )
    def test_a_weight_that_is_not_finite_is_refused_before_any_request(
        self, api: FakeApi, argv: list[str]
    ) -> None:
        """Typer parses nan and inf as floats; the request body then could not be encoded
        (a traceback, found by a new-user test)."""
        from typer.testing import CliRunner

        from gpufleet.cli.main import app

        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--weight': must be a finite number" in result.stderr
        assert api.requests == []

    def test_the_sdk_refuses_an_empty_reference(self) -> None:
        from gpufleet.client import Client

        with Client("http://127.0.0.1:9", "t0ken") as c, pytest.raises(ValueError, match="job"):
            c.get("")


class TestConsistentAnswers:
    def test_cancel_of_a_cancelled_job_says_already_finished(self, api: FakeApi) -> None:
        body = {"job_id": "j-1", "status": "CANCELLED", "cancel_requested": True}
        api.on(
            "DELETE", "/v1/jobs/j-1", httpx.Response(202, json=body | {"already_finished": True})
        )
        result = cli("cancel", "j-1")
        assert result.exit_code == 0
        assert "job j-1 already finished (CANCELLED)" in result.stdout
        assert "cancel requested" not in result.stdout

    def test_release_of_a_finished_job_is_the_servers_409(self, api: FakeApi) -> None:
        body = {
            "error": "job_not_pending",
            "message": "job j-1 is SUCCEEDED; only a held PENDING job can be released",
            "field": "job_id",
        }
        api.on("POST", "/v1/jobs/j-1/release", httpx.Response(409, json=body))
        result = cli("release", "j-1")
        assert result.exit_code == 2 and "released" not in result.stdout
        assert "only a held PENDING job can be released" in result.stderr

    @pytest.mark.parametrize(
        ("limit", "name", "want"),
        [
            (None, "", "name=- max_runtime=unlimited"),
            (600.0, "later", "name=later max_runtime=600 s"),
        ],
    )
    def test_update_prints_human_values(
        self, api: FakeApi, limit: float | None, name: str, want: str
    ) -> None:
        body = {"job_id": "j-1", "priority": "HIGH", "name": name, "max_runtime_s": limit}
        api.on("PATCH", "/v1/jobs/j-1", httpx.Response(200, json=body))
        result = cli("update", "j-1", "--priority", "HIGH")
        assert result.exit_code == 0, result.stderr
        assert f"updated: j-1 priority=HIGH {want}" in result.stdout
        assert "None" not in result.stdout and "'" not in result.stdout


class TestFollowAJobThatNeverRuns:
    @pytest.mark.parametrize("final", ["CANCELLED", "DEPENDENCY_FAILED"])
    def test_says_it_ended_without_running_and_exits_1(self, api: FakeApi, final: str) -> None:
        api.on(
            "GET",
            "/v1/jobs/j-1",
            httpx.Response(200, json=job("j-1", "PENDING", attempts=[])),
            httpx.Response(200, json=job("j-1", final, attempts=[])),
        )
        api.on("GET", "/v1/jobs/j-1/logs", httpx.Response(200, content=b""))
        result = cli("logs", "-f", "j-1")
        assert result.exit_code == 1
        assert "(waiting for it to start; logs follow)\n" in result.stderr
        assert result.stderr.endswith(f"job j-1 ended {final} without running\n")

    def test_a_job_that_ran_with_no_output_still_exits_0(self, api: FakeApi) -> None:
        ran = job("j-1", "SUCCEEDED", attempts=[attempt("r1", "SUCCEEDED", exit_code=0)])
        api.on("GET", "/v1/jobs/j-1", httpx.Response(200, json=ran))
        api.on("GET", "/v1/jobs/j-1/logs", httpx.Response(200, content=b""))
        result = cli("logs", "-f", "j-1")
        assert result.exit_code == 0 and "without running" not in result.stderr
