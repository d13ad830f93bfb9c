"""The client CLI against an in-test fake of the REST API (``httpx.MockTransport``).

A unit test of the CLI layer only: argument parsing, job-file merging, pagination, output
and error mapping. The real server is exercised by tests/e2e.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from gpufleet.cli import joblogs, session
from gpufleet.cli.client import register_client_commands
from gpufleet.cli.options import ClientError
from gpufleet.cli.submit import build_job_body

Handler = Callable[[httpx.Request], httpx.Response]


def job(job_id: str = "job_1", status: str = "RUNNING", **extra: Any) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "name": "train",
        "team": "ml",
        "status": status,
        "priority": "NORMAL",
        "gpu_count": 2,
        "gpu_types": ["H100"],
        "command": ["python", "train.py"],
        "created_at": "2024-05-01T12:00:00+00:00",
        "scheduled_at": None,
        "started_at": None,
        "finished_at": None,
        "cancel_requested": False,
        "result_uri": None,
        "failure_reason": None,
        "attempts": [],
        "pending_reason": None,
        **extra,
    }


def attempt(run_id: str, status: str, **extra: Any) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "attempt": 1,
        "status": status,
        "node_id": "node-a",
        "gpu_ids": [0, 1],
        "token": 7,
        "exit_code": None,
        "created_at": None,
        "started_at": None,
        "finished_at": None,
        "manifest_uri": None,
        "message": None,
        **extra,
    }


PENDING_REASON = {
    "code": "INSUFFICIENT_GPUS",
    "message": "Waiting for 2 free H100 GPUs; the largest free block is 1.",
    "details": {"free_gpus": 1},
    "position": 3,
    "estimated_start_at": "2999-01-01T00:00:00+00:00",
}


class FakeApi:
    """Records requests; routes are ``(METHOD, path) -> handler`` or a queue of responses."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.routes: dict[tuple[str, str], list[httpx.Response] | Handler] = {}

    def on(self, method: str, path: str, *responses: httpx.Response | Handler) -> None:
        if len(responses) == 1 and callable(responses[0]):
            self.routes[(method, path)] = responses[0]
        else:
            self.routes[(method, path)] = list(responses)  # type: ignore[arg-type]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        route = self.routes.get((request.method, request.url.path))
        if route is None:
            return httpx.Response(404, json={"error": "not_found", "message": "no such thing"})
        if callable(route):
            return route(request)
        return route.pop(0) if len(route) > 1 else route[0]

    def bodies(self) -> list[Any]:
        return [json.loads(r.content) for r in self.requests if r.content]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeApi:
    fake = FakeApi()
    real = session.make_http_client
    monkeypatch.setattr(
        session, "make_http_client", lambda cfg: real(cfg, transport=httpx.MockTransport(fake))
    )
    monkeypatch.setattr(joblogs, "_sleep", lambda _s: None)
    monkeypatch.setenv("GPUFLEET_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("GPUFLEET_TOKEN", "t0ken")
    monkeypatch.delenv("GPUFLEET_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "250")  # Rich folds long cells at 80 columns
    return fake


def cli(*args: str) -> Any:
    app = typer.Typer()
    register_client_commands(app)
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output + result.stderr
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), result.exception
    return result


class TestBuildJobBody:
    @pytest.mark.parametrize(
        ("base", "flags", "env", "command", "want"),
        [
            pytest.param(
                {},
                {},
                {},
                ["echo", "hi"],
                {"command": ["echo", "hi"], "gpu_count": 1, "priority": "NORMAL"},
                id="defaults: one gpu, NORMAL",
            ),
            pytest.param(
                {"command": ["old"], "gpu_count": 4, "priority": "low", "name": "a"},
                {"gpu_count": 2, "name": None},
                {},
                ["new", "cmd"],
                {"command": ["new", "cmd"], "gpu_count": 2, "priority": "LOW", "name": "a"},
                id="flags and -- command override the file; unset flags do not",
            ),
            pytest.param(
                {"command": "python train.py --lr '1e-3'", "env": {"A": "1", "B": "2"}},
                {},
                {"B": "3"},
                [],
                {
                    "command": ["python", "train.py", "--lr", "1e-3"],
                    "env": {"A": "1", "B": "3"},
                    "gpu_count": 1,
                    "priority": "NORMAL",
                },
                id="file command string is split; env merges key by key",
            ),
            pytest.param(
                {"gpu_type": ["H100", "A100"]},
                {"gpu_type": ["L4"]},
                {},
                ["x"],
                {"command": ["x"], "gpu_type": "L4", "gpu_count": 1, "priority": "NORMAL"},
                id="one gpu type goes as a string; flags replace the file's list",
            ),
            pytest.param(
                {"gpu_type": ["H100", "A100"]},
                {"gpu_type": []},
                {},
                ["x"],
                {
                    "command": ["x"],
                    "gpu_type": ["H100", "A100"],
                    "gpu_count": 1,
                    "priority": "NORMAL",
                },
                id="preference list kept in order",
            ),
        ],
    )
    def test_merge(
        self,
        base: dict[str, Any],
        flags: dict[str, Any],
        env: dict[str, str],
        command: list[str],
        want: dict[str, Any],
    ) -> None:
        assert build_job_body(base, flags, env, {}, command) == want

    def test_no_command_names_the_field(self) -> None:
        with pytest.raises(ClientError) as info:
            build_job_body({"gpu_count": 1}, {}, {}, {}, [])
        assert info.value.field == "command"


class TestSubmit:
    def test_flags_and_command_after_dashes(self, api: FakeApi) -> None:
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_1", "status": "P"}))
        result = cli(
            "submit",
            "--gpus",
            "2",
            "--gpu-type",
            "H100",
            "--gpu-type",
            "A100",
            "--env",
            "A=1=2",
            "--selector",
            "zone=a",
            "--priority",
            "high",
            "--cpu",
            "4",
            "--",
            "python",
            "train.py",
            "--gpus",
            "8",
        )
        assert result.exit_code == 0, result.stderr
        assert result.stdout == "job_1\n"
        request = api.requests[0]
        assert request.headers["Authorization"] == "Bearer t0ken"
        key = request.headers["Idempotency-Key"]
        assert key not in result.stderr  # shown only with -v, on a retry or a conflict
        assert json.loads(request.content) == {
            "command": ["python", "train.py", "--gpus", "8"],
            "gpu_count": 2,
            "gpu_type": ["H100", "A100"],
            "cpu": 4.0,
            "priority": "HIGH",
            "env": {"A": "1=2", "PATH": os.environ["PATH"]},
            "node_selector": {"zone": "a"},
            "working_dir": os.getcwd(),  # like Slurm: the job starts where it was submitted
        }

    def test_jobfile_defaults_flags_override(self, api: FakeApi, tmp_path: Path) -> None:
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_2", "status": "P"}))
        jobfile = tmp_path / "job.yaml"
        jobfile.write_text(
            "name: from-file\ncommand: [echo, file]\ngpu_count: 4\nmax_retries: 2\nenv: {A: '1'}\n"
        )
        result = cli("submit", str(jobfile), "--gpus", "1", "--env", "B=2")
        assert result.exit_code == 0, result.stderr
        assert api.bodies()[0] == {
            "name": "from-file",
            "command": ["echo", "file"],
            "gpu_count": 1,
            "max_retries": 2,
            "env": {"A": "1", "B": "2", "PATH": os.environ["PATH"]},
            "priority": "NORMAL",
            "working_dir": os.getcwd(),
        }

    def test_a_jobfile_with_a_key_twice_is_refused_before_any_request(
        self, api: FakeApi, tmp_path: Path
    ) -> None:
        """YAML parsers keep the last of two equal keys; a job file that says ``command``
        twice is refused, naming the key and both lines, and nothing is sent."""
        jobfile = tmp_path / "job.yaml"
        jobfile.write_text("command: [echo, a]\ngpu_count: 1\ncommand: [echo, b]\n")
        result = cli("submit", str(jobfile))
        assert result.exit_code == 2 and api.requests == []
        assert "found the key 'command' twice (first at line 1)" in result.stderr
        assert "at line 3, column 1" in result.stderr

    def test_workdir_flag_sets_or_drops_the_working_dir(
        self, api: FakeApi, tmp_path: Path
    ) -> None:
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_2", "status": "P"}))
        assert cli("submit", "--workdir", str(tmp_path), "--", "true").exit_code == 0
        assert cli("submit", "--workdir", "-", "--", "true").exit_code == 0
        first, second = api.bodies()
        assert first["working_dir"] == str(tmp_path)
        assert first["env"]["PATH"] == os.environ["PATH"]  # the submitting shell's programs
        assert "working_dir" not in second
        assert "PATH" not in (second.get("env") or {})

    def test_an_image_job_gets_neither_this_shells_path_nor_its_directory(
        self, api: FakeApi
    ) -> None:
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_3", "status": "P"}))
        assert cli("submit", "--image", "reg/img:1", "--", "python3", "x.py").exit_code == 0
        assert (
            cli("submit", "--image", "reg/img:1", "--workdir", "/app", "--", "true").exit_code == 0
        )
        first, second = api.bodies()
        assert first["image"] == "reg/img:1"
        assert "working_dir" not in first and "PATH" not in (first.get("env") or {})
        assert second["working_dir"] == "/app"  # a directory inside the image

    def test_non_finite_numbers_are_a_clean_error(self, api: FakeApi) -> None:
        result = cli("submit", "--cpu", "nan", "--", "true")
        assert result.exit_code == 2
        assert "cpu" in result.stderr and "Traceback" not in result.stderr

    def test_json_jobfile_and_reused_key_replay(self, api: FakeApi, tmp_path: Path) -> None:
        api.on("POST", "/v1/jobs", httpx.Response(200, json={"job_id": "job_3", "status": "P"}))
        jobfile = tmp_path / "job.json"
        jobfile.write_text(json.dumps({"command": ["a"], "gpu_count": 1}))
        result = cli("submit", str(jobfile), "--idempotency-key", "k-1", "-o", "json")
        assert result.exit_code == 0, result.stderr
        assert api.requests[0].headers["Idempotency-Key"] == "k-1"
        assert json.loads(result.stdout) == {"job_id": "job_3", "status": "P"}
        assert "replay" in result.stderr

    @pytest.mark.parametrize(
        ("final", "want_exit"),
        [
            pytest.param("SUCCEEDED", 0, id="succeeded: 0"),
            pytest.param("FAILED", 1, id="failed: 1"),
        ],
    )
    def test_wait(self, api: FakeApi, final: str, want_exit: int) -> None:
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_1", "status": "P"}))
        api.on(
            "GET",
            "/v1/jobs/job_1",
            httpx.Response(200, json=job(status="PENDING", pending_reason=PENDING_REASON)),
            httpx.Response(200, json=job(status="RUNNING")),
            httpx.Response(
                200,
                json=job(
                    status=final, failure_reason="exit code 3" if final == "FAILED" else None
                ),
            ),
        )
        result = cli("submit", "--wait", "--", "true")
        assert result.exit_code == want_exit
        assert "Waiting for 2 free H100 GPUs" in result.stderr
        assert f"job_1: {final}" in result.stderr

    def test_waiting_on_a_held_job_says_how_to_release_it(self, api: FakeApi) -> None:
        """`submit --wait --hold` printed one PENDING line and then waited with no hint that
        the job never runs until released."""
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_1", "status": "P"}))
        api.on(
            "GET",
            "/v1/jobs/job_1",
            httpx.Response(200, json=job(status="PENDING", held=True)),
            httpx.Response(200, json=job(status="PENDING", held=True)),
            httpx.Response(200, json=job(status="CANCELLED")),
        )
        result = cli("submit", "--wait", "--hold", "--", "true")
        assert result.stderr.count("gpufleet release job_1") == 1, result.stderr

    def test_follow_streams_each_started_attempt_then_waits(self, api: FakeApi) -> None:
        api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_1", "status": "P"}))
        api.on(
            "GET",
            "/v1/jobs/job_1",
            httpx.Response(
                200, json=job(status="SCHEDULED", attempts=[attempt("r1", "ASSIGNED")])
            ),
            httpx.Response(200, json=job(status="RUNNING", attempts=[attempt("r1", "RUNNING")])),
            httpx.Response(
                200, json=job(status="SUCCEEDED", attempts=[attempt("r1", "SUCCEEDED")])
            ),
        )
        api.on(
            "GET",
            "/v1/jobs/job_1/logs",
            lambda _r: httpx.Response(200, content=iter([b"epoch 1\n", b"epoch 2\n"])),
        )
        result = cli("submit", "--follow", "--", "train")
        assert result.exit_code == 0, result.stderr
        assert result.stdout == "job_1\nepoch 1\nepoch 2\n"
        logs = [r for r in api.requests if r.url.path.endswith("/logs")]
        assert [dict(r.url.params) for r in logs] == [{"follow": "true", "run_id": "r1"}]

    @pytest.mark.parametrize(
        ("args", "want_error"),
        [
            pytest.param(["--env", "NOEQUALS", "--", "x"], "(field: env)", id="bad --env"),
            pytest.param([], "(field: command)", id="no command"),
            pytest.param(["missing.yaml"], "put the job's command after `--`", id="no such file"),
        ],
    )
    def test_input_errors_exit_2(self, api: FakeApi, args: list[str], want_error: str) -> None:
        result = cli("submit", *args)
        assert result.exit_code == 2
        assert want_error in result.stderr
        assert api.requests == []


class TestErrors:
    @pytest.mark.parametrize(
        ("response", "want_exit", "want_stderr"),
        [
            pytest.param(
                httpx.Response(
                    422,
                    json={
                        "error": "invalid",
                        "message": "gpu_count must be at most 8",
                        "field": "gpu_count",
                    },
                ),
                2,
                "error: gpu_count must be at most 8 (field: gpu_count)",
                id="4xx with field",
            ),
            pytest.param(
                httpx.Response(
                    401, json={"error": "unauthenticated", "message": "bad token", "field": None}
                ),
                2,
                "bad token (check --token",
                id="401 hints at the token",
            ),
            pytest.param(
                httpx.Response(503, text="upstream down"),
                1,
                "HTTP 503 from server: upstream down",
                id="5xx without JSON: exit 1",
            ),
        ],
    )
    def test_http_errors(
        self,
        api: FakeApi,
        response: httpx.Response,
        want_exit: int,
        want_stderr: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        from gpufleet.client import _core

        # a 503 is retried (~20 s of backoff in production): the same retries, quickly
        monkeypatch.setattr(
            _core, "SUBMIT_RETRY_DELAYS_S", (0.01,) * len(_core.SUBMIT_RETRY_DELAYS_S)
        )
        api.on("POST", "/v1/jobs", response)
        result = cli("submit", "--", "x")
        assert result.exit_code == want_exit
        assert want_stderr in result.stderr

    def test_unreachable_server(self, api: FakeApi) -> None:
        def refuse(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("connection refused", request=request)

        api.on("GET", "/v1/nodes", refuse)
        result = cli("nodes", "--url", "http://10.0.0.9:8420")
        assert result.exit_code == 1
        assert (
            "cannot reach gpufleet at http://10.0.0.9:8420: is the server running? (gpufleet up)"
            in result.stderr
        )

    def test_missing_token(self, api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("GPUFLEET_TOKEN")
        result = cli("status", "job_1")
        assert result.exit_code == 2
        assert "gpufleet up" in result.stderr
        assert "GPUFLEET_TOKEN" in result.stderr
        assert api.requests == []


class TestReads:
    def test_list_follows_cursor_with_all(self, api: FakeApi) -> None:
        pages = {
            None: {"items": [job("j1")], "next_cursor": "c1"},
            "c1": {"items": [job("j2")], "next_cursor": "c2"},
            "c2": {"items": [job("j3")], "next_cursor": None},
        }
        api.on(
            "GET",
            "/v1/jobs",
            lambda r: httpx.Response(200, json=pages[r.url.params.get("cursor")]),
        )
        result = cli("list", "--all", "--status", "running", "--limit", "1", "-o", "json")
        assert result.exit_code == 0, result.stderr
        assert [j["job_id"] for j in json.loads(result.stdout)["items"]] == ["j1", "j2", "j3"]
        assert all(r.url.params["status"] == "RUNNING" for r in api.requests)
        assert [r.url.params["limit"] for r in api.requests] == ["1", "1", "1"]
        # --state is the same option (as on `cancel`), repeated or a comma list
        result = cli("list", "--state", "pending", "-o", "json")
        assert result.exit_code == 0, result.stderr
        assert api.requests[-1].url.params["status"] == "PENDING"
        result = cli("list", "--state", "pending,failed", "--status", "running", "-o", "json")
        assert result.exit_code == 0, result.stderr
        assert api.requests[-1].url.params["status"] == "PENDING,FAILED,RUNNING"

    def test_list_one_page_by_default(self, api: FakeApi) -> None:
        api.on(
            "GET",
            "/v1/jobs",
            httpx.Response(200, json={"items": [job("j1")], "next_cursor": "c1"}),
        )
        result = cli("list")
        assert result.exit_code == 0, result.stderr
        assert "j1" in result.stdout
        assert "RUNNING" in result.stdout
        assert "--all" in result.stderr
        assert len(api.requests) == 1

    def test_status_table(self, api: FakeApi) -> None:
        data = job(
            status="PENDING",
            attempts=[attempt("run_9", "PREEMPTED", exit_code=143, message="preempted")],
            pending_reason=PENDING_REASON,
            result_uri="file:///r/job_1",
        )
        api.on("GET", "/v1/jobs/job_1", httpx.Response(200, json=data))
        result = cli("status", "job_1")
        assert result.exit_code == 0, result.stderr
        for want in (
            "run_9",
            "PREEMPTED",
            "143",
            "0,1",
            "node-a",
            "file:///r/job_1",
            "INSUFFICIENT_GPUS",
            "Waiting for 2 free H100 GPUs",
            "free_gpus",
        ):
            assert want in result.stdout

    def test_status_shows_the_start_phases(self, api: FakeApi) -> None:
        phases = {
            "runtime": "container",
            "image": "cold",
            "pull_s": 2.5,
            "create_s": 0.1,
            "start_s": 0.2,
        }
        data = job(status="RUNNING", attempts=[attempt("run_1", "RUNNING", start_phases=phases)])
        api.on("GET", "/v1/jobs/job_1", httpx.Response(200, json=data))
        result = cli("status", "job_1", "--wide")
        assert result.exit_code == 0, result.stderr
        assert "cold image: pull 2.50s" in " ".join(result.stdout.split())

    def test_status_json_is_the_response(self, api: FakeApi) -> None:
        api.on("GET", "/v1/jobs/job_1", httpx.Response(200, json=job()))
        result = cli("status", "job_1", "--output", "json")
        assert json.loads(result.stdout) == job()

    @pytest.mark.parametrize(
        ("data", "want_lines"),
        [
            pytest.param(
                job(status="PENDING", pending_reason=PENDING_REASON),
                [
                    "Waiting for 2 free H100 GPUs",
                    "INSUFFICIENT_GPUS",
                    "free_gpus:",
                    "3",
                    "2999-01-01 00:00:00Z (in ",
                ],
                id="pending: sentence, code, details, position, estimate",
            ),
            pytest.param(
                job(status="FAILED", failure_reason="exit code 3"),
                ["is not pending: it is FAILED: exit code 3"],
                id="terminal: says its status",
            ),
        ],
    )
    def test_why(self, api: FakeApi, data: dict[str, Any], want_lines: list[str]) -> None:
        api.on("GET", "/v1/jobs/job_1", httpx.Response(200, json=data))
        result = cli("why", "job_1")
        assert result.exit_code == 0, result.stderr
        for want in want_lines:
            assert want in result.stdout

    def test_logs_streams_with_attempt(self, api: FakeApi) -> None:
        api.on(
            "GET",
            "/v1/jobs/job_1/logs",
            lambda _r: httpx.Response(200, content=iter([b"a\n", b"b"])),
        )
        result = cli("logs", "job_1", "-f", "--attempt", "run_2")
        assert result.exit_code == 0, result.stderr
        assert result.stdout == "a\nb"
        assert dict(api.requests[0].url.params) == {
            "follow": "true",
            "run_id": "run_2",
            "tail": "1000",
        }

    @pytest.mark.parametrize(
        ("args", "want_params"),
        [
            pytest.param([], {"follow": "false", "tail": "1000"}, id="last 1,000 lines"),
            pytest.param(["--all"], {"follow": "false"}, id="--all: everything"),
            pytest.param(["-n", "5"], {"follow": "false", "tail": "5"}, id="-n 5"),
            pytest.param(["-f", "--all"], {"follow": "true"}, id="follow everything"),
        ],
    )
    def test_logs_shows_the_last_lines_by_default(self, api: FakeApi, args, want_params) -> None:
        api.on("GET", "/v1/jobs/job_1/logs", httpx.Response(200, content=b"x\n"))
        api.on("GET", "/v1/jobs/job_1", httpx.Response(200, json=job()))
        result = cli("logs", "job_1", *args)
        assert result.exit_code == 0, result.stderr
        logs = [r for r in api.requests if r.url.path.endswith("/logs")]
        assert dict(logs[0].url.params) == want_params

    def test_cancel(self, api: FakeApi) -> None:
        api.on(
            "DELETE",
            "/v1/jobs/job_1",
            httpx.Response(
                202, json={"job_id": "job_1", "status": "RUNNING", "cancel_requested": True}
            ),
        )
        result = cli("cancel", "job_1")
        assert result.exit_code == 0, result.stderr
        assert "cancel requested: job_1" in result.stdout

    def test_unknown_job_is_a_4xx(self, api: FakeApi) -> None:
        result = cli("cancel", "nope")
        assert result.exit_code == 2
        assert "error: no such thing" in result.stderr

    def test_nodes(self, api: FakeApi) -> None:
        node = {
            "node_id": "node-a",
            "status": "READY",
            "gpu_type": "H100",
            "gpu_memory_mb": 81920,
            "total_gpus": 8,
            "available_gpus": 3,
            "labels": {"zone": "a"},
            "address": "10.0.0.1:8422",
            "last_heartbeat_at": "2024-05-01T12:00:00Z",
        }
        api.on("GET", "/v1/nodes", httpx.Response(200, json={"items": [node]}))
        result = cli("nodes")
        assert result.exit_code == 0, result.stderr
        for want in ("node-a", "READY", "3/8", "H100"):
            assert want in result.stdout
        wide = cli("nodes", "--wide")
        for want in ("node-a", "READY", "3/8", "zone=a", "81920", "10.0.0.1:8422"):
            assert want in wide.stdout


EVIL = "\x1b]0;owned\x07\x1b[2Jevil"


def no_escapes(text: str) -> bool:
    return "\x1b" not in text and "\x07" not in text and "\x9b" not in text


class TestTerminalSafety:
    """Server-provided text printed by each command has no terminal control sequences."""

    def test_status_list_and_why(self, api: FakeApi) -> None:
        data = job(
            status="PENDING",
            name=EVIL,
            command=["echo", EVIL],
            failure_reason=EVIL,
            attempts=[attempt("r1", "FAILED", message=EVIL, node_id=EVIL)],
            pending_reason={"code": EVIL, "message": EVIL, "details": {EVIL: EVIL}},
        )
        api.on("GET", "/v1/jobs/job_1", httpx.Response(200, json=data))
        api.on("GET", "/v1/jobs", httpx.Response(200, json={"items": [data], "next_cursor": None}))
        for args in (["status", "job_1"], ["list"], ["why", "job_1"]):
            result = cli(*args)
            assert result.exit_code == 0, result.stderr
            assert "evil" in result.stdout and no_escapes(result.stdout + result.stderr), args

    def test_rich_markup_in_a_name_is_printed_as_is(self, api: FakeApi) -> None:
        api.on(
            "GET", "/v1/jobs/job_1", httpx.Response(200, json=job(status="RUNNING", name="[red]x"))
        )
        assert "[red]x" in cli("status", "job_1").stdout

    def test_error_messages(self, api: FakeApi) -> None:
        api.on(
            "GET",
            "/v1/jobs/job_1",
            httpx.Response(404, json={"error": "not_found", "message": EVIL, "field": EVIL}),
        )
        result = cli("status", "job_1")
        assert result.exit_code == 2 and "evil" in result.stderr
        assert no_escapes(result.stderr)

    def test_nodes(self, api: FakeApi) -> None:
        node: dict[str, Any] = {
            "node_id": EVIL,
            "status": "HEALTHY",
            "gpu_type": EVIL,
            "gpu_memory_mb": 1,
            "total_gpus": 8,
            "available_gpus": 8,
            "labels": {EVIL: EVIL},
            "address": EVIL,
            "last_heartbeat_at": None,
            "agent_epoch": 1,
        }
        api.on("GET", "/v1/nodes", httpx.Response(200, json={"items": [node]}))
        result = cli("nodes")
        assert result.exit_code == 0 and no_escapes(result.stdout)

    @pytest.mark.parametrize("tty", [True, False])
    def test_logs_are_raw_in_a_pipe_and_clean_on_a_terminal(
        self, api: FakeApi, monkeypatch: pytest.MonkeyPatch, tty: bool
    ) -> None:
        monkeypatch.setattr(joblogs, "_stdout_is_tty", lambda: tty)
        body = [b"step 1 \x1b[32mok\x1b", b"[0m\r\n\x1b]0;owned\x07done\n"]
        api.on("GET", "/v1/jobs/job_1/logs", lambda _r: httpx.Response(200, content=iter(body)))
        result = cli("logs", "job_1")
        assert result.exit_code == 0
        if tty:
            assert result.stdout_bytes == b"step 1 ok\r\ndone\n"
        else:
            assert result.stdout_bytes == b"".join(body)
