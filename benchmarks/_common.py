"""Helpers shared by the benchmark scripts (``submit_latency``, ``reserve_rate``, ``lifecycle``).

The scripts run as ``python benchmarks/X.py``; Python puts ``benchmarks/`` on ``sys.path``, so
they import this module as ``_common``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
console = Console(stderr=True)  # progress on stderr, the table on stdout


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100); NaN when it is empty."""
    if not sorted_values:
        return float("nan")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def int_list(s: str) -> list[int]:
    """Parse a comma-separated list of integers (an argparse ``type``)."""
    return [int(x) for x in s.split(",") if x]


@contextlib.contextmanager
def fresh_postgres_database(admin_url: str, name: str) -> Iterator[str]:
    """Create an empty database ``name`` next to ``admin_url``'s; drop it afterwards.

    Yields the SQLAlchemy URL of the new database.
    """
    import psycopg  # only the PostgreSQL runs need it
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)
    conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
    drop = f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(drop)


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any ``GPUFLEET_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    return env | dict(extra)


def stop_processes(
    procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 15, group: bool = False
) -> None:
    """SIGTERM every live process, then wait up to ``timeout_s`` each; SIGKILL the stragglers
    (their whole process group when ``group``: they were started with ``start_new_session``)."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()


def machine(python_prefix: str = "Python ") -> str:
    """``Python 3.x.y, N CPUs``: the machine line every script ends its note with."""
    return f"{python_prefix}{platform.python_version()}, {os.cpu_count()} CPUs"


def table_console(width: int) -> Console:
    """The stdout console for the result table; ``width`` columns when not a terminal, so a
    piped or redirected table is not squeezed into 80 columns."""
    out = Console()
    return out if out.is_terminal else Console(width=width)


def write_rows_json(path: Path | None, rows: Sequence[Any]) -> None:
    """Write the dataclass ``rows`` to ``path`` as a JSON list (nothing when ``path`` is None)."""
    if path:
        path.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")


def wait_healthy(db: Any, n: int, console: Any, log_hint: str, stuck_s: float = 30.0) -> int:
    """Wait until ``n`` nodes are HEALTHY, or until none more became so for ``stuck_s``
    (a node that cannot join: the run goes on with those that did, and says so); returns
    how many are HEALTHY."""
    from sqlalchemy import func, select

    from gpufleet.store.tables import NodeRow

    def healthy() -> int:
        with db.read() as s:
            return int(
                s.execute(
                    select(func.count()).select_from(NodeRow).where(NodeRow.status == "HEALTHY")
                ).scalar_one()
            )

    seen, since = 0, time.monotonic()
    while (up := healthy()) < n:
        if up > seen:
            seen, since = up, time.monotonic()
        elif time.monotonic() - since > stuck_s:
            console.print(f"only {up} of {n} nodes HEALTHY; see {log_hint}")
            break
        time.sleep(0.5)
    return healthy()
