"""The node agent's process imports none of the server side's heavy libraries (issue 11: agent
RSS). Checked in a fresh interpreter for the agent's module and the CLI it starts from, and in
a real ``gpufleet agent`` process serving a controller (``benchmarks/agent_rss.py`` prints the
memory figures)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_agent_support import fake_controller, test_pki

SERVER_SIDE = ("sqlalchemy", "alembic", "fastapi", "starlette", "uvicorn", "psycopg", "redis")
# what `gpufleet agent` parses its options with, and the settings it resolves there: the agent
# process itself (exec'd into, agent/__main__.py) holds none of it
CLI_SIDE = ("typer", "click", "rich", "pydantic", "pydantic_settings", "httpx", "yaml")
# cryptography (~12 MB): keys, CSRs and certificate checks run in a child (agent.pkichild);
# fsspec (~3.5 MB): a local object store uses plain files
AGENT_CHILD_SIDE = ("cryptography", "fsspec")


def test_the_agent_module_leaves_certificate_work_to_a_child() -> None:
    code = "import json, sys, gpufleet.agent.main; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout)}
    assert loaded.isdisjoint(AGENT_CHILD_SIDE), sorted(loaded & set(AGENT_CHILD_SIDE))


@pytest.mark.parametrize("module", ["gpufleet.agent.main", "gpufleet.cli.main"])
def test_the_agent_imports_no_server_side_library(module: str) -> None:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout)}
    assert loaded.isdisjoint(SERVER_SIDE), sorted(loaded & set(SERVER_SIDE))


def test_a_running_agent_process_holds_no_server_or_cli_library(tmp_path: Path) -> None:
    """A real ``gpufleet agent`` registers with a (recording) controller, is stopped with
    SIGTERM, and dumps its ``sys.modules`` at exit (a ``sitecustomize`` on PYTHONPATH,
    imported again by the interpreter the CLI execs into: the dump is the agent's own)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    dump = tmp_path / "modules.json"
    (hook / "sitecustomize.py").write_text(
        "import atexit, json, os, sys\n"
        "def _dump():\n"
        "    with open(os.environ['GF_TEST_MODULES_DUMP'], 'w') as f:\n"
        "        json.dump({'pid': os.getpid(), 'modules': sorted(sys.modules)}, f)\n"
        "atexit.register(_dump)\n"
    )
    state = tmp_path / "state"
    test_pki().provision(state, "node-rss")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env |= {
        "PYTHONPATH": os.pathsep.join([str(hook), *sys.path]),
        "GF_TEST_MODULES_DUMP": str(dump),
        "GPUFLEET_DATA_DIR": str(tmp_path / "data"),
    }
    with fake_controller() as (fake, address):
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpufleet.cli.main",
                "agent",
                "--node-id",
                "node-rss",
                "--gpus",
                "2xH100-80GB",
                "--state-dir",
                str(state),
                "--controller",
                address,
                "--runtime",
                "none",
                "--job-uids",
                "agent",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            fake.wait_for(lambda: fake.registrations, 60)
            cmdline = Path(f"/proc/{agent.pid}/cmdline").read_bytes().split(b"\0")
            assert b"gpufleet.agent" in cmdline  # the same pid now runs the agent's module
            agent.send_signal(signal.SIGTERM)
            output = agent.communicate(timeout=60)[0].decode(errors="replace")
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    assert agent.returncode == 0, output[-2000:]
    data = json.loads(dump.read_text())
    assert data["pid"] == agent.pid
    loaded = {m.split(".")[0] for m in data["modules"]}
    assert "grpc" in loaded and "gpufleet" in loaded  # it is the agent's module list
    assert loaded.isdisjoint(SERVER_SIDE), sorted(loaded & set(SERVER_SIDE))
    assert loaded.isdisjoint(CLI_SIDE), sorted(loaded & set(CLI_SIDE))
    # it checked its saved certificate (agent.pkichild) without loading cryptography itself,
    # and uses its local object store without fsspec
    assert loaded.isdisjoint(AGENT_CHILD_SIDE), sorted(loaded & set(AGENT_CHILD_SIDE))
    assert "prometheus_client" not in loaded  # no --metrics-port: no metrics stack
