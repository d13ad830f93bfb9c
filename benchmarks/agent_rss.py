"""Memory of a running node agent (issue 11: agent RSS <= 30 MB), beside its floors.

The platform of ``lifecycle.py`` (controller + API in this process, a fresh SQLite database,
mutual TLS as ``gpufleet up`` sets it up), ``--agents`` real ``gpufleet agent`` subprocesses.
Once every agent is HEALTHY and ``--jobs`` 1-GPU ``true`` jobs have run through each (so the
RPC, confirm, upload and completion paths have all been used), the script reads each agent's
``/proc/<pid>/status``: ``VmRSS`` (resident), ``RssAnon`` (its own heap) and ``RssFile``
(mapped shared libraries and files, shared with other processes using the same files).

Floors, each a fresh interpreter that imports and then reads its own ``VmRSS``: ``python -c
pass``; ``import grpc`` plus the generated protobuf modules (what any gRPC agent in Python
needs); the agent's module (``gpufleet.agent.main``) alone.

    .venv/bin/python benchmarks/agent_rss.py [--agents 2] [--jobs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _common import console, machine, table_console
from lifecycle import Platform
from rich.markup import escape
from rich.table import Table

FLOORS = {
    "python -c pass": "pass",
    "import grpc + fleet_pb2(_grpc)": (
        "import grpc; from gpufleet.rpc.protos import fleet_pb2_grpc"
    ),
    "import gpufleet.agent.main": "import gpufleet.agent.main",
}


def status_kb(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` of ``pid`` in kB (from ``/proc/<pid>/status``)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0])
    return out


def smaps_kb(pid: int) -> dict[str, tuple[int, int]]:
    """(Rss, Anonymous) kB of ``pid`` per mapped file (``[anon]``, ``[heap]``, ...)."""
    out: dict[str, tuple[int, int]] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and not parts[0].endswith(":"):
            name = parts[5] if len(parts) > 5 else "[anon]"
        elif parts and parts[0] in ("Rss:", "Anonymous:"):
            rss, anon = out.get(name, (0, 0))
            kb = int(parts[1])
            out[name] = (rss + kb, anon) if parts[0] == "Rss:" else (rss, anon + kb)
    return out


def floor_kb(code: str) -> dict[str, int]:
    probe = f"{code}\nfrom pathlib import Path\nprint(Path('/proc/self/status').read_text())"
    text = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=5, help="1-GPU jobs run through each agent")
    ap.add_argument(
        "--smaps", type=int, default=0, help="also print the first agent's N largest mappings"
    )
    args = ap.parse_args()
    rows: list[tuple[str, dict[str, int]]] = []
    for name, code in FLOORS.items():
        rows.append((name, floor_kb(code)))
    with tempfile.TemporaryDirectory(prefix="gf-agentrss-") as tmp:
        platform = Platform(Path(tmp), f"sqlite:///{tmp}/gpufleet.db")
        try:
            platform.start(args.agents)
            console.print(f"{args.agents} agents HEALTHY; running {args.jobs} jobs each")
            with platform.http() as c:
                ids = []
                for _ in range(args.jobs * args.agents):
                    r = c.post(
                        "/v1/jobs",
                        json={"command": ["true"], "gpu_count": 1},
                        headers={"Idempotency-Key": uuid.uuid4().hex},
                    )
                    r.raise_for_status()
                    ids.append(r.json()["job_id"])
            platform.wait_terminal(ids, timeout_s=300)
            time.sleep(2.0)  # a heartbeat or two after the last completion
            per_agent = [status_kb(p.pid) for p in platform.agents.values()]
            maps = smaps_kb(next(iter(platform.agents.values())).pid) if args.smaps else {}
        finally:
            platform.close()
    for key in ("VmRSS",):
        values = [a[key] for a in per_agent]
        console.print(f"agent {key} kB: {values}")
    agent = {k: int(statistics.median(a[k] for a in per_agent)) for k in per_agent[0]}
    rows.append((f"gpufleet agent (median of {len(per_agent)}, after jobs)", agent))

    table = Table(title="Resident memory, MB (target: agent VmRSS <= 30)")
    for col in ("process", "VmRSS", "RssAnon", "RssFile"):
        table.add_column(col, justify="left" if col == "process" else "right")
    for name, kb in rows:
        table.add_row(
            name, *(f"{kb.get(k, 0) / 1024:.1f}" for k in ("VmRSS", "RssAnon", "RssFile"))
        )
    out = table_console(100)
    out.print(table)
    if maps:
        top = Table(title="First agent's largest mappings, kB (Anonymous: its private pages)")
        for col in ("mapping", "Rss", "Anonymous"):
            top.add_column(col, justify="left" if col == "mapping" else "right")
        for name, (rss, anon) in sorted(maps.items(), key=lambda kv: -kv[1][0])[: args.smaps]:
            top.add_row(escape(name.rsplit("/", 1)[-1]), str(rss), str(anon))
        out.print(top)
    load = os.getloadavg()
    out.print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {machine()}")


if __name__ == "__main__":
    main()
