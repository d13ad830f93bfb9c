"""Output helpers of the CLI and the SDK's own copies of server facts (no server needed)."""

from __future__ import annotations

import io

import pytest
import yaml
from rich.console import Console

from gpufleet.cli import output
from gpufleet.client.config import _plain_mapping
from gpufleet.client.models import TERMINAL_STATES, Job
from gpufleet.domain.states import JOB_TERMINAL


def test_the_sdk_knows_every_terminal_job_state() -> None:
    """The SDK keeps its own copy (it imports nothing of the server); it must not miss one.
    DEPENDENCY_FAILED is listed ahead of the server for job dependencies."""
    assert {str(s) for s in JOB_TERMINAL} <= TERMINAL_STATES
    assert TERMINAL_STATES - {str(s) for s in JOB_TERMINAL} <= {"DEPENDENCY_FAILED"}


@pytest.mark.parametrize(
    "text",
    [
        "token: gf_abc-DEF.123\nurl: http://127.0.0.1:8420\n",
        "# written by gpufleet up\nurl: https://fleet.example:443/api\n\ntoken: x\n",
        "",
    ],
)
def test_the_config_fast_path_reads_what_yaml_reads(text: str) -> None:
    assert _plain_mapping(text) == (yaml.safe_load(text) or {})


@pytest.mark.parametrize(
    "text", ['url: "http://h"\n', "token: null\n", "a: b # c\n", "a: [1]\n", "a:\n  b: c\n"]
)
def test_the_config_fast_path_leaves_real_yaml_to_yaml(text: str) -> None:
    assert _plain_mapping(text) is None


def _job(i: int, status: str) -> dict[str, object]:
    return {
        "job_id": f"j-01m8pp55138{i}zg6d7ee5qva0j0",
        "name": "a-very-long-experiment-name-" * 3,
        "status": status,
        "gpu_count": 8,
        "gpu_types": ["H100-80GB", "A100-80GB"],
        "created_at": "2024-05-01T12:00:00+00:00",
        "attempts": [],
    }


def test_the_jobs_table_fits_80_columns_and_wide_keeps_ids_whole() -> None:
    jobs = [_job(i, s) for i, s in enumerate(["PENDING", "SUCCEEDED", "DEPENDENCY_FAILED"])]
    narrow, wide = io.StringIO(), io.StringIO()
    Console(file=narrow, width=80).print(output.jobs_table(jobs))
    Console(file=wide, width=output.WIDE_WIDTH).print(output.jobs_table(jobs, wide=True))
    lines = narrow.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert all(s in narrow.getvalue() for s in ("PENDING", "SUCCEEDED", "DEPENDENCY_FAILED"))
    assert "j-01m8pp551380 " in narrow.getvalue() and jobs[0]["job_id"] not in narrow.getvalue()
    assert lines[0].split()[-3:] == ["AGE", "TIME", "LEFT"]
    assert all(str(j["job_id"]) in wide.getvalue() for j in jobs)


class TestTableRefs:
    """Issue 26: a 10-task array showed one short id twice (tasks made in the same
    millisecond share their first 12 characters, and 14 by chance)."""

    def test_prefixes_grow_until_unique_in_the_table(self) -> None:
        ids = ["j-01m8pp55138zzzaa", "j-01m8pp55138zzzab", "j-01m8pp5513xyyyyy"]
        got = output.unique_prefixes(ids)
        assert got == {
            "j-01m8pp55138zzzaa": "j-01m8pp55138zzzaa",
            "j-01m8pp55138zzzab": "j-01m8pp55138zzzab",
            "j-01m8pp5513xyyyyy": "j-01m8pp5513xy",
        }

    def test_array_tasks_are_array_index_and_others_keep_their_id(self) -> None:
        jobs = [
            {"job_id": "j-01m8pp55138aaaaaaa", "array_id": "a-01m8pp55137bbbbb", "array_index": 3},
            {"job_id": "j-01m8pp55138aaaaaab", "array_id": "a-01m8pp55137bbbbb", "array_index": 4},
            {"job_id": "j-01m8pp55139ccccccc"},
        ]
        assert output.job_refs(jobs) == {
            "j-01m8pp55138aaaaaaa": "a-01m8pp55137b_3",
            "j-01m8pp55138aaaaaab": "a-01m8pp55137b_4",
            "j-01m8pp55139ccccccc": "j-01m8pp55139c",
        }
        assert output.job_refs(jobs, wide=True)["j-01m8pp55138aaaaaaa"] == ("a-01m8pp55137bbbbb_3")

    def test_a_wide_status_and_long_refs_still_fit_80_columns(self) -> None:
        jobs = [
            {**_job(i, "DEPENDENCY_FAILED"), "owner": "someone@example.org",
             "array_id": "a-01m8pp55137bbbbbbbbbbbbbbb", "array_index": 100 + i,
             "team": "vision", "elapsed_s": 7200.0, "time_left_s": 1800.0}
            for i in range(3)
        ]  # fmt: skip
        narrow = io.StringIO()
        Console(file=narrow, width=80).print(output.jobs_table(jobs))
        lines = narrow.getvalue().splitlines()
        assert max(len(line) for line in lines) <= 80, narrow.getvalue()
        assert lines[0].split()[-3:] == ["AGE", "TIME", "LEFT"], lines[0]
        assert "a-01m8pp55137b_100" in narrow.getvalue()
        assert "2.0h" in lines[1] and "30m" in lines[1]


def test_commands_are_shell_quoted() -> None:
    argv = ["python3", "-c", "print('a b')", "x y", "$HOME"]
    assert output.quoted(argv) == """python3 -c 'print('"'"'a b'"'"')' 'x y' '$HOME'"""


def test_job_model_exit_code_is_the_last_attempts() -> None:
    job = Job.from_dict(
        {
            "job_id": "j-1",
            "status": "FAILED",
            "attempts": [
                {"run_id": "r1", "status": "FAILED", "exit_code": 1},
                {"run_id": "r2", "status": "FAILED", "exit_code": 3},
                {"run_id": "r3", "status": "FAILED", "exit_code": None},
            ],
            "new_field_of_a_newer_server": 1,
        }
    )
    assert (job.exit_code, job.done, job.succeeded) == (3, True, False)
    assert job.raw["new_field_of_a_newer_server"] == 1


def test_jobs_table_names_teams_when_they_differ_and_marks_held_jobs() -> None:
    jobs = [_job(i, s) for i, s in enumerate(["PENDING", "SUCCEEDED", "DEPENDENCY_FAILED"])]
    for job, team in zip(jobs, ("vision", "nlp", "vision"), strict=True):
        job["team"] = team
    jobs[0]["held"] = True
    narrow = io.StringIO()
    Console(file=narrow, width=80).print(output.jobs_table(jobs))
    text = narrow.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "TEAM" in text.splitlines()[0] and " nlp " in text and "vision" in text
    assert "PENDING (held)" in text and "DEPENDENCY_FAILED" in text
    assert "j-01m8pp551380 " in text
    one_team = io.StringIO()
    Console(file=one_team, width=80).print(output.jobs_table(jobs[:1] + jobs[2:]))
    assert "TEAM" not in one_team.getvalue().splitlines()[0]
    wide = io.StringIO()
    Console(file=wide, width=output.WIDE_WIDTH).print(output.jobs_table(jobs, wide=True))
    assert "PENDING (held)" in wide.getvalue()


def test_why_shows_reservation_times_as_utc_not_epochs() -> None:
    from datetime import UTC, datetime, timedelta

    at = datetime.now(UTC) + timedelta(minutes=2, seconds=10)
    reason = {
        "code": "waiting_with_reservation",
        "message": "Next in line: 8 GPU(s) on n1 are held for this job from in 2m 10s",
        "details": {"node": "n1", "reserved_from_s": at.timestamp(), "needed_gpus": 8},
        "position": 1,
    }
    text = "\n".join(output.pending_lines(reason))
    assert str(int(at.timestamp())) not in text
    assert at.strftime("%Y-%m-%d %H:%M:%SZ") in text and "(in 2m)" in text
    assert "reserved_from:" in text and "needed_gpus:" in text


def _render(table: object, width: int = 80) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width).print(table)
    return buf.getvalue()


def test_admin_team_list_headers_fit_80_columns() -> None:
    from gpufleet.cli.admin_api import admin_table, team_columns

    rows = [
        {
            "team": "vision-research",
            "weight": 2.0,
            "guaranteed_gpus": {"H100": 16, "A100-80GB": 8},
            "borrow_limit_gpus": None,
            "lending_limit": {"H100": 4},
            "allocated_gpus": {"H100": 12, "A100-80GB": 8},
            "pending_jobs": 42,
            "fair_share_usage_gpu_s": 123456.0,
        }
    ]
    text = _render(admin_table(rows, team_columns(False), whole=("team",)))
    header = text.splitlines()[0].split()
    assert header == [
        "team", "weight", "quota", "borrow", "lend", "alloc", "pending", "GPU-h", "runtime"
    ]  # fmt: skip
    assert max(len(line) for line in text.splitlines()) <= 80 and "vision-research" in text
    wide = _render(admin_table(rows, team_columns(True), wide=True), output.WIDE_WIDTH)
    assert "fair-share GPU-h (decayed)" in wide and "A100-80GB=8" in wide


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_admin_team_list_shows_the_run_time_default_and_limit(wide: bool) -> None:
    """They were only in -o json (default_max_runtime_s, max_runtime_limit_s); the table
    shows them as durations `team set --default-runtime/--max-runtime` take, - when unset."""
    from gpufleet.cli.admin_api import admin_table, team_columns
    from gpufleet.cli.options import duration_s

    base = {"weight": 1.0, "pending_jobs": 0, "fair_share_usage_gpu_s": 0.0}
    rows = [
        {**base, "team": "a", "default_max_runtime_s": 14400.0, "max_runtime_limit_s": 131400},
        {**base, "team": "b", "default_max_runtime_s": None},
    ]
    table = admin_table(rows, team_columns(wide), wide=wide)
    text = _render(table, output.WIDE_WIDTH if wide else 80)
    a = next(line for line in text.splitlines() if line.startswith("a "))
    b = next(line for line in text.splitlines() if line.startswith("b "))
    if wide:
        assert "default runtime" in text and "max runtime" in text
        assert a.split()[-2:] == ["4h", "1d12h30m"] and b.split()[-2:] == ["-", "-"]
    else:  # one column: default/max
        assert text.splitlines()[0].split()[-1] == "runtime"
        assert a.split()[-1] == "4h/1d12h30m" and b.split()[-1] == "-/-"
    assert duration_s("1d12h30m", "--max-runtime") == 131400  # what the CLI takes back


def test_admin_token_list_never_cuts_ids() -> None:
    from gpufleet.cli.admin_api import admin_table, token_columns

    rows = [
        {
            "id": f"tok-01m8psw7vnw5ej6c82bp4cehn{i}",
            "team": "a-rather-long-team-name",
            "name": "continuous-integration-bot",
            "admin": i == 0,
            "created_at": "2026-11-30T10:00:00+00:00",
            "revoked_at": "2026-11-30T11:00:00+00:00" if i else None,
        }
        for i in range(3)
    ]
    text = _render(admin_table(rows, token_columns(False), whole=("id",)))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert all(str(r["id"]) in text for r in rows)
    wide = _render(admin_table(rows, token_columns(True), wide=True), output.WIDE_WIDTH)
    assert "2026-11-30 10:00:00Z" in wide and "continuous-integration-bot" in wide


def test_artifacts_table_keeps_sizes_and_cuts_sha256_when_narrow() -> None:
    from gpufleet.cli.usage import artifacts_table
    from gpufleet.client.models import Artifact

    sha = "ab" * 32
    items = [
        Artifact(path="checkpoints/" + "deep/" * 12 + "model.pt", size=123456789012, sha256=sha)
    ]
    text = _render(artifacts_table(items))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "123456789012" in text and sha[:12] in text and sha not in text
    wide = _render(artifacts_table(items, wide=True), output.WIDE_WIDTH)
    assert sha in wide and str(items[0].path) in wide


def test_wide_attempts_show_the_last_checkpoint() -> None:
    attempt = {
        "run_id": "r-1",
        "attempt": 1,
        "status": "RUNNING",
        "node_id": "n1",
        "gpu_ids": [0],
        "token": 3,
        "started_at": "2026-12-01T10:00:00Z",
        "last_checkpoint_at": "2026-12-01T10:42:07Z",
    }
    buf = io.StringIO()
    Console(file=buf, width=240).print(output.attempts_table([attempt], wide=True))
    text = buf.getvalue()
    assert "CHECKPOINT" in text and "10:42:07" in text


def test_a_reservations_start_is_not_contradicted_by_a_not_yet_estimate() -> None:
    """A new job with a backfill reservation showed "estimated start ... (in 2m)" beside
    "start: unknown because the scheduler has not estimated it yet"."""
    from gpufleet.cli.output import pending_lines

    reason = {
        "code": "reserved",
        "message": "waits for its reservation",
        "estimated_start_at": "2099-01-01T00:00:00Z",
        "start_estimate": {"unknown": "not estimated yet", "text": "unknown because ..."},
    }
    lines = pending_lines(reason)
    assert any("estimated start:" in line for line in lines)
    assert not any(line.strip().startswith("start:") for line in lines)
    ranged = {**reason, "start_estimate": {"earliest_s": 1.0, "text": "in 2-5 min"}}
    assert any("in 2-5 min" in line for line in pending_lines(ranged))


def test_token_id_owners_show_as_unique_id_prefixes_not_cut() -> None:
    """A token without a user name owns its jobs by its id; two made in the same second
    share their first characters, which an ellipsis used to leave as all that showed."""
    owners = ["tok-01m9176kjak3rm019180nwx3w8", "tok-01m9176kjqzzrm019180nwx3w8", "alice"]
    jobs = [{**_job(i, "PENDING"), "owner": o} for i, o in enumerate(owners)]
    text = _render(output.jobs_table(jobs))
    assert "tok-01m9176kjak3" in text and "tok-01m9176kjqzz" in text
    assert "alice" in text
    assert all(len(line) <= 80 for line in text.splitlines())
    assert output.token_owner_refs(jobs) == {
        "tok-01m9176kjak3rm019180nwx3w8": "tok-01m9176kjak3",
        "tok-01m9176kjqzzrm019180nwx3w8": "tok-01m9176kjqzz",
    }


def test_epoch_details_show_as_dates_nested_too() -> None:
    """`why` printed ``until_s=1796418117.659289`` and ``renews_at_s`` raw; times on the
    scheduler's clock show as UTC dates, durations and counts stay numbers."""
    from gpufleet.cli.output import pending_lines

    reason = {
        "code": "class_budget",
        "message": "over budget",
        "details": {
            "renews_at_s": 1796418117.659289,
            "used_gpu_h": 12.5,
            "grace_s": 30.0,
            "demoted": {"until_s": 1796418117.659289, "effective": "LOW"},
        },
    }
    text = "\n".join(pending_lines(reason))
    assert "1796418117" not in text, text
    assert "renews_at:" in text and "2026-12-04 " in text
    assert "until=2026-12-04 " in text and "effective=LOW" in text
    assert "used_gpu_h:" in text and "12.5" in text and "30.0" in text
