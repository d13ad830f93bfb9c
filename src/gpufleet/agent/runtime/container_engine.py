"""The container engine's CLI behind one adapter: the only code of the agent that runs it.

:class:`ContainerEngine` wraps podman (the default; daemonless, run here as
``podman --runtime runc --cgroup-manager cgroupfs`` with the agent's own ``containers.conf``, so
no global configuration is needed) or docker (``gpufleet agent --runtime docker``): images
(present?, pull, list, remove) and containers (create, start, inspect, find by label, kill,
remove, follow logs). Registries on loopback are pulled with ``--tls-verify=false``. An image
reference always follows ``--`` on the engine's command line (it can never be read as an
option), and one that is not a valid OCI reference is refused before any call
(:class:`ImageUnavailable`), and so is one whose registry is in the job-egress deny list
(:meth:`ContainerEngine.check_registry`: refused before any connection). A failed pull is
:class:`ImageUnavailable` (the job's fault) unless the node proves itself broken by a check of
its own right then (:meth:`ContainerEngine.node_problem`: the engine answers ``info``, its graph
root has :data:`NODE_MIN_FREE_MB` free and takes a small write): then :class:`EngineError`, the
node's. The engine's message is never searched for node-fault words (it embeds the registry's
own answer, which a hostile registry writes), and the reason a job gets for a registry that
cannot be had is one generic sentence (:func:`pull_failure_text`: refused, EOF and HTTP statuses
read alike, so a pull cannot probe ports); the full message goes to the agent's log. What the
runtime does with
these calls is in :mod:`gpufleet.agent.runtime.container`; the hardening flags of ``create``
are :class:`ContainerSecurity`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpufleet.domain.images import reference_problem

if TYPE_CHECKING:
    from gpufleet.agent.runtime.jobnet import JobNet

logger = logging.getLogger(__name__)

ENGINES = ("podman", "docker")
PULL_TIMEOUT_S = 1800.0
CLI_TIMEOUT_S = 60.0
STOP_POLL_S = 0.5
"""How often (seconds) a pull looks at its attempt's stop request."""
PULL_TERM_GRACE_S = 5.0
"""A stopped pull gets SIGTERM, then SIGKILL after this many seconds."""
KILL_TIMEOUT_S = 10.0
"""Bound (seconds) on one ``kill`` of a container: an engine that does not answer in that time is
bypassed (the runtime signals the container's cgroup)."""
REMOVE_ATTEMPTS = 3
REMOVE_RETRY_S = 0.5
"""``rm`` of a container is tried :data:`REMOVE_ATTEMPTS` times, this many seconds apart."""
NODE_MIN_FREE_MB = 256
"""Free space (MiB) the engine's graph root must have for :meth:`ContainerEngine.node_problem`
to find the node sound."""

_PODMAN_CONF = """\
# Written by the gpufleet agent; used through CONTAINERS_CONF for its own podman calls only.
[containers]
default_ulimits = []
[engine]
events_logger = "file"
"""


_OCI_WRAPPER = """\
#!/bin/sh
# Written by the gpufleet agent (ContainerEngine.keep_oom_counters): podman's OCI runtime for
# its containers. On `delete` it first saves the container cgroup's OOM counters (cgroup v1
# keeps them only in the group that runc is about to remove), then runs runc.
for id; do :; done
case " $* " in
*" delete "*)
  for d in {dirs}; do
    if [ -d "$d" ]; then
      cat "$d/memory.oom_control" "$d/memory.events" > {out}/"$id.tmp" 2>/dev/null
      mv -f {out}/"$id.tmp" {out}/"$id"
    fi
  done ;;
esac
exec {runc} "$@"
"""


class EngineError(Exception):
    """The engine CLI failed (message: the command and its stderr)."""


class EngineTimeout(EngineError):
    """The engine CLI gave no answer in time."""


class ImageUnavailable(EngineError):
    """The image, as the job names it, cannot be had: a malformed reference, the registry's
    answer (not found, manifest unknown, unauthorised, denied), the registry unreachable or
    too slow. The job's fault (it uses a retry), never the node's."""


class PullStopped(ImageUnavailable):
    """The attempt was stopped (cancel, preemption) during its pull: the pull was killed."""


# Substrings of the engines' messages seen when the node's own engine or storage failed
# (podman/containers-storage and docker wordings). Informational only: a pull's or create's
# message embeds the registry's answer, so no fault is decided by it (node_problem decides).
NODE_FAULT_MARKERS = (
    "no space left on device",
    "read-only file system",
    "input/output error",
    "disk quota exceeded",
    "cannot allocate memory",
    "too many open files",
    "database is locked",
    "database configuration mismatch",
    "committing the finished image",
    "layer not known",
    "creating overlay mount",
    "mounting storage",
    "cannot connect to the docker daemon",
    "is the docker daemon running",
)

# Substrings of ``create`` errors that are about the image reference the job gave (after
# the agent's own check): the job's fault; any other create failure is the node's.
REFERENCE_MARKERS = (
    "invalid reference format",
    "unknown transport",
    "repository name must be lowercase",
    "short-name",
    "image not known",
    "no such image",
)

IMAGE_UNAVAILABLE_MARKERS = REFERENCE_MARKERS
"""Kept for callers of the earlier name: the reference problems of :data:`REFERENCE_MARKERS`."""

DEFAULT_PIDS_LIMIT = 4096
"""Processes and threads a container may hold at once when the job sets no ``pids_limit``."""

USERNS_HOST_BASE = 2_000_000_000
USERNS_SIZE = 65536
"""A container's uids/gids 0..65535 are host ids ``USERNS_HOST_BASE + id`` (above the agent's
per-attempt job uids), except the job's own uid and gid, which map to themselves."""

USERNS_PROBE_CACHE = Path("/run/gpufleet/userns-probe.json")
"""Where :meth:`ContainerEngine.userns_works` keeps its answer (a tmpfs: gone at the next boot)."""


@dataclass(frozen=True, slots=True)
class ContainerSecurity:
    """The hardening flags of one container (``create``).

    Attributes:
        pids_limit: ``--pids-limit`` (processes and threads; 0 = the engine's default).
        read_only: ``--read-only`` root filesystem (the bind mounts stay writable: the
            attempt's directories and its scratch ``tmp/`` on ``/tmp`` and ``/var/tmp``;
            podman adds a tmpfs ``/run``).
        userns: run in a user namespace whose ids 0..65535 are host ids
            ``USERNS_HOST_BASE + id`` (so the container's root is not host root), except
            ``keep_ids``.
        keep_ids: the job's (uid, gid), mapped to themselves (its files on the host stay
            its own); None = none kept (container root is host ``USERNS_HOST_BASE``).
        cap_add: capabilities given back after ``--cap-drop ALL`` (none by default: a GPU
            job needs none; its devices come through CDI and the device cgroup).
    """

    pids_limit: int = DEFAULT_PIDS_LIMIT
    read_only: bool = False
    userns: bool = False
    keep_ids: tuple[int, int] | None = None
    cap_add: tuple[str, ...] = field(default_factory=tuple)


def id_map(
    keep: int | None, *, base: int = USERNS_HOST_BASE, size: int = USERNS_SIZE
) -> list[str]:
    """``container:host:count`` ranges for ``--uidmap``/``--gidmap``: ``keep`` -> ``keep``,
    every other id of ``0..size-1`` -> ``base + id`` (split around ``keep`` when it falls in
    that range, since ranges may not overlap). ``keep`` None or 0: no id is kept (0 is
    never mapped to host root)."""
    if not keep:
        return [f"0:{base}:{size}"]
    if keep < size:
        out = []
        if keep > 0:
            out.append(f"0:{base}:{keep}")
        out.append(f"{keep}:{keep}:1")
        if keep + 1 < size:
            out.append(f"{keep + 1}:{base + keep + 1}:{size - keep - 1}")
        return out
    return [f"0:{base}:{size}", f"{keep}:{keep}:1"]


def security_args(kind: str, sec: ContainerSecurity) -> list[str]:
    """The ``create`` arguments of ``sec`` for engine ``kind`` (docker: no per-container
    user namespace, that is the daemon's ``userns-remap``)."""
    args = ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    for cap in sec.cap_add:
        args += ["--cap-add", cap]
    if sec.pids_limit > 0:
        args += ["--pids-limit", str(sec.pids_limit)]
    if sec.read_only:
        # /tmp and /var/tmp are the attempt's scratch tmp/ (bind mounts); podman adds a tmpfs
        # /run (--read-only-tmpfs, charged to the container's memory cgroup)
        args.append("--read-only")
    if sec.userns and kind == "podman":
        uid, gid = sec.keep_ids if sec.keep_ids is not None else (None, None)
        for m in id_map(uid):
            args += ["--uidmap", m]
        for m in id_map(gid):
            args += ["--gidmap", m]
    return args


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """One local image: ``name`` (repository:tag), ``digest`` (sha256:...), ``size_bytes``."""

    name: str
    digest: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class ContainerState:
    """What ``inspect`` says about one container.

    Attributes:
        status: the engine's word (created, running, exited, stopped, ...).
        running: the container's processes run (or it is paused / being stopped).
        pid: host pid of the container's init (0 when not running).
        exit_code: valid once not running.
        oom_killed: the engine saw the memory limit kill it.
        cgroup_parent: the cgroup parent the container was created under ("" = default).
        conmon_pid: host pid of podman's monitor of the container (0 = unknown, docker).
    """

    id: str
    name: str
    status: str
    running: bool
    pid: int
    exit_code: int
    oom_killed: bool
    labels: Mapping[str, str]
    cgroup_parent: str = ""
    conmon_pid: int = 0


def node_fault_text(message: str) -> bool:
    """Whether an engine message says the node's own engine or storage failed."""
    text = message.lower()
    return any(m in text for m in NODE_FAULT_MARKERS)


def reference_fault_text(message: str) -> bool:
    """Whether an engine message is about the image reference (:data:`REFERENCE_MARKERS`)."""
    text = message.lower()
    return any(m in text for m in REFERENCE_MARKERS)


def _is_loopback_registry(image: str) -> bool:
    host = image.split("/", 1)[0] if "/" in image else ""
    return host.split(":", 1)[0] in ("127.0.0.1", "localhost", "[::1]")


def registry_of(image: str) -> tuple[str, int] | None:
    """The registry ``(host, port)`` a valid reference names (port 443 when none is given);
    None for the default registry (a reference whose first part is no host)."""
    first, sep, _ = image.partition("/")
    if not sep or not ("." in first or ":" in first or first == "localhost"):
        return None
    if first.startswith("["):
        host, _, rest = first[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = first.partition(":")
    return host, int(port) if port.isdigit() else 443


def pull_failure_text(image: str, message: str) -> str:
    """The reason a job gets for a failed pull of ``image``: the registry's own refusal (not
    found, denied) or one generic sentence for everything else (refused, EOF, TLS, DNS, an HTTP
    status), so that pulls cannot tell the services behind ports apart."""
    reg = registry_of(image)
    where = f"registry {reg[0]}:{reg[1]}" if reg else "the default registry"
    text = message.lower()
    if "manifest unknown" in text or "name unknown" in text:
        return f"image {image[:120]!r} not found in {where}"
    if "unauthorized" in text or "access to the resource is denied" in text:
        return f"{where} denied access to image {image[:120]!r}"
    return f"{where} unreachable or not a registry"


class ContainerEngine:
    """The podman or docker CLI behind one set of methods.

    Args:
        kind: ``"podman"`` or ``"docker"``.
        state_dir: where the agent's podman settings file is written.
        binary: the CLI to run (default: ``kind`` on PATH).

    Raises:
        ValueError: unknown kind.
        EngineError: the CLI is not installed.
    """

    def __init__(self, kind: str = "podman", *, state_dir: Path, binary: str | None = None):
        if kind not in ENGINES:
            raise ValueError(f"container runtime must be one of {ENGINES}, not {kind!r}")
        self.kind = kind
        path = shutil.which(binary or kind)
        if path is None:
            raise EngineError(f"{binary or kind} is not installed (scripts/ensure-services.sh)")
        self.argv0: list[str] = [path]
        self.env = dict(os.environ)
        self.jobnet: JobNet | None = None
        """The agent's job networking: pulls from its deny list are refused (None = none)."""
        self.min_free_mb = NODE_MIN_FREE_MB
        # the engine's working directory (also conmon's, which writes an ``oom`` file into it
        # on cgroup v1 when a container's memory group hits OOM): never the agent's own
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.oom_dir: Path | None = None
        """Where the OCI runtime wrapper saves each container's OOM counters
        (:meth:`keep_oom_counters`); None = not wrapped."""
        if kind == "podman":
            conf = state_dir / "containers.conf"
            state_dir.mkdir(parents=True, exist_ok=True)
            if not conf.exists() or conf.read_text() != _PODMAN_CONF:
                conf.write_text(_PODMAN_CONF)
            self.env["CONTAINERS_CONF"] = str(conf)
            self.argv0 += ["--runtime", "runc", "--cgroup-manager", "cgroupfs"]

    def keep_oom_counters(self, cgroup_bases: Sequence[Path]) -> Path | None:
        """Run podman's containers with an OCI runtime wrapper that saves each container's
        OOM-kill counters before its cgroup is deleted; returns the directory they are saved
        in (``<state_dir>/oom/<container id>``), None when not possible (docker, no runc).

        Why: on cgroup v1 the kernel counts an OOM kill only in the victim's own memory group
        (``memory.oom_control`` ``oom_kill`` is not hierarchical), which for a container is
        the engine's ``libpod-<id>`` group, and ``runc delete`` removes that group as soon as
        the container has exited (podman's cleanup, before the agent may look). podman does
        not report ``OOMKilled`` on such hosts either. The wrapper (``<state_dir>/oci/runc``,
        passed as ``podman --runtime``; named ``runc`` so podman treats it as runc) copies
        ``memory.oom_control``/``memory.events`` of ``<base>/*/libpod-<id>`` for each of
        ``cgroup_bases`` on ``delete`` and then execs runc, so at any moment after the
        container's processes are gone either its group or the saved copy exists. Every other
        call is a bare ``exec runc``. Containers made with the wrapper can still be listed,
        inspected and removed by a ``podman --runtime runc``.

        Args:
            cgroup_bases: the directories (memory hierarchy, v1; the unified one, v2) whose
                sub-directories are the containers' ``--cgroup-parent`` groups.
        """
        runc = shutil.which("runc", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/bin:/sbin")
        if self.kind != "podman" or runc is None or "--runtime" not in self.argv0:
            return None
        oom_dir = self.state_dir / "oom"
        wrapper = self.state_dir / "oci" / "runc"
        dirs = " ".join(f'{shlex.quote(str(b))}/*/libpod-"$id"' for b in cgroup_bases)
        text = _OCI_WRAPPER.format(
            dirs=dirs, out=shlex.quote(str(oom_dir)), runc=shlex.quote(runc)
        )
        try:
            oom_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            wrapper.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not wrapper.exists() or wrapper.read_text() != text:
                tmp = wrapper.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(text)
                tmp.chmod(0o755)
                os.replace(tmp, wrapper)
        except OSError as exc:
            logger.warning("no OOM counters for containers (cannot write %s: %s)", wrapper, exc)
            return None
        self.argv0[self.argv0.index("--runtime") + 1] = str(wrapper)
        self.oom_dir = oom_dir
        return oom_dir

    # ------------------------------------------------------------------ plumbing

    def _run(
        self, args: Sequence[str], *, timeout: float = CLI_TIMEOUT_S, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(
                [*self.argv0, *args],
                capture_output=True,
                text=True,
                env=self.env,
                cwd=self.state_dir,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise EngineTimeout(f"{self.kind} {args[0]}: no answer in {timeout:g} s") from exc
        except OSError as exc:
            raise EngineError(f"{self.kind} {args[0]}: {exc}") from exc
        if check and proc.returncode != 0:
            err = (proc.stderr or proc.stdout).strip().splitlines()
            raise EngineError(
                f"{self.kind} {args[0]} failed: {err[-1] if err else proc.returncode}"
            )
        return proc

    def _run_stoppable(
        self, args: Sequence[str], *, timeout: float, should_stop: Callable[[], bool]
    ) -> None:
        """Run the engine in its own session, looking at ``should_stop()`` every
        :data:`STOP_POLL_S`: a stop or the timeout ends it (SIGTERM to its group, SIGKILL
        after :data:`PULL_TERM_GRACE_S`). Raises PullStopped, EngineTimeout or EngineError."""
        try:
            proc = subprocess.Popen(
                [*self.argv0, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                env=self.env,
                cwd=self.state_dir,
                start_new_session=True,
            )
        except OSError as exc:
            raise EngineError(f"{self.kind} {args[0]}: {exc}") from exc
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                stop = should_stop()
                if stop or time.monotonic() >= deadline:
                    self._end_group(proc)
                    if stop:
                        raise PullStopped(f"{self.kind} {args[0]}: stopped") from None
                    raise EngineTimeout(
                        f"{self.kind} {args[0]}: no answer in {timeout:g} s"
                    ) from None
        if proc.returncode != 0:
            lines = (err or out).strip().splitlines()
            raise EngineError(
                f"{self.kind} {args[0]} failed: {lines[-1] if lines else proc.returncode}"
            )

    @staticmethod
    def _end_group(proc: subprocess.Popen[str]) -> None:
        for sig, wait in ((signal.SIGTERM, PULL_TERM_GRACE_S), (signal.SIGKILL, 30.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.communicate(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def version(self) -> str:
        return self._run(["version", "--format", "{{.Client.Version}}"]).stdout.strip()

    # ------------------------------------------------------------------ images

    @staticmethod
    def check_reference(image: str) -> None:
        """Raises ImageUnavailable when ``image`` is not a valid OCI reference (it is then
        never passed to the engine)."""
        problem = reference_problem(image)
        if problem is not None:
            raise ImageUnavailable(f"image reference {image[:80]!r} {problem}")

    def check_registry(self, image: str) -> None:
        """Raises ImageUnavailable when ``image``'s registry ``host:port`` (resolved: every
        address) is in the job-egress deny list of :attr:`jobnet`, or is one of the agent's
        own ports on loopback. Nothing is connected to; a name that does not resolve is left
        to the engine."""
        reg = registry_of(image)
        if reg is None or self.jobnet is None:
            return
        host, port = reg
        try:
            addrs = {ipaddress.ip_address(host)}
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
            except OSError:
                return
            addrs = {ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos}
        policy = self.jobnet.policy
        for addr in addrs:
            denied = any(
                addr.version == t.net.version and addr in t.net and t.port in (None, port)
                for t in policy.deny
            )
            if denied or (addr.is_loopback and port in policy.own_ports):
                raise ImageUnavailable(
                    f"registry {host}:{port} is not allowed: it is in the node's job-egress"
                    " deny list (the control plane, the metadata range, --job-egress-deny or"
                    " the agent's own ports)"
                )

    def node_problem(self) -> str:
        """The node's own check after a failed pull or create: "" when the engine answers
        ``info`` and its graph root has :attr:`min_free_mb` MiB free and takes a small write
        (created, fsynced, removed), else what failed."""
        fmt = "{{.Store.GraphRoot}}" if self.kind == "podman" else "{{.DockerRootDir}}"
        try:
            out = self._run(["info", "--format", fmt]).stdout.strip()
        except EngineError as exc:
            return f"the engine does not answer info: {exc}"
        root = Path(out.splitlines()[-1].strip()) if out else Path()
        if not root.is_absolute():
            return f"the engine names no graph root ({out[:80]!r})"
        try:
            st = os.statvfs(root)
            free_mb = st.f_bavail * st.f_frsize // (1 << 20)
            if free_mb < self.min_free_mb:
                return f"graph root {root}: {free_mb} MiB free (under {self.min_free_mb} MiB)"
            fd, probe = tempfile.mkstemp(prefix=".gpufleet-probe-", dir=root)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            return f"graph root {root} is not writable: {exc}"
        return ""

    def has_image(self, image: str) -> bool:
        """Whether the engine holds ``image`` (False for an invalid reference)."""
        if reference_problem(image) is not None:
            return False
        if self.kind == "podman":
            return self._run(["image", "exists", "--", image], check=False).returncode == 0
        return self._run(["image", "inspect", "--", image], check=False).returncode == 0

    def pull(
        self,
        image: str,
        timeout: float = PULL_TIMEOUT_S,
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Pull ``image`` (``timeout``: seconds). With ``should_stop``, looked at every
        :data:`STOP_POLL_S`, a stop ends the pull (:class:`PullStopped`).

        Raises:
            ImageUnavailable: the reference is invalid, its registry is denied
                (:meth:`check_registry`), or the pull failed and the node's own check
                (:meth:`node_problem`) found nothing wrong: the job's fault; the message is
                :func:`pull_failure_text` (the engine's own is logged).
            EngineError: the pull failed and :meth:`node_problem` found the node broken, or
                the engine CLI cannot be run: the node's fault.
        """
        self.check_reference(image)
        self.check_registry(image)
        args = ["pull"]
        if self.kind == "podman":
            args.append("--quiet")
            if _is_loopback_registry(image):
                args.append("--tls-verify=false")
        try:
            if should_stop is None:
                self._run([*args, "--", image], timeout=timeout)
            else:
                self._run_stoppable([*args, "--", image], timeout=timeout, should_stop=should_stop)
        except PullStopped:
            logger.info("pull of %s: stopped (the attempt's stop arrived)", image[:200])
            raise
        except EngineTimeout as exc:  # a registry that crawls: about the image named
            logger.info("pull of %s: %s", image[:200], exc)
            raise ImageUnavailable(
                f"{pull_failure_text(image, '')} (no image in {timeout:g} s)"
            ) from None
        except EngineError as exc:
            if isinstance(exc.__cause__, OSError):
                raise
            problem = self.node_problem()
            logger.warning(
                "pull of %s failed: %s (node check: %s)", image[:200], exc, problem or "sound"
            )
            if problem:
                raise EngineError(f"{exc}; the node's own check: {problem}") from exc
            raise ImageUnavailable(pull_failure_text(image, str(exc))) from None

    def ensure_present(self, image: str) -> bool:
        """Pull ``image`` unless present; True if it was pulled."""
        if self.has_image(image):
            return False
        self.pull(image)
        return True

    def images(self) -> list[ImageInfo]:
        """Local images with a name (dangling ones are left out), each name once, in the
        engine's order."""
        out = self._run(["images", "--format", "json"]).stdout
        result: list[ImageInfo] = []
        if self.kind == "podman":
            seen: set[str] = set()
            # podman lists an image once per tag, each entry with all its names: take each
            # name once
            for img in json.loads(out or "[]"):
                for name in img.get("Names") or []:
                    if name in seen:
                        continue
                    seen.add(name)
                    result.append(
                        ImageInfo(name, str(img.get("Digest", "")), int(img.get("Size", 0)))
                    )
        else:  # docker: one JSON object per line
            for line in out.splitlines():
                img = json.loads(line)
                if img.get("Repository") in (None, "<none>"):
                    continue
                name = f"{img['Repository']}:{img.get('Tag', 'latest')}"
                result.append(ImageInfo(name, str(img.get("Digest", "")), 0))
        return result

    def remove_image(self, image: str) -> None:
        if reference_problem(image) is None:
            self._run(["rmi", "--force", "--", image], check=False)

    def userns_works(self, state_dir: Path) -> str:
        """Whether this podman can run a container in a user namespace of
        :func:`security_args` (some storage setups cannot mount an image's layers id-mapped):
        runs the static ``catatonit`` in a throwaway local image (imported from a tar of it
        under ``state_dir``, removed afterwards), ~0.5 s, once per engine version and kernel until
        the next boot (:data:`USERNS_PROBE_CACHE`). Returns "" when it works, else the
        engine's message. Docker: always the reason it is not supported."""
        if self.kind != "podman":
            return "docker has no per-container user namespace (use the daemon's userns-remap)"
        # the answer depends on the engine, the kernel and the storage, not on the agent: kept
        # until the next boot (/run is a tmpfs) for every agent of this host
        key = f"{self._version()}|{os.uname().release}"
        cache = USERNS_PROBE_CACHE
        with contextlib.suppress(OSError, ValueError):
            seen = json.loads(cache.read_text())
            if seen.get("key") == key:
                return str(seen.get("problem", ""))
        problem = self._probe_userns(state_dir)
        with contextlib.suppress(OSError):
            cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "problem": problem}))
            os.replace(tmp, cache)
        return problem

    def _version(self) -> str:
        try:
            proc = self._run(["--version"], check=False)
        except EngineError:
            return ""
        return (proc.stdout or "").strip()

    def _probe_userns(self, state_dir: Path) -> str:
        image = "localhost/gpufleet/userns-probe:1"
        if not self.has_image(image):
            init = shutil.which("catatonit") or "/usr/libexec/podman/catatonit"
            if not os.path.exists(init):
                return "no catatonit binary to probe with"
            with tempfile.TemporaryDirectory(dir=state_dir) as tmp:
                tar = Path(tmp) / "probe.tar"
                with tarfile.open(tar, "w") as t:
                    t.add(os.path.realpath(init), arcname="catatonit")
                try:
                    self._run(["import", "--", str(tar), image])
                except EngineError as exc:
                    return str(exc)
        args = ["run", "--rm", "--network", "none", "--user", "1:1"]
        args += security_args(self.kind, ContainerSecurity(userns=True, keep_ids=(1, 1)))
        try:
            proc = self._run([*args, "--", image, "/catatonit", "--version"], check=False)
        finally:  # not left in the node's image list (heartbeats)
            self.remove_image(image)
        if proc.returncode == 0:
            return ""
        err = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        first = next((ln for ln in err if ln.startswith("Error")), err[-1] if err else "")
        return first[:300] or f"exit {proc.returncode}"

    # ------------------------------------------------------------------ containers

    def create(
        self,
        *,
        name: str,
        image: str,
        command: Sequence[str],
        env_file: Path,
        labels: Mapping[str, str],
        mounts: Iterable[tuple[Path, str, bool]],
        workdir: str,
        devices: Iterable[str] = (),
        memory_mb: int = 0,
        cpu: float = 0.0,
        cgroup_parent: str = "",
        user: str = "",
        security: ContainerSecurity | None = None,
        network: str = "host",
        shm_mb: int = 0,
    ) -> str:
        """Create (not start) a container; returns its id. ``user``: ``uid:gid`` (and
        ``--group-add`` is not used: supplementary groups stay the image's). ``security``:
        its hardening flags (default :class:`ContainerSecurity`: no capabilities,
        no-new-privileges, the default pids limit). ``network``: the ``--network`` value
        (``ns:/run/netns/NAME``: the attempt's namespace). Bind mounts are ``nosuid,nodev``
        (podman). ``shm_mb``: ``--shm-size`` in MiB (0: the engine's default, 64 MB). The
        image follows ``--``.

        Raises:
            ImageUnavailable: ``image`` is not a valid reference (nothing is run).
            EngineError: the engine refused or failed.
        """
        self.check_reference(image)
        args = ["create", "--name", name, "--init", "--network", network]
        args += security_args(self.kind, security or ContainerSecurity())
        args += ["--env-file", str(env_file), "--workdir", workdir]
        if user:
            args += ["--user", user]
        for k, v in labels.items():
            args += ["--label", f"{k}={v}"]
        for host, inside, ro in mounts:
            opts = ["ro"] if ro else []
            if self.kind == "podman":  # docker's -v takes no nosuid/nodev
                opts += ["nosuid", "nodev"]
            args += ["--volume", f"{host}:{inside}{':' + ','.join(opts) if opts else ''}"]
        for dev in devices:
            args += ["--device", dev]
        if memory_mb > 0:
            args += ["--memory", f"{memory_mb}m", "--memory-swap", f"{memory_mb}m"]
        if cpu > 0:
            args += ["--cpus", f"{cpu:g}"]
        if cgroup_parent:
            args += ["--cgroup-parent", cgroup_parent]
        if shm_mb > 0:
            args += ["--shm-size", f"{shm_mb}m"]
        return self._run([*args, "--", image, *command]).stdout.strip().splitlines()[-1]

    def start(self, name: str) -> None:
        self._run(["start", name])

    def inspect(self, name: str) -> ContainerState | None:
        """The container's state, or None if the engine has no such container."""
        proc = self._run(["container", "inspect", name], check=False)
        if proc.returncode != 0:
            if "no such" in (proc.stderr + proc.stdout).lower():
                return None
            raise EngineError(f"{self.kind} inspect {name} failed: {proc.stderr.strip()}")
        data = json.loads(proc.stdout)[0]
        st = data.get("State", {})
        cfg = data.get("Config", {})
        host = data.get("HostConfig", {})
        return ContainerState(
            id=str(data.get("Id", "")),
            name=str(data.get("Name", "")).lstrip("/"),
            status=str(st.get("Status", "")),
            running=bool(st.get("Running")) or bool(st.get("Paused")),
            pid=int(st.get("Pid") or 0),
            exit_code=int(st.get("ExitCode") or 0),
            oom_killed=bool(st.get("OOMKilled")),
            labels=dict(cfg.get("Labels") or {}),
            cgroup_parent=str(host.get("CgroupParent") or ""),
            conmon_pid=int(st.get("ConmonPid") or 0),
        )

    def find(self, label: str, value: str) -> list[str]:
        """Names of all containers (any state) with label ``label=value``."""
        out = self._run(
            ["ps", "-a", "--filter", f"label={label}={value}", "--format", "{{.Names}}"]
        ).stdout
        return [n.strip() for n in out.splitlines() if n.strip()]

    def kill(self, name: str, sig: str, *, timeout: float = KILL_TIMEOUT_S) -> bool:
        """Send ``sig`` (``TERM``/``KILL``) to the container; a stopped one is not an error.
        Returns False when the engine failed or gave no answer in ``timeout`` seconds (the
        caller then signals the container's cgroup itself)."""
        try:
            return (
                self._run(["kill", "--signal", sig, name], check=False, timeout=timeout).returncode
                == 0
            )
        except EngineError as exc:
            logger.warning("%s kill --signal %s %s: %s", self.kind, sig, name, exc)
            return False

    def remove(self, name: str, *, attempts: int = REMOVE_ATTEMPTS) -> bool:
        """Remove the container (forcefully, no stop timeout: ``rm --force --time 0`` with
        podman); a missing one is not an error. Tried up to ``attempts`` times,
        :data:`REMOVE_RETRY_S` apart, while the engine fails or still lists it (an engine
        whose monitor died can fail the first ``rm``). Returns whether it is gone."""
        args = ["rm", "--force", *(["--time", "0"] if self.kind == "podman" else []), name]
        for i in range(max(1, attempts)):
            if i:
                time.sleep(REMOVE_RETRY_S)
            try:
                self._run(args, check=False)
                if self.inspect(name) is None:
                    return True
            except EngineError as exc:
                logger.warning(
                    "%s rm %s (try %d of %d): %s", self.kind, name, i + 1, attempts, exc
                )
        logger.error("%s: container %s could not be removed", self.kind, name)
        return False

    def follow_logs(self, name: str, log_path: Path) -> subprocess.Popen[bytes]:
        """Append the container's stdout+stderr to ``log_path`` until it ends.

        The follower is in its own session: it outlives a crashed agent."""
        with open(log_path, "ab") as f:
            return subprocess.Popen(
                [*self.argv0, "logs", "--follow", name],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.state_dir,
                start_new_session=True,
            )
