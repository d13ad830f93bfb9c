"""Wall and CPU time of the everyday ``gpufleet`` CLI calls against a real ``gpufleet server``
(SQLite in a temporary directory, no agent: jobs stay PENDING): ``--help``, ``status JOB``,
``list``, ``submit -q -- true``, ``why JOB`` and ``why JOB --suggest``.

Each call is a fresh process. CPU is user + system of the child (``RUSAGE_CHILDREN``), what
the call costs on an idle machine; wall is what the user waits for on this one (it includes
the server's answer and any wait for a core). Rounds are interleaved (each command once per
round), so load from other processes hits all commands alike; the table gives the median of
the rounds. ``--compare BIN`` times another ``gpufleet`` executable (an older checkout's venv)
in the same rounds for a before/after column. The project's target is <= 150 ms of CPU.
``benchmarks/cli_start.py`` adds min/max and the floors without the server's answer.

    python benchmarks/cli_speed.py --rounds 9
    python benchmarks/cli_speed.py --rounds 9 --compare /work/main/.venv/bin/gpufleet
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import child_env, console, free_port, machine, stop_processes, table_console
from rich.table import Table

import gpufleet
from gpufleet.processes import open_database
from gpufleet.services import auth
from gpufleet.settings import Settings


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall ms, CPU ms, exit status) of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, check=False)
    wall = 1000 * (time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = 1000 * (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--compare", type=Path, help="Another gpufleet executable (before).")
    args = ap.parse_args()
    this = Path(sys.executable).parent / "gpufleet"
    bins = {"after": this} | ({"before": args.compare} if args.compare else {})
    compileall.compile_dir(Path(gpufleet.__file__).parent, quiet=1)

    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    failed: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory(prefix="gf-clispeed-") as tmp:
        data = Path(tmp)
        db = open_database(Settings(data_dir=data))
        token = db.run_write(lambda s: auth.create_token(s, "bench", create_team_if_missing=True))
        db.dispose()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = child_env({"GPUFLEET_DATA_DIR": str(data), "GPUFLEET_SERVER_PORT": str(port)})
        server = subprocess.Popen(
            [str(this), "server"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        try:
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            client_env = child_env(
                {"GPUFLEET_URL": url, "GPUFLEET_TOKEN": token, "GPUFLEET_CONFIG": os.devnull}
            )
            job = subprocess.run(
                [str(this), "submit", "-q", "--", "true"],
                env=client_env,
                capture_output=True,
                check=True,
                text=True,
            ).stdout.strip()
            commands = {
                "python -c pass": None,
                "--help": ["--help"],
                "status JOB": ["status", job],
                "list": ["list"],
                "submit -q -- true": ["submit", "-q", "--", "true"],
                "why JOB": ["why", job],
                "why JOB --suggest": ["why", job, "--suggest"],
            }
            for r in range(args.rounds):
                console.print(f"round {r + 1}/{args.rounds}")
                for name, argv in commands.items():
                    for label, exe in bins.items():
                        if argv is None and label != "after":
                            continue
                        pass_ = [sys.executable, "-c", "pass"]
                        full = pass_ if argv is None else [str(exe), *argv]
                        wall, cpu, rc = timed(full, client_env)
                        if rc != 0:  # e.g. an older binary without --suggest
                            failed[(name, label)] = rc
                        times.setdefault((name, label), []).append((wall, cpu))
        finally:
            stop_processes([server])

    table = Table(title=f"CLI calls, median of {args.rounds} rounds, ms (target <= 150 CPU)")
    table.add_column("command")
    for label in bins:
        table.add_column(f"{label} CPU", justify="right")
        table.add_column(f"{label} wall", justify="right")
    for name in commands:
        row = [name]
        for label in bins:
            xs = times.get((name, label))
            if not xs:
                row += ["", ""]
                continue
            rc = failed.get((name, label))
            mark = f" (exit {rc})" if rc is not None else ""
            row.append(f"{statistics.median(c for _, c in xs):.0f}{mark}")
            row.append(f"{statistics.median(w for w, _ in xs):.0f}")
        table.add_row(*row)
    out = table_console(100)
    out.print(table)
    load = os.getloadavg()
    out.print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {machine()}")


if __name__ == "__main__":
    main()
