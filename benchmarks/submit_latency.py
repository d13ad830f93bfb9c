"""Submission latency of ``POST /v1/jobs`` with N jobs already queued, on SQLite and PostgreSQL.

For each database the script starts a fresh API server as a subprocess
(``gpufleet server --migrate``, which migrates the empty database at start), creates a team and an
admin token with
``gpufleet admin token create --team bench --admin --create-team --db`` (and lifts that team's
admission limits with ``admin team set`` over REST), and then, for each queue depth in
ascending order:

1. pre-fills the queue up to that depth over HTTP (8 concurrent clients by default). No controller
   runs, so every job stays PENDING;
2. times ``--samples`` sequential submits from one keep-alive client -> p50/p95/p99 and submits/s;
3. times ``--samples`` submits spread over ``--clients`` concurrent clients -> submits/s.

Both timed phases add jobs, so the queue holds between N and N + 2 * samples jobs while they run;
the table shows the depth at the start of each phase. Client and server share the machine, so
the numbers include client CPU; compare runs on the same machine only.

Usage (see benchmarks/README.md)::

    .venv/bin/python benchmarks/submit_latency.py --db both --queued 1000,10000 --samples 1000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from _common import (
    DEFAULT_POSTGRES_URL,
    child_env,
    console,
    free_port,
    fresh_postgres_database,
    int_list,
    machine,
    percentile,
    stop_processes,
    table_console,
    write_rows_json,
)
from rich.table import Table

BENCH_DATABASE = "gpufleet_bench"


@dataclass
class Row:
    """One measured (database, queue depth) point; latencies in ms, rates in submits/s."""

    db: str
    queued: int
    samples: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    sequential_per_s: float
    concurrent_per_s: float
    clients: int
    server_cpu_ms: float  # the server process's CPU per sequential submit
    errors: int


def job_body(i: int) -> dict[str, object]:
    """A realistic submit: a few resources, env and a priority that varies with i."""
    return {
        "name": f"bench-{i}",
        "command": ["python3", "examples/train_digits.py", "--steps", "300"],
        "gpu_count": 1 + i % 2,
        "priority": ("HIGH", "NORMAL", "NORMAL", "LOW")[i % 4],
        "max_retries": 1,
        "expected_duration_s": 60.0,
        "env": {"BENCH_INDEX": str(i)},
    }


class Submitter:
    """Submits numbered jobs from one keep-alive HTTP client; counts non-201 answers."""

    def __init__(self, base_url: str, token: str) -> None:
        self.client = httpx.Client(
            base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0
        )
        self.errors = 0
        self.last_error = ""

    def submit(self, i: int) -> float:
        """One POST /v1/jobs; returns its latency in seconds."""
        key = uuid.uuid4().hex
        started = time.perf_counter()
        resp = self.client.post("/v1/jobs", json=job_body(i), headers={"Idempotency-Key": key})
        elapsed = time.perf_counter() - started
        if resp.status_code != 201:
            self.errors += 1
            self.last_error = f"{resp.status_code} {resp.text[:300]}"
        return elapsed

    def close(self) -> None:
        self.client.close()


def run_concurrent(
    base_url: str, token: str, first: int, n: int, clients: int
) -> tuple[float, int]:
    """Submit jobs first..first+n-1 from ``clients`` threads; (wall seconds, errors)."""
    submitters = [Submitter(base_url, token) for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def work(k: int) -> None:
        start.wait()
        for i in range(first + k, first + n, clients):
            submitters[k].submit(i)

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(work, k) for k in range(clients)]
        start.wait()  # connections are set up lazily, as in the sequential phase
        began = time.perf_counter()
        for f in futures:
            f.result()
        wall = time.perf_counter() - began
    for s in submitters:
        s.close()
    errors = sum(s.errors for s in submitters)
    if errors:
        console.print(f"[red]{errors} failed submits; last: {submitters[0].last_error}")
    return wall, errors


class Server:
    """``gpufleet server`` on a free port, own data dir and database; a context manager."""

    def __init__(self, gpufleet: str, database_url: str, data_dir: Path, startup_s: float) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / "server.log"
        self.env = child_env(
            {"GPUFLEET_DATA_DIR": str(data_dir), "GPUFLEET_DATABASE_URL": database_url}
        )
        self.gpufleet, self.startup_s = gpufleet, startup_s
        self.proc: subprocess.Popen[bytes] | None = None

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system, all its threads); for the
        PostgreSQL backend's share see vs_slurm.py."""
        assert self.proc is not None
        raw = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = raw[raw.rfind(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> Server:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.gpufleet, "server", "--migrate", "--port", str(self.port)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"server exited with code {self.proc.returncode} during startup")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/healthz", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.2)
        self.fail(f"server not healthy after {self.startup_s:.0f} s")
        raise AssertionError("unreachable")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:  # its own session: a SIGKILL takes uvicorn workers too
            stop_processes([self.proc], group=True)

    def create_token(self) -> str:
        """``gpufleet admin token create --team bench``: the raw token is the last stdout line."""
        out = subprocess.run(
            # written to the database directly (no API token exists yet); an admin token of
            # team bench, so that it may also lift the team's limits over REST below
            [
                self.gpufleet,
                "admin",
                "token",
                "create",
                "--team",
                "bench",
                "--admin",
                "--create-team",
                "--db",
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if out.returncode != 0 or not lines:
            self.fail(f"token create failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
        # the server's submit path is measured here, not the per-team admission limits
        no_limits = ["--max-outstanding", "0", "--submit-rate", "0"]
        lift = subprocess.run(
            [self.gpufleet, "admin", "team", "set", "bench", *no_limits],
            env={**self.env, "GPUFLEET_URL": self.base_url, "GPUFLEET_TOKEN": lines[-1]},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if lift.returncode != 0:
            self.fail(f"team set failed ({lift.returncode}): {lift.stderr.strip()[-2000:]}")
        return lines[-1]

    def fail(self, message: str) -> None:
        tail = self.log_path.read_text(errors="replace").splitlines()[-40:]
        self.__exit__()
        sys.exit(f"{message}\n--- server log tail ({self.log_path}) ---\n" + "\n".join(tail))


def measure_database(db: str, database_url: str, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    with (
        tempfile.TemporaryDirectory(prefix=f"gpufleet-bench-{db}-") as tmp,
        Server(args.gpufleet, database_url, Path(tmp), args.startup_timeout) as server,
    ):
        token = server.create_token()
        probe = Submitter(server.base_url, token)
        probe.submit(0)
        probe.close()
        if probe.errors:
            server.fail(f"probe submit failed: {probe.last_error}")
        submitted = 1
        for depth in sorted(args.queued):
            if depth > submitted:
                console.print(f"{db}: pre-filling {depth - submitted} jobs to reach {depth} ...")
                began = time.perf_counter()
                run_concurrent(server.base_url, token, submitted, depth - submitted, args.clients)
                console.print(f"{db}: pre-filled in {time.perf_counter() - began:.1f} s")
                submitted = depth
            queued_at_start = submitted

            console.print(f"{db}: {args.samples} sequential submits at depth {submitted} ...")
            seq = Submitter(server.base_url, token)
            cpu0 = server.cpu_s()
            began = time.perf_counter()
            latencies = sorted(seq.submit(submitted + i) for i in range(args.samples))
            seq_wall = time.perf_counter() - began
            server_cpu_ms = 1000 * (server.cpu_s() - cpu0) / args.samples
            seq.close()
            if seq.errors:
                console.print(f"[red]{seq.errors} failed submits; last: {seq.last_error}")
            submitted += args.samples

            console.print(f"{db}: {args.samples} submits from {args.clients} clients ...")
            conc_wall, conc_errors = run_concurrent(
                server.base_url, token, submitted, args.samples, args.clients
            )
            submitted += args.samples
            rows.append(
                Row(
                    db=db,
                    queued=queued_at_start,
                    samples=args.samples,
                    p50_ms=1000 * percentile(latencies, 50),
                    p95_ms=1000 * percentile(latencies, 95),
                    p99_ms=1000 * percentile(latencies, 99),
                    max_ms=1000 * latencies[-1],
                    sequential_per_s=args.samples / seq_wall,
                    concurrent_per_s=args.samples / conc_wall,
                    clients=args.clients,
                    server_cpu_ms=server_cpu_ms,
                    errors=seq.errors + conc_errors,
                )
            )
    return rows


def render(rows: list[Row]) -> Table:
    table = Table(title="POST /v1/jobs submission latency (no controller; jobs stay PENDING)")
    for name in ("database", "queued", "p50 ms", "p95 ms", "p99 ms", "max ms", "seq submits/s"):
        table.add_column(name, justify="left" if name == "database" else "right")
    table.add_column(f"{rows[0].clients if rows else 8}-client submits/s", justify="right")
    table.add_column("server CPU ms/submit", justify="right")
    table.add_column("errors", justify="right")
    for r in rows:
        table.add_row(
            r.db,
            f"{r.queued:,}",
            f"{r.p50_ms:.2f}",
            f"{r.p95_ms:.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.max_ms:.1f}",
            f"{r.sequential_per_s:,.0f}",
            f"{r.concurrent_per_s:,.0f}",
            f"{r.server_cpu_ms:.2f}",
            str(r.errors),
        )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument(
        "--queued",
        type=int_list,
        default=[1000, 10000],
        help="comma-separated queue depths (default 1000,10000)",
    )
    p.add_argument("--samples", type=int, default=1000, help="timed submits per phase")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (prefill, rate)")
    p.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL, help="an existing database")
    p.add_argument(
        "--gpufleet",
        default=shutil.which("gpufleet", path=str(Path(sys.executable).parent))
        or shutil.which("gpufleet"),
        help="the gpufleet executable (default: next to this Python, else on PATH)",
    )
    p.add_argument("--startup-timeout", type=float, default=60.0, help="server start, seconds")
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    if not args.gpufleet:
        p.error("gpufleet executable not found; pip install -e . or pass --gpufleet")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[Row] = []
    if args.db in ("sqlite", "both"):
        with tempfile.TemporaryDirectory(prefix="gpufleet-bench-sqlite-db-") as tmp:
            rows += measure_database("sqlite", f"sqlite:///{tmp}/gpufleet.db", args)
    if args.db in ("postgres", "both"):
        with fresh_postgres_database(args.postgres_url, BENCH_DATABASE) as url:
            rows += measure_database("postgresql", url, args)
    table_console(120).print(render(rows))
    print(
        f"{args.samples} timed sequential submits per row (one keep-alive client) and "
        f"{args.samples} spread over {args.clients} clients; client and server on one machine "
        f"({machine(python_prefix='')})."
    )
    write_rows_json(args.json, rows)
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
