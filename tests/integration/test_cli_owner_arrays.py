"""Issue 26 on a real ``gpufleet server`` process: jobs have an owner (the submitting token's
user) that ``list --user``/``--mine`` filter on, list/status show elapsed time and time left,
and an array's tasks are shown (and taken back) as ``ARRAY_INDEX`` with table ids that are
unique. No agent runs, so jobs stay PENDING; run times of a running job are in
tests/e2e/test_cli_daily.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpufleet.client import Client, ValidationError
from gpufleet.processes import open_database
from gpufleet.services import auth
from gpufleet.settings import Settings
from tests.integration.server_proc import ServerProcess


class Fleet:
    def __init__(self, proc: ServerProcess, tokens: dict[str, str], tmp: Path) -> None:
        self.proc, self.url, self.tokens, self.tmp = proc, proc.url, tokens, tmp

    def cli(self, who: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
        env |= {
            "GPUFLEET_URL": self.url,
            "GPUFLEET_TOKEN": self.tokens[who],
            "GPUFLEET_CONFIG": str(self.tmp / "absent.yaml"),
            "COLUMNS": "80",
            "NO_COLOR": "1",
        }
        return subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", *args],
            env=env,
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("owner")
    db = open_database(Settings(data_dir=tmp))
    tokens = {
        "alice": db.run_write(
            lambda s: auth.create_token(s, "vision", name="alice", create_team_if_missing=True)
        ),
        "bob": db.run_write(lambda s: auth.create_token(s, "vision", user="bob@lab")),
        "admin": db.run_write(
            lambda s: auth.create_token(
                s, "ops", name="root", is_admin=True, create_team_if_missing=True
            )
        ),
    }
    db.dispose()
    proc = ServerProcess(tmp).start()
    try:
        yield Fleet(proc, tokens, tmp)
    finally:
        proc.stop()


def _submit(fleet: Fleet, who: str, *args: str) -> str:
    got = fleet.cli(who, "submit", "-q", *args)
    assert got.returncode == 0, got.stderr
    return got.stdout.strip()


class TestOwner:
    def test_jobs_carry_their_owner_and_list_filters_on_it(self, fleet: Fleet) -> None:
        a = _submit(fleet, "alice", "--name", "own-a", "--", "true")
        b = _submit(fleet, "bob", "--name", "own-b", "--", "true")
        shown = json.loads(fleet.cli("alice", "status", a, "-o", "json").stdout)
        assert shown["owner"] == "alice"
        assert "owner" in fleet.cli("bob", "status", b).stdout
        assert "bob@lab" in fleet.cli("bob", "status", b).stdout

        def ids(who: str, *args: str) -> set[str]:
            got = fleet.cli(who, "list", "--all", *args, "-o", "json")
            assert got.returncode == 0, got.stderr
            return {j["job_id"] for j in json.loads(got.stdout)["items"]}

        assert {a, b} <= ids("alice")
        mine = ids("alice", "--mine")
        assert a in mine and b not in mine
        assert ids("bob", "--me") & {a, b} == {b}
        assert ids("alice", "--user", "bob@lab") & {a, b} == {b}
        assert ids("admin", "-u", "alice") & {a, b} == {a}  # an admin: every team's
        table = fleet.cli("alice", "list")
        assert "OWNER" in table.stdout and "alice" in table.stdout

        with Client(fleet.url, fleet.tokens["bob"]) as c:
            assert [j.owner for j in c.list(mine=True)][:1] == ["bob@lab"]
            with pytest.raises(ValidationError) as bad:
                c.list_page(user="no spaces")
            assert bad.value.field == "user"

    def test_bad_filters_are_4xx_naming_the_field(self, fleet: Fleet) -> None:
        h = {"Authorization": f"Bearer {fleet.tokens['alice']}"}
        for params, field in (
            ({"user": "a b"}, "user"),
            ({"user": "-x"}, "user"),
            ({"user": "alice", "mine": "true"}, "mine"),
        ):
            r = httpx.get(f"{fleet.url}/v1/jobs", params=params, headers=h)
            assert 400 <= r.status_code < 500, (params, r.status_code, r.text)
            assert r.json()["field"] == field, r.text
        # a value that is no boolean: pydantic's location, in a sentence that says what to give
        r = httpx.get(f"{fleet.url}/v1/jobs", params={"mine": "maybe"}, headers=h)
        assert r.status_code == 422 and r.json()["field"] == "query.mine", r.text
        assert "'maybe' is not a boolean: give true or false" in r.json()["message"]
        both = fleet.cli("alice", "list", "--user", "bob", "--mine")
        assert both.returncode == 2 and "--mine" in both.stderr

    def test_admin_token_create_takes_a_user(self, fleet: Fleet) -> None:
        made = fleet.cli(
            "admin", "admin", "token", "create", "--team", "vision", "--name", "CI bot",
            "--user", "carol",
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        raw = made.stdout.strip().splitlines()[-1]
        listed = json.loads(fleet.cli("admin", "admin", "token", "list", "-o", "json").stdout)
        assert {"name": "CI bot", "user": "carol"}.items() <= next(
            t for t in listed if t["name"] == "CI bot"
        ).items()
        # a name that is no user name: the token's id is its user
        fleet.cli("admin", "admin", "token", "create", "--team", "vision", "--name", "a b")
        listed = json.loads(fleet.cli("admin", "admin", "token", "list", "-o", "json").stdout)
        odd = next(t for t in listed if t["name"] == "a b")
        assert odd["user"] == odd["id"]
        bad = fleet.cli("admin", "admin", "token", "create", "--team", "vision", "--user", "x y")
        assert bad.returncode != 0 and "user" in bad.stderr
        fleet.tokens["carol"] = raw
        job = _submit(fleet, "carol", "--", "true")
        assert json.loads(fleet.cli("carol", "status", job, "-o", "json").stdout)["owner"] == (
            "carol"
        )


class TestTimes:
    def test_pending_jobs_show_no_run_time_but_the_columns(self, fleet: Fleet) -> None:
        job = _submit(fleet, "alice", "--max-runtime-s", "600", "--", "true")
        got = json.loads(fleet.cli("alice", "status", job, "-o", "json").stdout)
        assert got["elapsed_s"] is None and got["time_left_s"] is None
        header = fleet.cli("alice", "list").stdout.splitlines()[0].split()
        assert header[-3:] == ["AGE", "TIME", "LEFT"], header


class TestArrays:
    def test_tasks_show_as_array_index_and_status_takes_it(self, fleet: Fleet) -> None:
        sub = fleet.cli("alice", "submit", "--array", "0-9", "--name", "sweep", "--", "true")
        assert sub.returncode == 0, sub.stderr
        tasks = json.loads(fleet.cli("alice", "list", "--name", "sweep", "-o", "json").stdout)[
            "items"
        ]
        assert len(tasks) == 10
        array_id = tasks[0]["array_id"]
        table = fleet.cli("alice", "list", "--name", "sweep")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80, table.stdout
        refs = [line.split()[0] for line in lines[1:]]
        assert len(refs) == 10 and len(set(refs)) == 10, table.stdout
        assert all(r.startswith(array_id[:14]) and "_" in r for r in refs), refs
        by_index = {t["array_index"]: t["job_id"] for t in tasks}
        for ref in refs:
            index = int(ref.rsplit("_", 1)[1])
            got = fleet.cli("alice", "status", ref, "-o", "json")
            assert got.returncode == 0, got.stderr
            assert json.loads(got.stdout)["job_id"] == by_index[index]
        # the array's name works too, and a missing index is a clear 404
        named = json.loads(fleet.cli("alice", "status", "sweep_7", "-o", "json").stdout)
        assert named["job_id"] == by_index[7]
        missing = fleet.cli("alice", "status", f"{array_id}_42")
        assert missing.returncode != 0 and "has no task 42" in missing.stderr
        assert f"{array_id}_3" in fleet.cli("alice", "status", by_index[3]).stdout
        # every task's own id is unique in the wide table
        wide = fleet.cli("alice", "list", "--name", "sweep", "--wide")
        assert all(t in wide.stdout for t in by_index.values())
