"""The per-attempt supervisor, in the role of containerd-shim.

Usage::

    python -m gpufleet.agent.shim --exit-file F --log-file L \\
        [--claim-file C] [--env-file E] [--status-fd N] [--cwd D] \\
        [--cgroup-procs P]... [--uid U --gid G [--groups G1,G2]] -- cmd [args...]

The agent starts the shim with ``start_new_session=True``, so the shim leads a new session and
process group (pgid == shim pid) that outlives an agent crash (``kill -9``). The shim:

1. catches SIGTERM, SIGINT and SIGHUP with a no-op handler, so it survives the stop signal that
   ``killpg(pgid, SIGTERM)`` delivers to the whole group (a *caught* signal is reset to its
   default at ``exec``, so the user command still receives it; an *ignored* one would stay
   ignored, which is why this is not ``SIG_IGN``);
2. claims the start (``--claim-file``): it writes its pid, pgid, start time and boot id to a
   temporary file and hard-links it to the claim path, which fails if the file exists. A
   restarted agent that finds an attempt logged as assigned but not started claims the same
   path to abandon it; whichever link lands first wins, so the command is never started behind
   the back of an agent that reported it as never started;
3. starts the command in its own process group, stdin from /dev/null, stdout and stderr
   appended to the log file, environment from ``--env-file`` (JSON object; deleted once read)
   or inherited. In the child, between fork and exec (so before the command can fork), it
   joins the attempt's cgroup(s) by writing its pid to each ``--cgroup-procs`` file, then drops
   privileges (``setgroups``, ``setgid``, ``setuid`` to ``--groups``/``--gid``/``--uid``) and
   only then enters ``--cwd``, so the kernel checks the job user's access to it. The shim
   itself stays outside the cgroup (its memory is not charged to the job, and the OOM killer
   cannot pick it) and keeps the agent's user (it reads the agent's files);
4. writes one JSON line to ``--status-fd``: ``{"pid": N}`` or ``{"error": "..."}``;
5. waits, then writes ``{"exit_code": N, "finished_at_s": T}`` atomically (temporary file,
   fsync, rename) to the exit file. ``exit_code`` is negative when a signal killed the command.
   A start failure writes ``{"exit_code": 127, "start_error": "..."}``.

A restarted agent that did not spawn the shim learns the exit code from the exit file. When the
group is SIGKILLed the shim dies too and writes nothing; the agent knows it sent SIGKILL.

Only the standard library, :mod:`~gpufleet.agent.fsutil` and :mod:`~gpufleet.agent.procfs`
are imported: this runs once per attempt and its start-up time is on the submit-to-running path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpufleet.agent.fsutil import create_exclusive, write_json_atomic
from gpufleet.agent.procfs import boot_id, start_ticks

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

START_FAILED_EXIT_CODE = 127


def _noop(signum: int, frame: object) -> None:
    """Survive the group's stop signal; the child receives its own copy."""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpufleet.agent.shim")
    parser.add_argument("--exit-file", required=True, type=Path)
    parser.add_argument("--log-file", required=True, type=Path)
    parser.add_argument("--claim-file", type=Path)
    parser.add_argument("--env-file", type=Path)
    parser.add_argument("--status-fd", type=int)
    parser.add_argument("--cwd", type=Path)
    parser.add_argument("--cgroup-procs", type=Path, action="append", default=[])
    parser.add_argument("--uid", type=int)
    parser.add_argument("--gid", type=int)
    parser.add_argument("--groups", default="")
    # the command switches users itself (unshare --setuid): enter --cwd with these effective
    # ids so the kernel still checks the job user's access to it, then exec as root
    parser.add_argument("--cwd-as", default="", help="UID:GID")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.command and ns.command[0] == "--":
        ns.command = ns.command[1:]
    return ns


def _send_status(fd: int | None, data: dict[str, Any]) -> None:
    if fd is None:
        return
    with contextlib.suppress(OSError):  # the agent died: the exit file is the record
        os.write(fd, (json.dumps(data) + "\n").encode())
    with contextlib.suppress(OSError):
        os.close(fd)


def _preexec(ns: argparse.Namespace, err_fd: int) -> Callable[[], None]:
    """The child's set-up between fork and exec (see module doc). A failure is written to
    ``err_fd`` as one line and raised, so the start fails with that message."""
    groups = [int(g) for g in ns.groups.split(",") if g]

    def run() -> None:
        step = "join the cgroup"
        try:
            for procs in ns.cgroup_procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            if ns.uid is not None:
                step = f"switch to uid {ns.uid}"
                os.setgroups(groups)
                os.setresgid(ns.gid, ns.gid, ns.gid)
                os.setresuid(ns.uid, ns.uid, ns.uid)
            if ns.cwd is not None and ns.cwd_as:
                uid, gid = (int(x) for x in ns.cwd_as.split(":"))
                step = f"enter working_dir {str(ns.cwd)!r} as the job user (uid {uid})"
                os.setgroups([])
                os.setresgid(-1, gid, -1)
                os.setresuid(-1, uid, -1)
                try:
                    os.chdir(ns.cwd)
                finally:
                    os.setresuid(-1, 0, -1)
                    os.setresgid(-1, 0, -1)
            elif ns.cwd is not None:
                who = f"the job user (uid {os.getuid()})"
                step = f"enter working_dir {str(ns.cwd)!r} as {who}"
                os.chdir(ns.cwd)
        except OSError as exc:
            os.write(err_fd, f"cannot {step}: {exc.strerror or exc}".encode())
            raise

    return run


def main(argv: list[str] | None = None) -> int:
    """Run the shim; returns its own exit status (0, or 2 for bad arguments)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _noop)
    ns = _parse(sys.argv[1:] if argv is None else argv)
    if ns.claim_file is not None:
        pid = os.getpid()
        me = {
            "pid": pid,
            "pgid": os.getpgid(0),
            "start_ticks": start_ticks(pid),
            "boot_id": boot_id(),
        }
        if not create_exclusive(ns.claim_file, me):
            _send_status(ns.status_fd, {"error": "start abandoned by the agent"})
            return 0
    env: dict[str, str] | None = None
    if ns.env_file is not None:
        env = json.loads(ns.env_file.read_text())
        ns.env_file.unlink()
    err_r, err_w = os.pipe()
    with open(ns.log_file, "ab", buffering=0) as log:
        try:
            if not ns.command:
                raise ValueError("empty command")
            child = subprocess.Popen(
                ns.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_preexec(ns, err_w),  # safe: the shim has one thread
                close_fds=True,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            os.close(err_w)
            detail = os.read(err_r, 4096).decode(errors="replace")
            os.close(err_r)
            message = detail or f"cannot start {ns.command[:1]}: {exc}"
            log.write(f"gpufleet: {message}\n".encode())
            write_json_atomic(
                ns.exit_file,
                {
                    "exit_code": START_FAILED_EXIT_CODE,
                    "start_error": message,
                    "finished_at_s": time.time(),
                },
            )
            _send_status(ns.status_fd, {"error": message})
            return 0
    os.close(err_w)
    os.close(err_r)
    _send_status(ns.status_fd, {"pid": child.pid})
    exit_code = child.wait()  # retried on EINTR (PEP 475) when the no-op handler runs
    try:
        write_json_atomic(ns.exit_file, {"exit_code": exit_code, "finished_at_s": time.time()})
    except OSError:
        # e.g. the disk is full: the agent (our parent) reads the code from our own exit
        # status instead; the missing exit file tells it to (see Runner._exit_info)
        return exit_code if exit_code >= 0 else 128 - exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
