"""Bring a multi-host fleet (tests/multihost/fleet.py) up and down by hand.

    python -m tests.multihost up [--dir DIR] [--agents N]   foreground; Ctrl-C / SIGTERM ends it
    python -m tests.multihost status|down [--dir DIR]
    python -m tests.multihost exec HOST [--dir DIR] -- CMD...   e.g. exec client -- gpufleet nodes
    python -m tests.multihost cut|restore HOST [--dir DIR]

``up`` writes ``DIR/state.json`` (namespaces, addresses, tokens, pids; mode 0600) and keeps
running until stopped; ``down`` signals it and waits. ``exec`` runs a command in a host's
namespace with the CLI pointed at the fleet (GPUFLEET_URL, GPUFLEET_TOKEN: the admin token).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

DEFAULT_DIR = Path(tempfile.gettempdir()) / "gpufleet-multihost"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/multihost.sh")
    p.add_argument("action", choices=["up", "down", "status", "exec", "cut", "restore"])
    p.add_argument("host", nargs="?")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--agents", type=int, default=3)
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else []  # exec's command, as given
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    state_path = args.dir / "state.json"
    if args.action == "up":
        return _up(args.dir, args.agents)
    if not state_path.exists():
        print(f"no fleet in {args.dir} (scripts/multihost.sh up)", file=sys.stderr)
        return 1
    state = json.loads(state_path.read_text())
    if args.action == "status":
        print(json.dumps(state, indent=2))
        return 0
    if args.action == "down":
        pid = state["keeper_pid"]
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            from tests.multihost.netns import clean_leftovers

            print("the fleet's process is gone; removing its namespaces", file=sys.stderr)
            clean_leftovers()
            return 0
        while _alive(pid):
            time.sleep(0.2)
        return 0
    host = state["hosts"].get(args.host or "")
    if host is None:
        print(f"no host {args.host!r}; hosts: {', '.join(state['hosts'])}", file=sys.stderr)
        return 2
    if args.action in ("cut", "restore"):
        verb = "down" if args.action == "cut" else "up"
        return subprocess.call(["ip", "-n", host["netns"], "link", "set", "eth0", verb])
    cmd = cmd or ["bash"]
    if cmd[0] == "gpufleet":
        cmd = [sys.executable, "-m", "gpufleet.cli.main", *cmd[1:]]
    env = dict(os.environ, GPUFLEET_URL=state["url"], GPUFLEET_TOKEN=state["admin_token"])
    return subprocess.call(["ip", "netns", "exec", host["netns"], *cmd], env=env)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _up(workdir: Path, agents: int) -> int:
    from tests.multihost.fleet import MultiHostFleet

    if (workdir / "state.json").exists():
        old = json.loads((workdir / "state.json").read_text())
        if _alive(old.get("keeper_pid", 0)):
            print(
                f"a fleet is already up in {workdir} (scripts/multihost.sh down)", file=sys.stderr
            )
            return 1
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = MultiHostFleet(workdir / f"run-{os.getpid()}", agents=agents)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        print("starting (about a minute)...", flush=True)
        fleet.start()
        state = fleet.state() | {"keeper_pid": os.getpid()}
        (workdir / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        (workdir / "state.json").chmod(0o600)
        print(f"API {fleet.url} (from a host: scripts/multihost.sh exec client -- gpufleet nodes)")
        print(f"admin token {fleet.admin_token}")
        print(f"team '{fleet.team}' token {fleet.team_token}")
        for name, host in fleet.net.hosts.items():
            print(f"  {name:8} {host.address:12} netns {host.netns}")
        print(f"logs in {fleet.logs}; Ctrl-C or `scripts/multihost.sh down` stops it", flush=True)
        done.wait()
    finally:
        print("stopping...", flush=True)
        fleet.stop()
        (workdir / "state.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
