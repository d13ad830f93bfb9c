"""Hollow nodes for scenario tests (``python -m gpufleet.agent.hollow``,
docs/design/hollow-nodes.md): start a process of N nodes joined to a fleet, read node states,
and the attempt rules the fleet-scale scenarios share."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from sqlalchemy import select

from gpufleet.processes import new_join_token
from gpufleet.rpc import tls
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow, SchedulingEventRow

NOT_HEALTHY = ("SUSPECT", "QUARANTINED", "FENCED")
"""Node states a live node must never be moved to by fencing."""


def start_hollow(
    db: Database,
    settings: Settings,
    tmp: Path,
    count: int,
    control: Path,
    *,
    controllers: str | None = None,
    join_addresses: str | None = None,
    args: Iterable[str] = (),
) -> subprocess.Popen[bytes]:
    """``python -m gpufleet.agent.hollow`` with ``count`` nodes ``hollow-0000...`` joined to
    the fleet of ``settings`` (or to ``controllers`` / ``join_addresses``: comma-separated
    lists), silenced by the node ids listed in ``control``; its log is ``tmp/hollow.log``."""
    ids = [f"hollow-{i:04d}" for i in range(count)]
    tokens = {n: new_join_token(db, settings, n, 600)[0] for n in ids}
    token_file = tmp / "hollow-tokens.json"
    token_file.write_text(json.dumps(tokens))
    token_file.chmod(0o600)
    log = open(tmp / "hollow.log", "ab")  # noqa: SIM115
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.agent.hollow",
            "--count",
            str(count),
            "--controller",
            controllers or settings.controller_address,
            "--join-address",
            join_addresses or settings.resolved_join_address(),
            "--object-store-url",
            settings.resolved_object_store_url(),
            "--ca-cert",
            str(tls.ca_paths(settings.resolved_pki_dir())[1]),
            "--tokens",
            str(token_file),
            "--state-root",
            str(tmp / "hollow"),
            "--control",
            str(control),
            "--default-grace-s",
            "1",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def stop_hollow(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def node_statuses(db: Database) -> dict[str, str]:
    with db.read() as s:
        return {n.id: n.status for n in s.scalars(select(NodeRow))}


def healthy_count(db: Database) -> int:
    return Counter(node_statuses(db).values())["HEALTHY"]


def busy_nodes(db: Database, k: int) -> list[str]:
    """Up to ``k`` nodes running attempts now, spread over the sorted list of busy nodes."""
    with db.read() as s:
        busy = sorted(
            set(s.scalars(select(JobRunRow.node_id).where(JobRunRow.status == "RUNNING")))
        )
    return busy[:: max(1, len(busy) // k)][:k]


def ever_not_healthy(db: Database) -> set[str]:
    """Nodes ever moved to SUSPECT, QUARANTINED or FENCED (node transition events)."""
    with db.read() as s:
        return {
            str(n)
            for n in s.scalars(
                select(SchedulingEventRow.entity_id).where(
                    SchedulingEventRow.machine == "node",
                    SchedulingEventRow.to_status.in_(NOT_HEALTHY),
                )
            )
        }


def job_statuses(db: Database, jobs: list[str]) -> Counter[str]:
    with db.read() as s:
        return Counter(s.scalars(select(JobRow.status).where(JobRow.id.in_(jobs))))


def assert_each_succeeded_once(
    db: Database, jobs: list[str], other_allowed: Callable[[JobRunRow], bool]
) -> None:
    """Every job SUCCEEDED with exactly one SUCCEEDED attempt; each of its other attempts
    passes ``other_allowed`` (e.g. FENCED on a silenced node)."""
    with db.read() as s:
        statuses = {
            r.id: r.status
            for r in s.execute(select(JobRow.id, JobRow.status).where(JobRow.id.in_(jobs)))
        }
        runs = list(s.scalars(select(JobRunRow).where(JobRunRow.job_id.in_(jobs))))
        for r in runs:
            s.expunge(r)
    assert Counter(statuses.values()) == {"SUCCEEDED": len(jobs)}, Counter(statuses.values())
    by_job: dict[str, list[JobRunRow]] = {}
    for r in runs:
        by_job.setdefault(r.job_id, []).append(r)
    for job_id in jobs:
        attempts = by_job[job_id]
        summary = [(r.status, r.node_id, r.message) for r in attempts]
        assert [r.status for r in attempts].count("SUCCEEDED") == 1, (job_id, summary)
        others = [r for r in attempts if r.status != "SUCCEEDED"]
        assert all(other_allowed(r) for r in others), (job_id, summary)
