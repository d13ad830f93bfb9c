"""CLI answers found wrong by a new-user trial: bulk cancel matching nothing, empty job ids,
release/cancel of finished jobs, human values in ``update``, ``logs`` truncation and jobs that
end without running, prefix-too-short messages (against the fake API of test_cli_client)."""

from __future__ import annotations

import httpx
import pytest

from tests.unit.test_cli_client import FakeApi, cli
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
