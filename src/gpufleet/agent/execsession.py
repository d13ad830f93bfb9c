"""``Agent.Exec``: a command, a shell or one forwarded TCP connection inside a running attempt.

The rules are docs/design/security.md, "Getting into a running job"; in short, what is
started here is the job's, never more:

* a **process attempt**: ``sh`` joins the attempt's cgroup(s) (writes its pid to each
  ``cgroup.procs``), then ``nsenter --target PID --net --mount --ipc --wd`` enters the
  command's namespaces and working directory, ``setpriv --reuid --regid --groups
  --no-new-privs`` switches to the command's uid, gid and groups (read from
  ``/proc/PID/status``; uid 0 is refused), ``setsid`` (``--ctty`` with a TTY) makes it a
  session of its own, and ``env`` sets back the loader variables of the job's environment
  (the command's ``/proc/PID/environ``) only after the switch. Every helper is named by
  absolute path from the agent's ``PATH``;
* a **container attempt**: ``podman exec --interactive [--tty] NAME CMD`` (the container's
  user, cgroup, namespaces, capabilities and environment);
* a **port-forward**: a TCP connection to ``127.0.0.1:PORT`` made in the attempt's network
  namespace (``setns`` in a thread of its own), refused for an attempt in the agent's own
  network namespace (its loopback would be the node's).

Bounds (:class:`ExecLimits`): sessions per attempt and per agent, an idle timeout, an output
rate (read slower; never buffered without bound), frame and command sizes. A session ends
when its process ends (the attempt's end kills it with the cgroup), on the idle timeout or
when the caller goes away; then the process's session is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.agent.runtime import jobns
from gpufleet.domain.interactive import HEARTBEAT_S
from gpufleet.rpc.protos import fleet_pb2 as pb

logger = logging.getLogger("gpufleet.agent")

FRAME_BYTES = 64 * 1024
"""The most bytes one stdout/stderr frame carries."""
COMMAND_BYTES = 64 * 1024
"""The most bytes an exec'd argv may have, all arguments together."""
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True, slots=True)
class ExecLimits:
    """Agent-side bounds of exec sessions (security.md). Units in the names."""

    sessions_per_run: int = 8
    sessions_per_agent: int = 32
    idle_timeout_s: float = 900.0
    output_bytes_per_s: int = 4 * 1024 * 1024


class ExecRefused(Exception):
    """The session is refused before anything ran; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Target:
    """Where a session runs: the attempt's command ``pid`` (host pid; a container's init),
    its identity and cgroup files (process attempts), or the container's name."""

    run_id: str
    pid: int
    kind: str  # "process" | "container"
    procs_files: tuple[Path, ...] = ()
    uid: int = -1
    gid: int = -1
    groups: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    pidns: bool = False
    container: str = ""
    engine_argv: tuple[str, ...] = ()
    engine_env: dict[str, str] | None = None
    activity: Path | None = None
    """The attempt's activity file (``$GPUFLEET_EXEC_ACTIVITY``, host path); None = none."""


def write_activity(path: Path, sessions: int) -> bool:
    """Record ``sessions`` (the number open) in the attempt's activity file ``path``
    (``{root}/work/NAME``; :mod:`gpufleet.domain.interactive`), which also sets its time.

    The work directory is the job's own: neither it nor the file is followed when a symlink,
    and a file with other links (a hard link to someone else's file) or that is not a regular
    file is left alone. Returns whether it was written; never raises ``OSError``.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    root = work = fd = -1
    try:
        root = os.open(path.parent.parent, flags)
        work = os.open(path.parent.name, flags | os.O_NOFOLLOW, dir_fd=root)
        fd = os.open(
            path.name,
            os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            0o644,
            dir_fd=work,
        )
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{max(0, sessions)}\n".encode())
        os.utime(fd)
        return True
    except OSError as exc:
        logger.debug("exec activity %s: %s", path, exc)
        return False
    finally:
        for d in (fd, work, root):
            if d >= 0:
                os.close(d)


def _which(name: str) -> str:
    path = os.environ.get("PATH", "")
    found = shutil.which(name, path=f"{path}:{jobns.SEARCH_PATH}" if path else jobns.SEARCH_PATH)
    if found is None:
        raise ExecRefused("FAILED_PRECONDITION", f"this node has no {name}")
    return found


def read_ids(pid: int) -> tuple[int, int, tuple[int, ...]]:
    """(real uid, real gid, supplementary groups) of ``pid`` from ``/proc/PID/status``.

    Raises:
        OSError: the process is gone.
    """
    uid = gid = -1
    groups: tuple[int, ...] = ()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[1])
        elif line.startswith("Gid:"):
            gid = int(line.split()[1])
        elif line.startswith("Groups:"):
            groups = tuple(int(g) for g in line.split()[1:])
    return uid, gid, groups


def read_environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (``/proc/PID/environ``).

    Raises:
        OSError: the process is gone.
    """
    env: dict[str, str] = {}
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
    return env


def same_netns(pid: int) -> bool:
    """Whether ``pid`` shares this process's network namespace."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino


_JOIN = (
    'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 126; shift; done; shift; exec "$@"'
)
"""``sh -c`` script: write its own pid to each file before ``--`` (join the attempt's cgroups
before anything of the session runs), then exec the rest."""


def process_argv(t: Target, command: list[str], *, tty: bool) -> tuple[list[str], dict[str, str]]:
    """The full argv and the environment of a session in a process attempt (module doc).

    Raises:
        ExecRefused: the attempt runs as root, or a helper is missing.
    """
    if t.uid <= 0 or t.gid < 0:
        raise ExecRefused(
            "FAILED_PRECONDITION",
            "the attempt runs as root or as the agent's own user: no job identity to exec as",
        )
    env, hidden = jobns.hide_loader_env(t.env)
    restore = [a for k in hidden for a in ("-u", jobns.HIDDEN_PREFIX + k)]
    restore += [f"{k}={t.env[k]}" for k in hidden]
    ns = ["--net", "--mount", "--ipc"] + (["--pid"] if t.pidns else [])
    groups = ["--groups", ",".join(str(g) for g in t.groups)] if t.groups else ["--clear-groups"]
    argv = [
        _which("sh"),
        "-c",
        _JOIN,
        "sh",
        *(str(p) for p in t.procs_files),
        "--",
        _which("nsenter"),
        "--target",
        str(t.pid),
        *ns,
        "--wd",
        "--",
        _which("setpriv"),
        "--reuid",
        str(t.uid),
        "--regid",
        str(t.gid),
        *groups,
        "--no-new-privs",
        "--inh-caps=-all",
        "--",
        _which("setsid"),
        *(["--ctty"] if tty else []),
        "--",
        _which("env"),
        *restore,
        "--",
        *command,
    ]
    return argv, env


def container_argv(t: Target, command: list[str], *, tty: bool) -> list[str]:
    """``podman exec`` into the attempt's container (its user, cgroup and namespaces)."""
    return [
        *t.engine_argv,
        "exec",
        "--interactive",
        *(["--tty"] if tty else []),
        "--",
        t.container,
        *command,
    ]


def connect_in_netns(pid: int, port: int, timeout_s: float = 5.0) -> socket.socket:
    """A TCP connection to ``127.0.0.1:port`` in ``pid``'s network namespace, made in a thread
    of its own (``setns`` changes only the calling thread's namespace; the socket keeps the
    namespace it was made in).

    Raises:
        OSError: refused, or the namespace cannot be entered.
    """
    out: list[Any] = []
    libc = ctypes.CDLL(None, use_errno=True)

    def run() -> None:
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if libc.setns(target, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
                try:
                    out.append(socket.create_connection(("127.0.0.1", port), timeout=timeout_s))
                finally:
                    libc.setns(own, CLONE_NEWNET)
            finally:
                os.close(own)
                os.close(target)
        except OSError as exc:
            out.append(exc)

    th = threading.Thread(target=run, name="exec-netns", daemon=True)
    th.start()
    th.join(timeout_s + 1)
    if not out:
        raise OSError("no answer from the job's network namespace")
    if isinstance(out[0], BaseException):
        raise out[0]
    sock: socket.socket = out[0]
    sock.settimeout(None)
    return sock


class _Bucket:
    """Output rate: ``rate`` bytes/s with a burst of one second's worth."""

    def __init__(self, rate: int) -> None:
        self.rate, self.tokens, self.at = rate, float(rate), time.monotonic()

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(float(self.rate), self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)


class ExecSessions:
    """The agent's exec sessions: admission (limits), start, relay, end.

    Args:
        find: ``find(run_id, token) -> Target`` (raises :class:`ExecRefused`); the agent
            core's view of its live attempts.
        limits: the bounds.
    """

    def __init__(self, find: Any, limits: ExecLimits | None = None) -> None:
        self.find = find
        self.limits = limits or ExecLimits()
        self._lock = threading.Lock()
        self._per_run: dict[str, int] = {}

    def _record(self, t: Target) -> None:
        """The attempt's activity file gets the number of its sessions open now."""
        if t.activity is not None:
            with self._lock:
                n = self._per_run.get(t.run_id, 0)
            write_activity(t.activity, n)

    def active(self) -> int:
        with self._lock:
            return sum(self._per_run.values())

    @contextlib.contextmanager
    def _slot(self, run_id: str) -> Iterator[None]:
        with self._lock:
            if sum(self._per_run.values()) >= self.limits.sessions_per_agent:
                raise ExecRefused("RESOURCE_EXHAUSTED", "too many exec sessions on this node")
            if self._per_run.get(run_id, 0) >= self.limits.sessions_per_run:
                raise ExecRefused(
                    "RESOURCE_EXHAUSTED",
                    f"at most {self.limits.sessions_per_run} exec sessions per attempt",
                )
            self._per_run[run_id] = self._per_run.get(run_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._per_run[run_id] -= 1
                if not self._per_run[run_id]:
                    del self._per_run[run_id]

    def serve(self, frames: Iterator[pb.ExecFrame], is_active: Any) -> Iterator[pb.ExecFrame]:
        """One session: ``frames`` are the caller's (the first must be ``start``); yields
        ``started``, output, and ``exit`` (or one ``error``). ``is_active()`` is False once
        the caller has gone.

        Raises:
            ExecRefused: before anything ran (the servicer turns it into a status).
        """
        first = next(frames, None)
        if first is None or first.WhichOneof("kind") != "start":
            raise ExecRefused("INVALID_ARGUMENT", "the first frame must be start")
        start = first.start
        if not start.forward_port and not start.command:
            raise ExecRefused("INVALID_ARGUMENT", "no command")
        if sum(len(a) + 1 for a in start.command) > COMMAND_BYTES:
            raise ExecRefused("INVALID_ARGUMENT", f"the command is over {COMMAND_BYTES} bytes")
        if any("\0" in a for a in start.command):
            raise ExecRefused("INVALID_ARGUMENT", "a NUL byte in the command")
        if not 0 <= start.forward_port <= 65535:
            raise ExecRefused("INVALID_ARGUMENT", "forward_port must be 1-65535")
        target: Target = self.find(start.run_id, start.token)
        with self._slot(target.run_id):
            self._record(target)
            what = f"port-forward :{start.forward_port}" if start.forward_port else start.command
            logger.info("run %s: exec %s for %s", target.run_id, what, start.actor or "?")
            t0 = time.monotonic()
            code = None
            try:
                if start.forward_port:
                    gen = self._forward(target, start.forward_port, frames, is_active)
                else:
                    gen = self._run(target, start, frames, is_active)
                for out in gen:
                    if out.WhichOneof("kind") == "exit":
                        code = out.exit.exit_code
                    yield out
            finally:
                self._record_after(target)
                logger.info(
                    "run %s: exec %s ended (exit %s, %.1f s)",
                    target.run_id,
                    what,
                    code,
                    time.monotonic() - t0,
                )

    def _record_after(self, t: Target) -> None:
        """At a session's end: the count without it (the slot is released after this)."""
        if t.activity is not None:
            with self._lock:
                n = self._per_run.get(t.run_id, 1) - 1
            write_activity(t.activity, n)

    def _beat(self, t: Target, due: list[float]) -> None:
        """Rewrite the activity file every ``HEARTBEAT_S`` while the session is open."""
        now = time.monotonic()
        if now >= due[0]:
            due[0] = now + HEARTBEAT_S
            self._record(t)

    # ------------------------------------------------------------------ a command

    def _run(
        self, t: Target, start: pb.ExecStart, frames: Iterator[pb.ExecFrame], is_active: Any
    ) -> Iterator[pb.ExecFrame]:
        command = list(start.command)
        tty = start.tty
        if t.kind == "container":
            argv, env = container_argv(t, command, tty=tty), t.engine_env
        else:
            argv, env = process_argv(t, command, tty=tty)
        master = slave = -1
        if tty:
            master, slave = os.openpty()
            _set_size(master, start.rows or 24, start.cols or 80)
            if t.kind == "process":
                os.fchown(slave, t.uid, -1)  # the job user's terminal, as sshd does
            stdio: dict[str, Any] = {"stdin": slave, "stdout": slave, "stderr": slave}
        else:
            stdio = {
                "stdin": subprocess.PIPE,
                "stdout": subprocess.PIPE,
                "stderr": subprocess.PIPE,
            }
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                close_fds=True,
                start_new_session=t.kind == "container",  # setsid makes it one otherwise
                **stdio,
            )
        except OSError as exc:
            for fd in (master, slave):
                if fd >= 0:
                    os.close(fd)
            raise ExecRefused("INTERNAL", f"cannot start: {exc}") from exc
        if slave >= 0:
            os.close(slave)
        yield pb.ExecFrame(started=pb.ExecStarted(pid=proc.pid, uid=t.uid))
        last = [time.monotonic()]
        gone = threading.Event()
        stdin_fd = master if tty else (proc.stdin.fileno() if proc.stdin else -1)

        def pump_in() -> None:
            try:
                for f in frames:
                    last[0] = time.monotonic()
                    kind = f.WhichOneof("kind")
                    if kind == "stdin" and f.stdin:
                        _write_all(stdin_fd, f.stdin)
                    elif kind == "resize" and tty:
                        _set_size(master, f.resize.rows, f.resize.cols)
                    elif kind == "stdin_eof" and not tty and proc.stdin is not None:
                        proc.stdin.close()
            except (OSError, ValueError):
                pass
            except Exception:  # the caller went away (grpc raises on a cancelled stream)
                pass
            finally:
                gone.set()

        threading.Thread(target=pump_in, name="exec-stdin", daemon=True).start()
        outs: dict[int, str] = {}
        if tty:
            outs[master] = "stdout"
        else:
            assert proc.stdout is not None
            assert proc.stderr is not None
            outs[proc.stdout.fileno()] = "stdout"
            outs[proc.stderr.fileno()] = "stderr"
        bucket = _Bucket(self.limits.output_bytes_per_s)
        why = ""
        due = [time.monotonic() + HEARTBEAT_S]
        try:
            while outs:
                self._beat(t, due)
                why = _why_end(is_active, last[0], self.limits.idle_timeout_s)
                if why:
                    break
                ready, _, _ = select.select(list(outs), [], [], 0.5)
                for fd in ready:
                    try:
                        data = os.read(fd, FRAME_BYTES)
                    except OSError:  # EIO: the pty's last holder closed it
                        data = b""
                    if not data:
                        del outs[fd]
                        continue
                    last[0] = time.monotonic()
                    bucket.take(len(data))
                    if outs[fd] == "stderr":
                        yield pb.ExecFrame(stderr=data)
                    else:
                        yield pb.ExecFrame(stdout=data)
        finally:
            if why or outs:
                _kill_session(proc)
            code = _wait(proc)
            if master >= 0:
                os.close(master)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        yield pb.ExecFrame(exit=pb.ExecExit(exit_code=code, message=why))

    # ------------------------------------------------------------------ a TCP connection

    def _forward(
        self, t: Target, port: int, frames: Iterator[pb.ExecFrame], is_active: Any
    ) -> Iterator[pb.ExecFrame]:
        if same_netns(t.pid):
            raise ExecRefused(
                "FAILED_PRECONDITION",
                "the attempt shares the node's network namespace: no port-forward "
                "(its 127.0.0.1 is the node's)",
            )
        try:
            sock = connect_in_netns(t.pid, port)
        except OSError as exc:
            yield pb.ExecFrame(error=f"cannot connect to 127.0.0.1:{port} in the job: {exc}")
            return
        yield pb.ExecFrame(started=pb.ExecStarted(pid=0, uid=-1))
        last = [time.monotonic()]

        def pump_in() -> None:
            try:
                for f in frames:
                    last[0] = time.monotonic()
                    kind = f.WhichOneof("kind")
                    if kind == "stdin" and f.stdin:
                        sock.sendall(f.stdin)
                    elif kind == "stdin_eof":
                        sock.shutdown(socket.SHUT_WR)
            except Exception:  # the socket closed, or the caller went away
                pass
            finally:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pump_in, name="exec-forward", daemon=True).start()
        bucket = _Bucket(self.limits.output_bytes_per_s)
        why = ""
        due = [time.monotonic() + HEARTBEAT_S]
        try:
            while True:
                self._beat(t, due)
                why = _why_end(is_active, last[0], self.limits.idle_timeout_s)
                if why:
                    break
                if not select.select([sock], [], [], 0.5)[0]:
                    continue
                try:
                    data = sock.recv(FRAME_BYTES)
                except OSError:
                    data = b""
                if not data:
                    break
                last[0] = time.monotonic()
                bucket.take(len(data))
                yield pb.ExecFrame(stdout=data)
        finally:
            sock.close()
        yield pb.ExecFrame(exit=pb.ExecExit(exit_code=0, message=why))


def _why_end(is_active: Any, last_s: float, idle_timeout_s: float) -> str:
    """Why a session ends now ("" = it goes on): its caller went away, or nothing moved
    either way since ``last_s`` (monotonic seconds) for ``idle_timeout_s``."""
    if not is_active():
        return "the caller went away"
    if time.monotonic() - last_s > idle_timeout_s:
        return f"idle for {idle_timeout_s:g} s"
    return ""


def _set_size(fd: int, rows: int, cols: int) -> None:
    if rows > 0 and cols > 0:
        with contextlib.suppress(OSError):
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the session the exec'd process leads (its pid is its session's and group's)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _wait(proc: subprocess.Popen[bytes]) -> int:
    try:
        rc = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        rc = proc.wait()
    return rc


def target_of(core: Any, run_id: str, token: int) -> Target:
    """The :class:`Target` of a live attempt of ``core`` (an ``AgentCore``).

    Raises:
        ExecRefused: not running here under ``token`` (NOT_FOUND / FAILED_PRECONDITION), or
            its process is gone.
    """
    from gpufleet.agent.runtime.container_watch import ContainerHandle
    from gpufleet.agent.runtime.process import ProcessHandle

    try:
        _rec, h = core.live_attempt(run_id, token)
    except LookupError as exc:
        code = "FAILED_PRECONDITION" if "token" in str(exc) else "NOT_FOUND"
        raise ExecRefused(code, str(exc)) from exc
    runtimes = core.runner.runtimes
    activity = core.runner.paths(run_id).exec_activity
    try:
        if isinstance(h, ContainerHandle):
            engine = runtimes.container.engine
            return Target(
                run_id=run_id,
                pid=h.pid,
                kind="container",
                container=h.name,
                engine_argv=tuple(engine.argv0),
                engine_env=dict(engine.env),
                activity=activity,
            )
        if isinstance(h, ProcessHandle):
            uid, gid, groups = read_ids(h.pid)
            return Target(
                run_id=run_id,
                pid=h.pid,
                kind="process",
                procs_files=tuple(h.cgroup.procs_files()) if h.cgroup is not None else (),
                uid=uid,
                gid=gid,
                groups=groups,
                env=read_environ(h.pid),
                pidns=getattr(runtimes.process, "containment", None) is not None
                and runtimes.process.containment.kind == "pidns",
                activity=activity,
            )
    except OSError as exc:
        raise ExecRefused("NOT_FOUND", f"run {run_id}: its process is gone ({exc})") from exc
    raise ExecRefused("FAILED_PRECONDITION", f"run {run_id}: no exec for this runtime")
