"""The node agent's process imports none of the server side's heavy libraries (issue 11: agent
RSS). Checked in a fresh interpreter, for the agent's module and for the CLI it starts from."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SERVER_SIDE = ("sqlalchemy", "alembic", "fastapi", "starlette", "uvicorn", "psycopg", "redis")


@pytest.mark.parametrize("module", ["gpufleet.agent.main", "gpufleet.cli.main"])
def test_the_agent_imports_no_server_side_library(module: str) -> None:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout)}
    assert loaded.isdisjoint(SERVER_SIDE), sorted(loaded & set(SERVER_SIDE))
