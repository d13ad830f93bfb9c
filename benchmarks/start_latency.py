"""Start latency on an idle fleet (DD9): submit -> RUNNING for host-process jobs, warm-image
container jobs and cold-image container jobs (pulled from the local registry), with the phase
breakdown.

The platform is the one of ``lifecycle.py``: controller and API server in this process on a
fresh database, ``--agents`` real agent subprocesses (8 declared GPUs each; podman through the
agent's container runtime). Jobs are submitted one at a time, each only once the previous one
was seen RUNNING, so capacity is always free. Per scenario:

* ``process``: ``{"command": ["true"]}``;
* ``container, warm``: ``{"image": busybox, "command": ["true"]}``, the image already on the
  node (pulled once before the timed jobs);
* ``container, cold (busybox 2 MB)`` / ``(python 318 MB)``: every job uses an image the node
  does not hold: a fresh tag pushed to the registry beforehand (busybox), or the python image
  removed from the node before each job, so the pull phase really transfers it.

Figures (ms): submit -> RUNNING from the job rows (database clock: ``started_at - created_at``,
the moment the controller accepted the agent's ConfirmAssignment), as the client saw it
(POST sent -> GET shows ``started_at``, polled every ``--poll-ms``, default 20 ms: the API
answers the polls in the controller's process, and a 5 ms poller's own requests delayed the
confirmation it waited for by ~10 ms on SQLite), and the breakdown: submit ->
reserved (``job_runs.created_at - jobs.created_at``: queue + scheduling pass + reservation) and
the node's phases from ``job_runs.start_phases`` (pull, create, start; for processes the
shim's spawn). Percentiles are nearest-rank.

For the ``process`` scenario it also prints the node's CPU per attempt: the agents' own CPU plus
that of the children they reaped (the shims and the jobs: ``utime + stime + cutime + cstime``
of ``/proc/<agent>/stat``) over the scenario, divided by the jobs. ``--shim-samples`` runs the
shim alone (the exact command line the agent builds, around ``true``) and prints its CPU per
attempt beside that of a bare ``true``, so the difference is the shim's own overhead.

Usage::

    scripts/ensure-services.sh            # podman, runc, registry on 127.0.0.1:5000, images
    .venv/bin/python benchmarks/start_latency.py --samples 30 --cold-samples 10
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    DEFAULT_POSTGRES_URL,
    console,
    fresh_postgres_database,
    machine,
    percentile,
    table_console,
    write_rows_json,
)
from lifecycle import Platform
from rich.table import Table
from sqlalchemy import select

from gpufleet.agent import shim
from gpufleet.agent.runtime.container import ContainerEngine
from gpufleet.store.tables import JobRow, JobRunRow

POLL_S = 0.02  # --poll-ms: how often the client asks whether the job started
REGISTRY = "127.0.0.1:5000"
BUSYBOX = f"{REGISTRY}/gpufleet/busybox:1"
PYTHON = f"{REGISTRY}/gpufleet/python:3.11"


@dataclass
class Row:
    db: str
    scenario: str
    jobs: int
    run_p50_ms: float
    run_p95_ms: float
    run_p99_ms: float
    client_p50_ms: float
    client_p95_ms: float
    reserve_p50_ms: float
    pull_p50_ms: float
    create_p50_ms: float
    start_p50_ms: float
    warm: int
    cold: int
    errors: int
    node_cpu_ms_per_job: float = float("nan")


def _p(values: list[float], q: float) -> float:
    return percentile(sorted(values), q)


def run_scenario(
    db_name: str,
    plat: Platform,
    scenario: str,
    n: int,
    body: Callable[[int], dict[str, Any]],
    before_each: Callable[[int], None] = lambda _i: None,
) -> Row:
    console.print(f"{db_name}: {scenario}: {n} jobs ...")
    cpu0 = agents_cpu_s(plat)
    job_ids: list[str] = []
    client_ms: list[float] = []
    errors = 0
    with plat.http() as c:
        for i in range(n):
            before_each(i)
            t0 = time.perf_counter()
            r = c.post(
                "/v1/jobs",
                json={"gpu_count": 1, **body(i)},
                headers={"Idempotency-Key": str(uuid.uuid4())},
            )
            if r.status_code != 201:
                errors += 1
                console.print(f"submit failed: {r.status_code} {r.text[:200]}")
                continue
            job_id = str(r.json()["job_id"])
            job_ids.append(job_id)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                got = c.get(f"/v1/jobs/{job_id}").json()
                if got.get("started_at"):
                    client_ms.append(1000 * (time.perf_counter() - t0))
                    break
                if got.get("status") in ("FAILED", "CANCELLED"):
                    errors += 1
                    console.print(f"{job_id}: {got.get('status')} {got.get('attempts')}")
                    break
                time.sleep(POLL_S)
            else:
                errors += 1
    plat.wait_terminal(job_ids, 120)
    time.sleep(0.5)  # the last attempts' teardown on the node
    node_cpu = (agents_cpu_s(plat) - cpu0) * 1000 / max(1, len(job_ids))
    with plat.db.read() as s:
        rows = s.execute(
            select(
                JobRow.created_at,
                JobRow.started_at,
                JobRunRow.created_at.label("reserved_at"),
                JobRunRow.start_phases,
            )
            .join(JobRunRow, JobRunRow.job_id == JobRow.id)
            .where(JobRow.id.in_(job_ids), JobRunRow.attempt == 1)
        ).all()
    run_ms = [(r.started_at - r.created_at).total_seconds() * 1000 for r in rows if r.started_at]
    reserve_ms = [(r.reserved_at - r.created_at).total_seconds() * 1000 for r in rows]
    phases = [r.start_phases or {} for r in rows]

    def phase(k: str) -> float:
        return _p([1000 * float(p[k]) for p in phases if k in p], 50)

    return Row(
        db=db_name,
        scenario=scenario,
        jobs=len(job_ids),
        run_p50_ms=_p(run_ms, 50),
        run_p95_ms=_p(run_ms, 95),
        run_p99_ms=_p(run_ms, 99),
        client_p50_ms=_p(client_ms, 50),
        client_p95_ms=_p(client_ms, 95),
        reserve_p50_ms=_p(reserve_ms, 50),
        pull_p50_ms=phase("pull_s"),
        create_p50_ms=phase("create_s"),
        start_p50_ms=phase("start_s"),
        warm=sum(1 for p in phases if p.get("image") == "warm"),
        cold=sum(1 for p in phases if p.get("image") == "cold"),
        errors=errors,
        node_cpu_ms_per_job=node_cpu,
    )


def agents_cpu_s(plat: Platform) -> float:
    """CPU seconds of the agent processes and of the children they reaped (shims, jobs)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for proc in plat.agents.values():
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{proc.pid}/stat").read_text()
            fields = raw[raw.rfind(")") + 2 :].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / tick


def shim_cpu(n: int, tmp: Path) -> tuple[float, float]:
    """CPU ms per run of the agent's shim command line around ``true``, and of ``true``
    alone (both wait for the child, as the agent does)."""
    true = shutil.which("true") or "/bin/true"
    out = []
    for with_shim in (True, False):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        for i in range(n):
            d = tmp / f"shim-{int(with_shim)}-{i}"
            d.mkdir(parents=True)
            argv = (
                shim.argv(
                    exit_file=d / "exit.json",
                    log_file=d / "output.log",
                    claim_file=d / "shim.json",
                    status_fd=1,
                    cwd=d,
                    command=[true],
                )
                if with_shim
                else [true]
            )
            subprocess.run(argv, stdout=subprocess.PIPE, start_new_session=True, check=True)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        out.append(1000 * used / n)
    return out[0], out[1]


def fresh_tags(engine: ContainerEngine, base: str, n: int) -> list[str]:
    """``n`` new tags of ``base`` in the registry, none of them on this node."""
    engine.ensure_present(base)
    tags = []
    for _ in range(n):
        tag = f"{base.rsplit(':', 1)[0]}:bench-{uuid.uuid4().hex[:10]}"
        for args in (["tag", base, tag], ["push", "--tls-verify=false", tag], ["rmi", tag]):
            subprocess.run([*engine.argv0, *args], env=engine.env, check=True, capture_output=True)
        tags.append(tag)
    return tags


def bench(db_name: str, url: str, args: argparse.Namespace, tmp: Path) -> list[Row]:
    engine = None
    if not args.skip_containers:
        engine = ContainerEngine("podman", state_dir=tmp / "engine-bench")
    plat = Platform(tmp, url)
    rows: list[Row] = []
    tags: list[str] = []
    try:
        plat.start(args.agents)
        time.sleep(1)
        rows.append(
            run_scenario(db_name, plat, "process", args.samples, lambda _i: {"command": ["true"]})
        )
        if engine is None:
            return rows
        engine.ensure_present(BUSYBOX)
        rows.append(
            run_scenario(
                db_name,
                plat,
                "container, warm",
                args.samples,
                lambda _i: {"image": BUSYBOX, "command": ["true"]},
            )
        )
        tags = fresh_tags(engine, BUSYBOX, args.cold_samples)
        rows.append(
            run_scenario(
                db_name,
                plat,
                "container, cold (busybox 2 MB)",
                args.cold_samples,
                lambda i: {"image": tags[i], "command": ["true"]},
            )
        )
        if not args.skip_python:
            engine.ensure_present(PYTHON)
            rows.append(
                run_scenario(
                    db_name,
                    plat,
                    "container, cold (python 318 MB)",
                    args.cold_samples,
                    lambda _i: {"image": PYTHON, "command": ["true"]},
                    before_each=lambda _i: engine.remove_image(PYTHON),
                )
            )
            engine.ensure_present(PYTHON)
    finally:
        plat.close()
        if engine is not None:
            cleanup(engine, tags, tmp)
    return rows


def cleanup(engine: ContainerEngine, tags: list[str], tmp: Path) -> None:
    """Remove the benchmark's image tags and any container left by its attempts."""
    for tag in tags:
        engine.remove_image(tag)
    with contextlib.suppress(Exception):
        names = [p.name for p in tmp.glob("agents/*/runs/*")]
        if names:
            subprocess.run(
                [*engine.argv0, "rm", "--force", "--ignore", *names],
                env=engine.env,
                capture_output=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="sqlite")
    ap.add_argument("--samples", type=int, default=30, help="jobs per process/warm scenario")
    ap.add_argument("--cold-samples", type=int, default=10, help="jobs per cold scenario")
    ap.add_argument("--agents", type=int, default=1)
    ap.add_argument("--skip-python", action="store_true", help="no 318 MB cold scenario")
    ap.add_argument("--skip-containers", action="store_true", help="the process scenario only")
    ap.add_argument("--shim-samples", type=int, default=200, help="0: no shim-alone runs")
    ap.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--poll-ms",
        type=float,
        default=20.0,
        help="client poll period; the API serves the polls in the controller's process",
    )
    args = ap.parse_args()
    global POLL_S
    POLL_S = args.poll_ms / 1000
    rows: list[Row] = []
    for db_name in ("sqlite", "postgres") if args.db == "both" else (args.db,):
        with tempfile.TemporaryDirectory(prefix="gpufleet-start-") as d:
            tmp = Path(d)
            if db_name == "sqlite":
                rows += bench(db_name, f"sqlite:///{tmp / 'bench.db'}", args, tmp)
            else:
                with fresh_postgres_database(args.postgres_url, "gpufleet_bench_start") as url:
                    rows += bench(db_name, url, args, tmp)
    table = Table(title="submit -> RUNNING on an idle fleet (ms; phases p50)")
    for col in (
        "db",
        "scenario",
        "jobs",
        "p50",
        "p95",
        "p99",
        "client p50",
        "client p95",
        "reserve",
        "pull",
        "create",
        "start",
        "warm/cold",
        "node CPU/job",
        "errors",
    ):
        table.add_column(col, justify="left" if col in ("db", "scenario") else "right")
    for r in rows:
        table.add_row(
            r.db,
            r.scenario,
            str(r.jobs),
            f"{r.run_p50_ms:.0f}",
            f"{r.run_p95_ms:.0f}",
            f"{r.run_p99_ms:.0f}",
            f"{r.client_p50_ms:.0f}",
            f"{r.client_p95_ms:.0f}",
            f"{r.reserve_p50_ms:.0f}",
            f"{r.pull_p50_ms:.0f}",
            f"{r.create_p50_ms:.0f}",
            f"{r.start_p50_ms:.1f}",
            f"{r.warm}/{r.cold}",
            "" if math.isnan(r.node_cpu_ms_per_job) else f"{r.node_cpu_ms_per_job:.1f}",
            str(r.errors),
        )
    table_console(160).print(table)
    if args.shim_samples:
        with tempfile.TemporaryDirectory(prefix="gpufleet-shim-") as d:
            with_shim, bare = shim_cpu(args.shim_samples, Path(d))
        console.print(
            f"shim alone, {args.shim_samples} runs: {with_shim:.2f} ms CPU per attempt around "
            f"`true` ({bare:.2f} ms for `true` alone): shim overhead {with_shim - bare:.2f} ms"
        )
    console.print(machine())
    write_rows_json(args.json, rows)
    sys.exit(1 if any(r.errors for r in rows) else 0)


if __name__ == "__main__":
    main()
