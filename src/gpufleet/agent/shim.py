"""The per-attempt supervisor, in the role of containerd-shim: a POSIX ``sh`` script.

:data:`SHIM_SH` (``shim.sh`` beside this module) runs once per attempt, so it is plain
``/bin/sh`` with builtins only on the common path: no interpreter start-up and no imports
(the Python shim it replaced cost ~9 ms of CPU for a bare interpreter and ~50-80 ms with its
imports on this 2-CPU machine; the script costs about one ``sh`` start, ~1 ms). Build its
command line with :func:`argv`::

    /bin/sh shim.sh --exit-file F --log-file L [--claim-file C] [--status-fd N] [--cwd D]
        [--cwd-check] [--cgroup-procs P]... [--setpriv PATH --uid U --gid G [--groups G1,G2]]
        [--cwd-as U:G] [--mount-bin M [--private-tmp D] [--hide-pids]]
        [--restore-env NAME,NAME] [--script-stdin] -- cmd [args...]

The agent runs it under ``setpriv --no-new-privs`` and, for jobs as job users, in a mount
namespace of its own (``unshare --mount --ipc``; :mod:`gpufleet.agent.runtime.jobns`): with
``--mount-bin`` the child makes the job's mounts (private /tmp, /var/tmp, /dev/shm, hidepid
/proc) right after the cgroup join, before any user switch.

The agent starts it with ``start_new_session=True`` and the command's complete environment
(the shell's own variables are unexported and prefixed ``_gf_``; no environment file is
written to disk). The shim leads a new session and process group (pgid == shim pid) that
outlives an agent crash (``kill -9``). It:

1. traps SIGTERM, SIGINT and SIGHUP, so it survives the stop signal that
   ``killpg(pgid, SIGTERM)`` delivers to the whole group (a *trapped* signal is reset to its
   default in the command; an *ignored* one would stay ignored). The command runs as a
   foreground child, because ``sh`` starts asynchronous children with SIGINT and SIGQUIT
   ignored;
2. claims the start (``--claim-file``): it creates the claim with ``O_EXCL`` (``set -C``)
   holding its pid, pgid, start time (``/proc/$$/stat`` field 22) and boot id. A restarted
   agent that finds an attempt logged as assigned but not started creates the same path to
   abandon it; exactly one create succeeds, so the command is never started behind the back
   of an agent that reported it as never started. The claim is written by one ``write`` right
   after the create; a reader that finds it empty waits for it
   (:func:`gpufleet.agent.runtime.process._read_claim`);
3. creates the exit file empty, then forks the child, which (between fork and exec, so before
   the command can fork) joins the attempt's cgroup(s) by writing ``0`` (itself) to each
   ``--cgroup-procs`` file, enters ``--cwd`` and execs the command with stdin from /dev/null
   and stdout and stderr appended to the log file. When the agent is root and switches users,
   the last exec is ``setpriv --reuid --regid --groups|--clear-groups``; with ``--cwd-check``
   (a ``working_dir`` the job chose) the directory is entered only after the switch (a second
   ``sh`` stage), so the kernel checks the job user's access. ``--cwd-as`` is for a command
   prefix that switches users itself (``unshare --setuid``): the directory is checked as the
   job user, then entered as the agent's user. A second stage is this same script read from
   its stdin (``sh -s``, :func:`stage2_argv`), not from its path: the child opens the script
   on fd 6 while it is still the agent's user, so the job user needs no access to the
   installed package (a venv under ``/root``, any 0700 parent, a path under the node's
   ``/tmp``, which the private ``/tmp`` hides); the second stage gives the command
   ``/dev/null`` as its stdin, as the first does. The shim itself stays outside the cgroup (its
   memory is not charged to the job, and the OOM killer cannot pick it) and keeps the agent's
   user (it writes the agent's files);
4. the child writes one JSON line to ``--status-fd`` just before its exec (so ``pid`` is the
   command's pid): ``{"pid": N}``, or ``{"error": "..."}`` when the command cannot start (not
   found or not executable, a cgroup it cannot join, a working directory it cannot enter);
   then it also writes ``{"exit_code": 127, "start_error": "..."}`` into the exit file;
5. once the child has ended writes ``{"exit_code": N}`` to the exit file (unless the child
   filled it with a start error). POSIX ``sh`` cannot tell ``exit 137`` from SIGKILL, so a
   status ``128 + N`` is read as death by signal ``N`` (recorded as ``-N``) only for the
   signals a job realistically dies of (:data:`DEATH_SIGNALS`); any other status, ``exit 200``
   or ``exit 255`` included, is the command's own exit code. The finish time is the file's
   mtime.

**Durability.** Neither the claim nor the exit file is fsynced. Both are read only by an agent
restarted on the *same boot* (page cache survives a process crash); after a reboot nothing of
the attempt runs, the handle's boot id differs, and the attempt is reported as lost however
the files look. The exit file is read only after the shim has exited, so it is never seen
half-written. If it cannot be written (disk full) the shim exits with the command's status
and the agent, its parent, reads that instead (see ``ProcessRuntime._exit_info``).

When the group is SIGKILLed the shim dies too and writes nothing; the agent knows it sent
SIGKILL.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

SHIM_SH = Path(__file__).with_name("shim.sh")
"""The script (package data)."""
SH = "/bin/sh"
START_FAILED_EXIT_CODE = 127
DEATH_SIGNALS: frozenset[int] = frozenset(
    int(signal.Signals[name])
    for name in [
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGXCPU",
        "SIGXFSZ",
    ]
)
"""Signals whose ``128 + N`` status is read as a death by signal (shim.sh has the same list)."""


def exit_code_from_status(status: int) -> int:
    """A shell status (0..255) as an attempt's exit code: ``-N`` when it is ``128 + N`` for
    N in :data:`DEATH_SIGNALS` (killed by signal N), else the status itself."""
    return -(status - 128) if status > 128 and status - 128 in DEATH_SIGNALS else status


SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
"""util-linux ``setpriv``: switches user and groups when the agent is root."""


def argv(
    *,
    exit_file: Path,
    log_file: Path,
    command: list[str] | tuple[str, ...],
    claim_file: Path | None = None,
    status_fd: int | None = None,
    cwd: Path | None = None,
    cwd_check: bool = False,
    cgroup_procs: tuple[Path, ...] | list[Path] = (),
    uid: int | None = None,
    gid: int | None = None,
    groups: tuple[int, ...] = (),
    cwd_as: tuple[int, int] | None = None,
    keep_pwd: bool = False,
    mount_bin: str = "",
    private_tmp: str = "",
    hide_pids: bool = False,
    hide_dirs: tuple[str, ...] = (),
    keep_file: str = "",
    restore_env: tuple[str, ...] = (),
    shm_mb: int = 0,
    script_stdin: bool = False,
) -> list[str]:
    """The shim's command line (see the module doc for each option).

    Args:
        status_fd: 1-9 (``sh`` redirections take one digit); 1 = the shim's stdout, which is
            how the agent passes its pipe.
        uid, gid, groups: switch to this user (the agent must be root) with ``setpriv``.
        cwd_check: enter ``cwd`` only as the job user (a working directory the job chose).
        cwd_as: (uid, gid) to check ``cwd`` as, when the command prefix switches users.
        keep_pwd: the command's environment has ``PWD``/``OLDPWD`` (else the shim removes
            the ones ``sh`` exports).
        mount_bin: absolute path of ``mount``: the shim runs in a mount namespace of its own
            (``jobns``) and its child, after the cgroup join, mounts a fresh tmpfs on
            ``/dev/shm``, and with ``private_tmp`` binds that directory on ``/tmp`` and
            ``/var/tmp``, and with ``hide_pids`` a ``proc`` with ``hidepid=invisible`` on
            ``/proc``, and an empty tmpfs on each of ``hide_dirs`` (the node's socket
            directories, ``jobns.HIDDEN_DIRS``) with ``keep_file`` (absolute path inside one
            of them, e.g. resolv.conf's target) bound back where it was. A failed mount is a
            start error.
        shm_mb: with ``mount_bin``, the size of the private ``/dev/shm`` tmpfs, MiB (0: the
            kernel's default, half the node's RAM).
        restore_env: names of the job's loader variables (``LD_PRELOAD``...) that the
            agent passed as ``_GF_ENV_<name>`` (``jobns.hide_loader_env``): the shim sets
            them back only in the command's own process after the switch to the job user
            (a second ``sh`` stage when switching), so no program running as root sees them.
        script_stdin: ``command`` ends in a second stage of this shim (:func:`stage2_argv`,
            after a prefix that switches users, ``unshare --setuid``): the command starts
            with the script on its stdin (fd 6, opened as the agent's user) instead of
            ``/dev/null``; the second stage gives the job's command ``/dev/null``.
    """
    if status_fd is not None and not 1 <= status_fd <= 9:
        raise ValueError(f"status_fd must be 1-9, not {status_fd}")
    out = [SH, str(SHIM_SH), "--exit-file", str(exit_file), "--log-file", str(log_file)]
    if claim_file is not None:
        out += ["--claim-file", str(claim_file)]
    if status_fd is not None:
        out += ["--status-fd", str(status_fd)]
    if cwd is not None:
        out += ["--cwd", str(cwd)]
        if cwd_check:
            out.append("--cwd-check")
    if keep_pwd:
        out.append("--keep-pwd")
    for procs in cgroup_procs:
        out += ["--cgroup-procs", str(procs)]
    if uid is not None:
        out += ["--setpriv", SETPRIV, "--uid", str(uid)]
        out += ["--gid", str(gid if gid is not None else uid)]
        if groups:
            out += ["--groups", ",".join(str(g) for g in groups)]
    if cwd_as is not None:
        out += ["--setpriv", SETPRIV, "--cwd-as", f"{cwd_as[0]}:{cwd_as[1]}"]
    if restore_env:
        out += ["--restore-env", ",".join(restore_env)]
    if script_stdin:
        out.append("--script-stdin")
    if mount_bin:
        out += ["--mount-bin", mount_bin]
        if private_tmp:
            out += ["--private-tmp", private_tmp]
        if hide_pids:
            out.append("--hide-pids")
        for hidden in hide_dirs:
            out += ["--hide-dir", hidden]
        if keep_file:
            out += ["--keep-file", keep_file]
        if shm_mb > 0:
            out += ["--shm-size", str(int(shm_mb))]
    return [*out, "--", *command]


def stage2_argv(*, restore_env: tuple[str, ...] | list[str]) -> list[str]:
    """The argv that runs a second stage of the shim, to put between a prefix that switches
    users itself (``unshare ... --setuid U --``) and the job's command: ``sh -s -- --stage2
    --restore-env A,B --``. It reads the script from its stdin, so the outer shim must get
    ``script_stdin=True`` (:func:`argv`); the job user never opens :data:`SHIM_SH`.

    Args:
        restore_env: loader variable names to set back as the job user (non-empty).

    Raises:
        ValueError: ``restore_env`` is empty (nothing for a second stage to do).
    """
    if not restore_env:
        raise ValueError("a second stage needs restore_env")
    return [SH, "-s", "--", "--stage2", "--restore-env", ",".join(restore_env), "--"]


INHERITED_IGNORES = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2")
"""Signals a job must start with at their default action."""


def _ignore_quietly(signum: int, frame: object) -> None:
    """A handler that does nothing: unlike SIG_IGN, exec resets it to the default action."""


def unignore_signals() -> list[str]:
    """Replace every SIG_IGN this process inherited for ``INHERITED_IGNORES`` (an agent
    started under ``nohup`` or in a background shell job ignores HUP, INT and QUIT) with a
    handler that does nothing, so that jobs exec'd from it start with the default action:
    an ignored disposition survives exec, and a POSIX ``sh`` (the shim) cannot reset a signal
    ignored on entry. The agent itself still ignores those signals. Returns the names changed.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return []  # only the main thread may set handlers (an agent run inside a test)
    changed = []
    for name in INHERITED_IGNORES:
        sig = getattr(signal, name)
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, _ignore_quietly)
            changed.append(name)
    return changed
