"""``gpufleet admin team|token|node`` through the REST API against a real server: an admin
token works from anywhere, a team token is refused with a clear message, quotas that can
never be met are refused with the numbers, Kueue's names (nominal quota, borrowing limit,
lending limit) are accepted and the old lending-limit meaning is converted with a warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpufleet.processes import open_database
from gpufleet.services import auth
from gpufleet.settings import Settings
from tests.factories import create_node
from tests.integration.server_proc import ServerProcess

pytestmark = pytest.mark.slow


class Admin:
    def __init__(self, tmp: Path) -> None:
        db = open_database(Settings(data_dir=tmp))
        self.admin = db.run_write(
            lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
        )
        self.team = db.run_write(
            lambda s: auth.create_token(s, "vision", create_team_if_missing=True)
        )
        create_node(db, "n1", gpus=8, gpu_type="H100")
        db.dispose()
        self.tmp = tmp
        self.server = ServerProcess(tmp, {"GPUFLEET_REDIS_URL": ""}).start()

    def cli(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "COLUMNS": "250",
            "GPUFLEET_URL": self.server.url,
            "GPUFLEET_TOKEN": token or self.admin,
            "GPUFLEET_CONFIG": str(self.tmp / "none.yaml"),
        }
        return subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "admin", *args],
            env=env,
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )


@pytest.fixture(scope="module")
def admin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Admin]:
    a = Admin(tmp_path_factory.mktemp("admin-api"))
    try:
        yield a
    finally:
        a.server.stop()


def test_a_team_token_is_refused_with_a_clear_message(admin: Admin) -> None:
    for args in (("team", "list"), ("token", "list"), ("node", "cordon", "n1")):
        got = admin.cli(*args, token=admin.team)
        assert got.returncode == 2, (args, got.stdout)
        assert "needs an admin token" in got.stderr and "vision" in got.stderr
        assert "Traceback" not in got.stderr
    with httpx.Client(base_url=admin.server.url) as http:
        r = http.post(
            "/v1/admin/nodes/n1/drain",
            json={},
            headers={"Authorization": f"Bearer {admin.team}"},
        )
        assert r.status_code == 403 and r.json()["error"] == "forbidden"


def test_quotas_that_can_never_be_met_are_refused_with_numbers(admin: Admin) -> None:
    assert admin.cli("team", "create", "nlp").returncode == 0
    too_big = admin.cli("team", "set", "nlp", "--nominal-quota", "H100=24")
    assert too_big.returncode == 2
    assert "24 exceeds the 8 H100 GPUs" in too_big.stderr
    unknown = admin.cli("team", "set", "nlp", "--guarantee", "H100-80GB=2")
    assert unknown.returncode == 2
    assert (
        "no node has GPU type 'H100-80GB'" in unknown.stderr and "H100 (8 GPUs)" in unknown.stderr
    )
    lend = admin.cli(
        "team", "set", "nlp", "--nominal-quota", "H100=6", "--lending-limit", "H100=9"
    )
    assert (
        lend.returncode == 2 and "lending_limit[H100] = 9 exceeds the guarantee (6)" in lend.stderr
    )
    with httpx.Client(base_url=admin.server.url) as http:
        r = http.put(
            "/v1/admin/teams/nlp",
            json={"nominal_quota": {"A100": 1}},
            headers={"Authorization": f"Bearer {admin.admin}"},
        )
        assert r.status_code == 422 and r.json()["field"] == "guaranteed_gpus"
        both = http.put(
            "/v1/admin/teams/nlp",
            json={"nominal_quota": {"H100": 1}, "guaranteed_gpus": {"H100": 1}},
            headers={"Authorization": f"Bearer {admin.admin}"},
        )
        assert both.status_code == 422


def test_kueue_names_and_the_old_lending_limit_meaning(admin: Admin) -> None:
    admin.cli("team", "create", "speech")
    ok = admin.cli(
        "team", "set", "speech", "--nominal-quota", "H100=6", "--lending-limit", "H100=2",
        "--borrowing-limit", "1",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "Kueue's lendingLimit" in ok.stderr
    teams = {t["team"]: t for t in json.loads(admin.cli("team", "list", "-o", "json").stdout)}
    got = teams["speech"]
    assert (got["guaranteed_gpus"], got["lending_limit"], got["never_lent_gpus"]) == (
        {"H100": 6},
        {"H100": 2},
        {"H100": 4},
    )
    assert got["borrow_limit_gpus"] == 1
    old = admin.cli("team", "set", "speech", "--never-lent", "H100=5")
    assert old.returncode == 0 and "deprecated" in old.stderr
    teams = {t["team"]: t for t in json.loads(admin.cli("team", "list", "-o", "json").stdout)}
    assert teams["speech"]["lending_limit"] == {"H100": 1}
    # over-committed: allowed, with a warning naming the numbers
    over = admin.cli("team", "set", "vision", "--nominal-quota", "H100=4")
    assert over.returncode == 0
    assert "add up to 10, more than the fleet's 8 H100 GPUs" in over.stderr
    table = admin.cli("team", "list")
    assert table.stdout.splitlines()[0].split()[-4:] == ["alloc", "pending", "GPU-h", "runtime"]
    wide = admin.cli("team", "list", "--wide")
    assert "fair-share GPU-h (decayed)" in wide.stdout and "lending limit" in wide.stdout


def test_node_and_token_commands_go_through_the_api(admin: Admin) -> None:
    cordon = admin.cli("node", "cordon", "n1", "--reason", "fan failure")
    assert cordon.returncode == 0 and "HEALTHY -> CORDONED" in cordon.stdout, cordon.stderr
    assert admin.cli("node", "uncordon", "n1").returncode == 0
    drain = admin.cli("node", "drain", "n1")
    assert drain.returncode == 0 and "drained" in drain.stdout, drain.stderr
    assert admin.cli("node", "uncordon", "n1").returncode == 0
    refused = admin.cli("node", "fence", "n1")
    assert refused.returncode == 2 and "--confirm-dead" in refused.stderr
    # --force: n1 may have registered within the heartbeat window (it would look alive)
    fenced = admin.cli("node", "fence", "n1", "--confirm-dead", "--force")
    assert fenced.returncode == 0 and "FENCED" in fenced.stdout, fenced.stderr
    nodes = json.loads(admin.cli("node", "list", "-o", "json").stdout)
    assert [(n["node_id"], n["status"]) for n in nodes] == [("n1", "FENCED")]
    missing = admin.cli("node", "cordon", "nope")
    assert missing.returncode == 2 and "no node 'nope'" in missing.stderr
    typo = admin.cli("token", "create", "--team", "newteam", "--name", "carol")
    assert typo.returncode == 2 and "no team 'newteam'" in typo.stderr, typo.stderr
    assert "known teams:" in typo.stderr and "(field: team)" in typo.stderr
    made = admin.cli("token", "create", "--team", "newteam", "--name", "carol", "--create-team")
    assert made.returncode == 0 and made.stdout.strip().startswith("gft_")
    listed = json.loads(admin.cli("token", "list", "--team", "newteam", "-o", "json").stdout)
    assert [(t["team"], t["name"]) for t in listed] == [("newteam", "carol")]


def test_a_prepull_of_a_bad_image_reference_is_a_422_naming_image(admin: Admin) -> None:
    with httpx.Client(base_url=admin.server.url) as http:
        for image in ("--help", "UPPER/case"):
            r = http.post(
                "/v1/admin/prepull",
                json={"image": image},
                headers={"Authorization": f"Bearer {admin.admin}"},
            )
            assert r.status_code == 422, r.text
            assert r.json()["field"] == "image", r.json()
        ok = http.post(
            "/v1/admin/prepull",
            json={"image": "127.0.0.1:5000/gpufleet/busybox:1"},
            headers={"Authorization": f"Bearer {admin.admin}"},
        )
        assert ok.status_code == 200, ok.text
