"""The container engine's CLI behind one adapter: the only code of the agent that runs it.

:class:`ContainerEngine` wraps podman (the default; daemonless, run here as
``podman --runtime runc --cgroup-manager cgroupfs`` with the agent's own ``containers.conf``, so
no global configuration is needed) or docker (``gpufleet agent --runtime docker``): images
(present?, pull, list, remove) and containers (create, start, inspect, find by label, kill,
remove, follow logs). Registries on loopback are pulled with ``--tls-verify=false``. An image
reference always follows ``--`` on the engine's command line (it can never be read as an
option), and one that is not a valid OCI reference is refused before any call
(:class:`ImageUnavailable`). A failed pull is :class:`ImageUnavailable` (the job's fault:
the image does not exist, is not authorised, the registry cannot be reached or is too slow)
unless the engine's message says the node's own engine or storage failed
(:data:`NODE_FAULT_MARKERS`: then :class:`EngineError`, the node's). What the runtime does with
these calls is in :mod:`gpufleet.agent.runtime.container`; the hardening flags of ``create``
are :class:`ContainerSecurity`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.domain.images import reference_problem

ENGINES = ("podman", "docker")
PULL_TIMEOUT_S = 1800.0
CLI_TIMEOUT_S = 60.0

_PODMAN_CONF = """\
# Written by the gpufleet agent; used through CONTAINERS_CONF for its own podman calls only.
[containers]
default_ulimits = []
[engine]
events_logger = "file"
"""


class EngineError(Exception):
    """The engine CLI failed (message: the command and its stderr)."""


class EngineTimeout(EngineError):
    """The engine CLI gave no answer in time."""


class ImageUnavailable(EngineError):
    """The image, as the job names it, cannot be had: a malformed reference, the registry's
    answer (not found, manifest unknown, unauthorised, denied), the registry unreachable or
    too slow. The job's fault (it uses a retry), never the node's."""


# Substrings of the engines' messages that mean the node's own engine or storage failed
# (podman/containers-storage and docker wordings): only these make a failed pull the node's
# fault. Everything else a pull can meet -- the reference, the registry's answer, the registry
# unreachable, TLS, DNS, a timeout -- is about the image the job named.
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
        read_only: ``--read-only`` root filesystem (the bind mounts stay writable; ``/tmp``
            is a tmpfs with the mode of the image's ``/tmp``).
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
        args.append("--read-only")  # podman: /tmp, /var/tmp and /run become tmpfs
        if kind != "podman":
            args += ["--tmpfs", "/tmp"]
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
        if kind == "podman":
            conf = state_dir / "containers.conf"
            state_dir.mkdir(parents=True, exist_ok=True)
            if not conf.exists() or conf.read_text() != _PODMAN_CONF:
                conf.write_text(_PODMAN_CONF)
            self.env["CONTAINERS_CONF"] = str(conf)
            self.argv0 += ["--runtime", "runc", "--cgroup-manager", "cgroupfs"]

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

    def has_image(self, image: str) -> bool:
        """Whether the engine holds ``image`` (False for an invalid reference)."""
        if reference_problem(image) is not None:
            return False
        if self.kind == "podman":
            return self._run(["image", "exists", "--", image], check=False).returncode == 0
        return self._run(["image", "inspect", "--", image], check=False).returncode == 0

    def pull(self, image: str, timeout: float = PULL_TIMEOUT_S) -> None:
        """Pull ``image``.

        Raises:
            ImageUnavailable: the reference is invalid, the registry refuses it (not found,
                unauthorised), cannot be reached or gives no answer in ``timeout`` seconds:
                the job's fault.
            EngineError: the node's own engine or storage failed (``NODE_FAULT_MARKERS``, or
                the engine CLI cannot be run).
        """
        self.check_reference(image)
        args = ["pull"]
        if self.kind == "podman":
            args.append("--quiet")
            if _is_loopback_registry(image):
                args.append("--tls-verify=false")
        try:
            self._run([*args, "--", image], timeout=timeout)
        except EngineTimeout as exc:  # a registry that crawls: about the image named
            raise ImageUnavailable(str(exc)) from exc
        except EngineError as exc:
            if isinstance(exc.__cause__, OSError) or node_fault_text(str(exc)):
                raise
            raise ImageUnavailable(str(exc)) from exc

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
    ) -> str:
        """Create (not start) a container; returns its id. ``user``: ``uid:gid`` (and
        ``--group-add`` is not used: supplementary groups stay the image's). ``security``:
        its hardening flags (default :class:`ContainerSecurity`: no capabilities,
        no-new-privileges, the default pids limit). ``network``: the ``--network`` value
        (``ns:/run/netns/NAME``: the attempt's namespace). Bind mounts are ``nosuid,nodev``
        (podman). The image follows ``--``.

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
        )

    def find(self, label: str, value: str) -> list[str]:
        """Names of all containers (any state) with label ``label=value``."""
        out = self._run(
            ["ps", "-a", "--filter", f"label={label}={value}", "--format", "{{.Names}}"]
        ).stdout
        return [n.strip() for n in out.splitlines() if n.strip()]

    def kill(self, name: str, sig: str) -> None:
        """Send ``sig`` (``TERM``/``KILL``) to the container; a stopped one is not an error."""
        self._run(["kill", "--signal", sig, name], check=False)

    def remove(self, name: str) -> None:
        """Remove the container (forcefully); a missing one is not an error."""
        self._run(["rm", "--force", name], check=False)

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
                start_new_session=True,
            )
