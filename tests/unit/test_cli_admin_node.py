"""``gpufleet admin node`` and ``admin team set`` refuse bad numbers before any request (exit
2 naming the option, no traceback), and say what is true after a drain; the agent reports
each podman image name once."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufleet.agent.runtime.container_engine import ContainerEngine
from gpufleet.cli import admin_api
from gpufleet.cli.main import app

# nothing listens here: a command that got past its options would fail to connect (exit 1)
NO_SERVER = {"GPUFLEET_URL": "http://127.0.0.1:9", "GPUFLEET_TOKEN": "t", "COLUMNS": "200"}


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["node", "drain", "local-0", "--timeout", "-5"], id="negative timeout"),
        pytest.param(["node", "drain", "local-0", "--timeout", "nan"], id="nan timeout"),
        pytest.param(["node", "drain", "local-0", "--timeout", "inf"], id="inf timeout"),
    ],
)
def test_a_bad_drain_timeout_is_refused_naming_the_option(argv: list[str]) -> None:
    result = CliRunner().invoke(app, ["admin", *argv], env=NO_SERVER)
    assert result.exit_code == 2, result.output
    assert "--timeout" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("value", ["nan", "inf", "-5/s", "fast"])
def test_a_bad_submit_rate_is_refused_naming_the_option(value: str) -> None:
    with pytest.raises(admin_api.ClientError) as info:
        admin_api.rate(value)
    assert info.value.field == "--submit-rate" and info.value.exit_code == 2


def test_a_good_submit_rate_is_per_second() -> None:
    assert (admin_api.rate("5/s"), admin_api.rate("0"), admin_api.rate(None)) == (5.0, 0.0, None)


@pytest.mark.parametrize(
    ("data", "want"),
    [
        pytest.param(
            {"node_id": "n1", "previous_status": "DRAINING", "status": "DRAINING"},
            "node n1: already DRAINING",
            id="a second drain",
        ),
        pytest.param(
            {"node_id": "n1", "previous_status": "HEALTHY", "status": "DRAINING"},
            "node n1: HEALTHY -> DRAINING",
            id="a first drain",
        ),
    ],
)
def test_a_status_change_or_its_absence_is_said(
    data: dict[str, Any], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    admin_api._moved(data)
    assert capsys.readouterr().out.strip() == want


def test_drained_says_the_node_goes_cordoned_at_the_next_upkeep() -> None:
    # the controller's upkeep, not the command, moves DRAINING -> CORDONED
    said = admin_api._drained("n1", "DRAINING")
    assert "(DRAINING)" not in said and "goes CORDONED when the controller" in said
    assert admin_api._drained("n1", "CORDONED") == "node n1: drained (CORDONED)"


def test_podman_images_are_listed_once_per_name_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # podman 4 lists an image once per tag, each entry with all its names
    entry = {
        "Names": ["localhost/py:3.11", "127.0.0.1:5000/py:3.11"],
        "Digest": "sha256:1",
        "Size": 5,
    }
    other = {"Names": ["localhost/cuda:12"], "Digest": "sha256:2", "Size": 7}
    engine = ContainerEngine.__new__(ContainerEngine)
    engine.kind = "podman"

    def run(args: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 0, json.dumps([entry, entry, other]), "")

    monkeypatch.setattr(engine, "_run", run)
    assert [i.name for i in engine.images()] == [
        "localhost/py:3.11",
        "127.0.0.1:5000/py:3.11",
        "localhost/cuda:12",
    ]


@pytest.mark.parametrize(
    "argv",
    [["team", "list"], ["token", "list"], ["node", "list"]],
    ids=["team list", "token list", "node list"],
)
def test_admin_lists_refuse_an_unknown_output_format(argv: list[str]) -> None:
    """`-o bogus` (and `-o yaml`, which it ignored) printed the table: only table, wide,
    json and yaml are formats, checked before any request."""
    result = CliRunner().invoke(app, ["admin", *argv, "-o", "bogus"], env=NO_SERVER)
    assert result.exit_code == 2, result.output
    assert "--output" in result.output and "bogus" in result.output


def test_admin_team_list_prints_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"team": "nlp", "guaranteed_gpus": {"A100": 8}}]
    monkeypatch.setattr(admin_api, "_call", lambda *_a, **_k: {"items": rows})
    result = CliRunner().invoke(app, ["admin", "team", "list", "-o", "yaml"], env=NO_SERVER)
    assert result.exit_code == 0, result.output
    assert result.stdout == "- team: nlp\n  guaranteed_gpus:\n    A100: 8\n"


def test_team_set_without_a_setting_changes_nothing_and_says_so() -> None:
    """`admin team set nlp` with no option printed "team nlp updated"."""
    result = CliRunner().invoke(app, ["admin", "team", "set", "nlp"], env=NO_SERVER)
    assert result.exit_code == 2, result.output
    assert "nothing to change" in result.output and "updated" not in result.output
