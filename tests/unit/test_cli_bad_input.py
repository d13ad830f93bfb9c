"""Bad input found by a new-user break test of the CLI: each must end in one line naming the
option or job-file field and exit 2, never a traceback, a REST name or a silent fall-back
(against the fake API of test_cli_client)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
import yaml

from gpufleet.cli import joblogs, jobs
from gpufleet.cli.options import ClientError, duration_s
from gpufleet.cli.usage import when
from tests.unit.test_cli_client import FakeApi, cli, job
from tests.unit.test_cli_client import api as api  # the `api` fixture, re-exported

HUGE = "99999999999999999999"


class TestTimeSpansTooLarge:
    @pytest.mark.parametrize("flag", ["--since", "--until"])
    @pytest.mark.parametrize(
        "span",
        [
            pytest.param("999999d", id="before the year 1"),
            pytest.param(f"{HUGE}d", id="more days than timedelta holds"),
            pytest.param(f"{HUGE}w", id="weeks"),
        ],
    )
    def test_usage_names_the_flag(self, api: FakeApi, flag: str, span: str) -> None:
        result = cli("usage", flag, span)
        assert result.exit_code == 2
        assert flag in result.stderr and "Traceback" not in result.stderr
        assert not api.requests

    @pytest.mark.parametrize(
        "text",
        [
            pytest.param("9" * 400 + "d", id="a float's inf"),
            pytest.param(HUGE * 20 + "-1", id="Slurm days too large for a float"),
            pytest.param("9" * 5000 + "-1", id="more digits than int() reads"),
        ],
    )
    def test_durations_name_the_flag(self, text: str) -> None:
        with pytest.raises(ClientError) as caught:
            duration_s(text, "--time")
        assert caught.value.field == "--time" and "too long" in caught.value.message

    def test_update_time_too_long_exits_2(self, api: FakeApi) -> None:
        result = cli("update", "j-1", "--time", "9" * 400 + "d")
        assert result.exit_code == 2 and "--time" in result.stderr
        assert not api.requests

    def test_a_sane_span_still_works(self) -> None:
        assert when("7d", "--since") is not None


def _jobfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "j.yaml"
    path.write_text(text)
    return str(path)


class TestJobFileFieldsTheCliReads:
    @pytest.mark.parametrize(
        ("text", "field"),
        [
            pytest.param("env: [1, 2]", "env", id="env a list"),
            pytest.param('env: "FOO=1"', "env", id="env a string"),
            pytest.param("node_selector: [a]", "node_selector", id="node_selector a list"),
            pytest.param('node_selector: "gpu=a100"', "node_selector", id="selector a string"),
            pytest.param('command: "echo \'hi"', "command", id="command with an open quote"),
        ],
    )
    def test_named_exit_2(self, api: FakeApi, tmp_path: Path, text: str, field: str) -> None:
        extra = [] if text.startswith("command") else ["--", "true"]
        result = cli("submit", _jobfile(tmp_path, text), *extra)
        assert result.exit_code == 2, result.output
        assert f"(field: {field})" in result.stderr
        assert not api.requests

    def test_env_list_with_selector_flag(self, api: FakeApi, tmp_path: Path) -> None:
        result = cli("submit", _jobfile(tmp_path, "node_selector: [a]"), "--selector", "k=v")
        assert result.exit_code == 2 and "node_selector" in result.stderr

    def test_priority_of_another_type_is_left_to_the_server(self) -> None:
        from gpufleet.cli.submit import build_job_body

        assert build_job_body({"priority": 5}, {}, {}, {}, ["x"])["priority"] == 5
        assert build_job_body({"priority": "high"}, {}, {}, {}, ["x"])["priority"] == "HIGH"

    def test_array_in_the_job_file_refuses_wait(self, api: FakeApi, tmp_path: Path) -> None:
        result = cli("submit", _jobfile(tmp_path, "array: 0-3"), "--wait", "--", "true")
        assert result.exit_code == 2 and "array" in result.stderr
        assert not api.requests


class TestDownloadDirectory:
    def _listing(self, api: FakeApi) -> bytes:
        data = b"hello"
        listing = {
            "job_id": "j-1",
            "run_id": "r-1",
            "items": [{"path": "a/b.txt", "size": 5, "sha256": hashlib.sha256(data).hexdigest()}],
        }
        api.on("GET", "/v1/jobs/j-1/artifacts", httpx.Response(200, json=listing))
        return data

    def test_a_file_in_the_way_names_download(self, api: FakeApi) -> None:
        self._listing(api)
        result = cli("artifacts", "j-1", "--download", "/dev/null/x")
        assert result.exit_code == 2
        assert "--download" in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1

    def test_an_unwritable_subdirectory_names_download(self, api: FakeApi, tmp_path: Path) -> None:
        self._listing(api)
        (tmp_path / "a").write_text("a file where the artifact's directory goes")
        result = cli("artifacts", "j-1", "--download", str(tmp_path))
        assert result.exit_code == 2 and "--download" in result.stderr

    def test_a_good_directory_still_downloads(self, api: FakeApi, tmp_path: Path) -> None:
        data = self._listing(api)
        api.on("GET", "/v1/jobs/j-1/artifacts/a/b.txt", httpx.Response(200, content=data))
        result = cli("artifacts", "j-1", "--download", str(tmp_path / "out"))
        assert result.exit_code == 0, result.output
        assert (tmp_path / "out" / "a" / "b.txt").read_bytes() == data


class TestYamlOutputOfJobControl:
    @pytest.mark.parametrize("verb", ["hold", "release", "requeue"])
    def test_each(self, api: FakeApi, verb: str) -> None:
        api.on("POST", f"/v1/jobs/j-1/{verb}", httpx.Response(200, json=job("j-1", "HELD")))
        result = cli(verb, "j-1", "-o", "yaml")
        assert result.exit_code == 0, result.output
        assert yaml.safe_load(result.stdout)["items"][0]["job_id"] == "j-1"

    def test_update(self, api: FakeApi) -> None:
        api.on("PATCH", "/v1/jobs/j-1", httpx.Response(200, json=job("j-1", priority="HIGH")))
        result = cli("update", "j-1", "--priority", "HIGH", "-o", "yaml")
        assert yaml.safe_load(result.stdout)["priority"] == "HIGH"

    def test_cancel_one(self, api: FakeApi) -> None:
        answer = {"job_id": "j-1", "status": "RUNNING", "cancel_requested": True}
        api.on("DELETE", "/v1/jobs/j-1", httpx.Response(200, json=answer))
        result = cli("cancel", "j-1", "-o", "yaml")
        assert yaml.safe_load(result.stdout)["job_id"] == "j-1"

    def test_cancel_many(self, api: FakeApi) -> None:
        body = {"cancelled": [{"job_id": "j-1", "status": "PENDING"}], "skipped": []}
        api.on("POST", "/v1/jobs/cancel", httpx.Response(200, json=body))
        result = cli("cancel", "--name", "x", "--yes", "-o", "yaml")
        assert yaml.safe_load(result.stdout) == body

    def test_array(self, api: FakeApi) -> None:
        data = {"array_id": "a-1", "tasks": [], "counts": {}, "max_running": None}
        api.on("GET", "/v1/arrays/a-1", httpx.Response(200, json=data))
        result = cli("array", "a-1", "-o", "yaml")
        assert yaml.safe_load(result.stdout)["array_id"] == "a-1"

    def test_artifacts(self, api: FakeApi) -> None:
        listing = {"job_id": "j-1", "run_id": "r-1", "items": []}
        api.on("GET", "/v1/jobs/j-1/artifacts", httpx.Response(200, json=listing))
        result = cli("artifacts", "j-1", "-o", "yaml")
        assert yaml.safe_load(result.stdout) == listing

    def test_json_unchanged(self, api: FakeApi) -> None:
        api.on("POST", "/v1/jobs/j-1/hold", httpx.Response(200, json=job("j-1", "HELD")))
        result = cli("hold", "j-1", "-o", "json")
        assert json.loads(result.stdout)["items"][0]["status"] == "HELD"


class TestEmptyValues:
    @pytest.mark.parametrize(
        "option",
        [
            "--array",
            "--depends",
            "--name",
            "--idempotency-key",
            "--image",
            "--priority",
            "--workdir",
        ],
    )
    def test_submit_refuses(self, api: FakeApi, option: str) -> None:
        result = cli("submit", option, "", "--", "true")
        assert result.exit_code == 2
        assert option in result.stderr and "must not be empty" in result.stderr
        assert not api.requests

    @pytest.mark.parametrize(
        "args",
        [
            pytest.param(["list", "--url", ""], id="list --url"),
            pytest.param(["list", "--token", ""], id="list --token"),
            pytest.param(["list", "--name", ""], id="list --name"),
            pytest.param(["list", "--array", ""], id="list --array"),
            pytest.param(["list", "--status", ""], id="list --status"),
            pytest.param(["cancel", "j-1", "--name", ""], id="cancel --name"),
            pytest.param(["cancel", "--array", ""], id="cancel --array"),
            pytest.param(["logs", "j-1", "--attempt", ""], id="logs --attempt"),
            pytest.param(["usage", "--team", ""], id="usage --team"),
            pytest.param(["array", ""], id="array ''"),
        ],
    )
    def test_other_commands_refuse(self, api: FakeApi, args: list[str]) -> None:
        result = cli(*args)
        assert result.exit_code == 2
        assert "must not be empty" in result.stderr
        assert not api.requests

    def test_update_name_empty_still_clears_the_name(self, api: FakeApi) -> None:
        api.on("PATCH", "/v1/jobs/j-1", httpx.Response(200, json=job("j-1", name="")))
        result = cli("update", "j-1", "--name", "")
        assert result.exit_code == 0, result.output
        assert api.bodies() == [{"name": ""}]


class TestOptionBounds:
    @pytest.mark.parametrize(
        ("args", "option"),
        [
            pytest.param(["list", "--limit", "99999999999"], "--limit", id="list --limit"),
            pytest.param(["logs", "j-1", "-n", "99999999999"], "--tail", id="logs -n"),
            pytest.param(["logs", "j-1", "--rank", "5000"], "--rank", id="logs --rank"),
            pytest.param(["submit", "--gpus", "5000", "--", "x"], "--gpus", id="submit --gpus"),
            pytest.param(["submit", "--max-retries", "999", "--", "x"], "--max-retries", id="r"),
        ],
    )
    def test_names_the_option(self, api: FakeApi, args: list[str], option: str) -> None:
        result = cli(*args)
        assert result.exit_code == 2
        assert option in result.stderr and "query." not in result.stderr
        assert not api.requests

    def test_bounds_are_the_servers(self) -> None:
        from gpufleet.api import jobs as api_jobs
        from gpufleet.api import logs

        assert joblogs.MAX_TAIL_LINES == logs.MAX_TAIL_LINES
        assert jobs.MAX_PAGE_SIZE == api_jobs.MAX_PAGE_SIZE

    def test_the_largest_page_is_sent(self, api: FakeApi) -> None:
        api.on("GET", "/v1/jobs", httpx.Response(200, json={"items": [], "next_cursor": None}))
        result = cli("list", "--limit", "500", "-o", "json")
        assert result.exit_code == 0 and api.requests[0].url.params["limit"] == "500"


class TestServerUrlAndConfig:
    @pytest.mark.parametrize(
        "url", ["notaurl", "ftp://host", "http://", "http://host:99999"], ids=str
    )
    def test_bad_url_flag_exits_2(self, api: FakeApi, url: str) -> None:
        result = cli("list", "--url", url)
        assert result.exit_code == 2 and "--url" in result.stderr
        assert not api.requests

    def test_bad_url_from_the_environment_names_it(
        self, api: FakeApi, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("GPUFLEET_URL", "notaurl")
        result = cli("list")
        assert result.exit_code == 2 and "GPUFLEET_URL" in result.stderr
        assert not api.requests

    def test_missing_config_file_is_named(
        self, api: FakeApi, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.delenv("GPUFLEET_TOKEN")
        monkeypatch.setenv("GPUFLEET_CONFIG", str(tmp_path / "nonexistent"))
        result = cli("list")
        assert result.exit_code == 2
        assert "no API token" in result.stderr
        assert f"GPUFLEET_CONFIG names {tmp_path / 'nonexistent'}" in result.stderr
        assert "does not exist" in result.stderr

    def test_existing_config_without_token_says_no_more(
        self, api: FakeApi, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.delenv("GPUFLEET_TOKEN")
        config = tmp_path / "client.yaml"
        config.write_text("url: http://127.0.0.1:8420\n")
        monkeypatch.setenv("GPUFLEET_CONFIG", str(config))
        result = cli("list")
        assert result.exit_code == 2 and "does not exist" not in result.stderr


class TestContainerAndNotifyFlags:
    """``--shm-size`` above the server's bound and a bad ``--notify`` URL are refused before
    anything is sent, naming the flag (they came back as pydantic's raw wording)."""

    def test_shm_size_too_big(self, api: FakeApi) -> None:
        result = cli("submit", "--image", "python:3", "--shm-size", "100000g", "--", "true")
        assert result.exit_code == 2, result.output
        assert "--shm-size '100000g' is above the most a job may ask for" in result.stderr
        assert "(16t = 16777216 MiB)" in result.stderr and not api.requests

    @pytest.mark.parametrize("url", ["notaurl", "ftp://host/x", "http://x y"])
    def test_notify_url(self, api: FakeApi, url: str) -> None:
        result = cli("submit", "--notify", url, "--", "true")
        assert result.exit_code == 2, result.output
        assert f"--notify {url!r}" in result.stderr and "field: notify" in result.stderr
        assert not api.requests
