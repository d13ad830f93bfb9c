"""CPU and wall time of one ``gpufleet`` CLI call: ``--help``, ``--version``, ``status``,
``list``, ``submit``, ``nodes``, ``why`` and ``why --suggest`` against a real ``gpufleet
server`` (SQLite, no agent: jobs stay PENDING).

Each call runs as a fresh process; its CPU time (user + system, from ``RUSAGE_CHILDREN``)
is what a user waits for on an idle machine; its wall time is what the user waits for on
this one (the server's answer included, and any wait for a core). Rounds are interleaved
(every command once per round, then the next round) so that load from other processes hits
all commands alike.
``--compare BIN`` adds another ``gpufleet`` executable (e.g. an older checkout's venv),
interleaved with this one, for before/after ratios. The target is < 150 ms of CPU.

Floors, in the same rounds: ``python -c pass`` (the interpreter with ``site``), ``python -S
-c pass`` (without it), and ``libraries`` (a bare ``import typer, rich.console, rich.table,
httpx``, httpx's CLI module left out as the CLI does: what a call costs before any gpufleet
code runs). The gpufleet package is byte-compiled first (as a wheel install is): with
``PYTHONDONTWRITEBYTECODE`` set, as in some containers, an editable install would otherwise
compile its modules in every call.

    python benchmarks/cli_start.py --rounds 15
    python benchmarks/cli_start.py --compare /path/to/old/.venv/bin/gpufleet
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


def timed_ms(argv: list[str], env: dict[str, str], check: bool = True) -> tuple[float, float]:
    """(user + system CPU, wall) of one run of ``argv``, in ms (exit status must be 0 if
    ``check``: an older ``--compare`` binary may lack ``--version``/``-q``/``--suggest``, and
    its usage error is timed as it is)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, check=False)
    wall = 1000 * (time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    cpu = 1000 * (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--compare", type=Path, help="Another gpufleet executable to time too.")
    args = ap.parse_args()
    this = Path(sys.executable).parent / "gpufleet"
    bins = {"this": this} | ({"compare": args.compare} if args.compare else {})
    compileall.compile_dir(Path(gpufleet.__file__).parent, quiet=1)

    with tempfile.TemporaryDirectory(prefix="gf-clistart-") as tmp:
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
            # httpx's own CLI module is kept out, as the CLI does (cli/main.py)
            libs = (
                "import sys; sys.modules['httpx._main'] = None; "
                "import typer, rich.console, rich.table, httpx"
            )
            commands = {
                "python -c pass": [sys.executable, "-c", "pass"],
                "python -S -c pass": [sys.executable, "-S", "-c", "pass"],
                "libraries": [sys.executable, "-c", libs],
                "--help": ["--help"],
                "--version": ["--version"],
                "status JOB": ["status", job],
                "list": ["list"],
                "submit -q -- true": ["submit", "-q", "--", "true"],
                "nodes": ["nodes"],
                "why JOB": ["why", job],
                "why JOB --suggest": ["why", job, "--suggest"],
            }
            times: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for r in range(args.rounds):
                console.print(f"round {r + 1}/{args.rounds}")
                for name, argv in commands.items():
                    for label, exe in bins.items():
                        floor = name.startswith("python") or name == "libraries"
                        if floor and label != "this":
                            continue
                        full = argv if floor else [str(exe), *argv]
                        times.setdefault((name, label), []).append(
                            timed_ms(full, client_env, check=label == "this")
                        )
        finally:
            stop_processes([server])

    table = Table(title="CPU per CLI call, ms (user+sys); target < 150")
    for col in ("command", "binary", "min", "median", "max", "median wall", "runs"):
        table.add_column(col, justify="left" if col in ("command", "binary") else "right")
    for (name, label), runs in times.items():
        xs = [cpu for cpu, _ in runs]
        table.add_row(
            name,
            label,
            f"{min(xs):.0f}",
            f"{statistics.median(xs):.0f}",
            f"{max(xs):.0f}",
            f"{statistics.median(w for _, w in runs):.0f}",
            str(len(xs)),
        )
    out = table_console(100)
    out.print(table)
    load = os.getloadavg()
    out.print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {machine()}")


if __name__ == "__main__":
    main()
