"""The ``container`` runtime: attempts of jobs with an ``image`` run as OCI containers.

Everything that talks to the container engine goes through :class:`ContainerEngine`, a thin
adapter over the engine's CLI: podman by default (daemonless; this build runs it as
``podman --runtime runc --cgroup-manager cgroupfs`` with its own ``containers.conf``, so no
global configuration is needed), docker when the agent runs with ``--runtime docker``.

One attempt (:class:`ContainerRuntime`):

* **pull** (timed, a phase of its own): skipped when the engine already has the image
  (``warm``), else ``pull`` (``cold``). Registries on loopback are pulled with
  ``--tls-verify=false``.
* **create**: name = run_id; labels ``gpufleet.run_id``, ``gpufleet.job_id``,
  ``gpufleet.token``; ``--init`` (so SIGTERM reaches the command even as PID 1);
  ``--network host``; the attempt's checkpoints/artifacts/resume/work directories
  bind-mounted at :data:`MOUNTS` with the ``GPUFLEET_*_DIR`` variables pointing at them;
  ``memory_mb`` -> ``--memory``, ``cpu`` -> ``--cpus``; ``--user uid:gid`` = the attempt's job
  user (when the agent can switch users); the job's GPUs by their CDI names
  (``--device nvidia.com/gpu=<index>``) when the node has a CDI spec for NVIDIA GPUs. The
  environment is the job's own plus the platform's (never the agent's), passed in a 0600 env
  file deleted after create. ``CUDA_VISIBLE_DEVICES`` is the reservation's host indexes
  without CDI, and ``0..n-1`` with CDI (the container then only has those devices, renumbered);
  ``GPUFLEET_GPU_IDS`` always holds the host indexes. A failed pull is the job's fault when
  the image does not exist, is not authorised or is malformed (:class:`ImageUnavailable`),
  else the node's (``StartError.node_fault``; docs/design/runtime.md has the table).
* **start**, then ``logs --follow`` appends the container's output to the attempt's
  ``output.log`` (the agent's LogStreamer mirrors that file to the object store). The follower
  runs in its own session, so it keeps logging while a crashed agent is restarted.
* **poll**: the end is seen when the log follower exits (cheap), or by ``inspect`` at most
  every :data:`INSPECT_EVERY_S` seconds while a follower runs (every
  :data:`INSPECT_NO_FOLLOWER_S` without one; each ``inspect`` costs tens of ms of CPU).
  Exit code and OOM come from ``inspect`` (``State.OOMKilled``; on cgroup v1 hosts where the
  engine does not report it, exit 137 with the container's memory cgroup having reached its
  limit also counts as OOM).
* **stop** (seed DD5): ``kill --signal TERM``, ``rec.stop_grace_s`` seconds of grace,
  ``kill --signal KILL`` (re-sent every second), *verified gone* = the engine says the
  container is not running; then its exit is saved to ``exit.json`` and it is removed
  (``rm``) before the attempt is reported, so its GPUs are released only after that.
* **adopt** after an agent restart: ``ps -a --filter label=gpufleet.run_id=<run_id>``; an
  attempt logged ``assigned`` but not ``started`` whose container exists is adopted, never
  started a second time; with no container it is abandoned (NEVER_STARTED).

The start phases (``pull_s``, ``create_s``, ``start_s``, ``image``: warm/cold) are kept on the
handle (:attr:`ContainerHandle.phases`), logged with the ``started`` event and reported to the
controller with the confirmation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from gpufleet.agent import procfs
from gpufleet.agent.runtime.base import (
    KILL_RESEND_S,
    KILL_VERIFY_TIMEOUT_S,
    OOM_KILLED,
    ExitInfo,
    JobUser,
    Launch,
    RunHandle,
    StartError,
)
from gpufleet.agent.workdir import RunPaths

logger = logging.getLogger("gpufleet.agent")

ENGINES = ("podman", "docker")
PULL_TIMEOUT_S = 1800.0
CLI_TIMEOUT_S = 60.0
INSPECT_EVERY_S = 10.0
INSPECT_NO_FOLLOWER_S = 1.0
INSPECT_STOPPING_S = 0.2
LOG_DRAIN_TIMEOUT_S = 5.0
OOM_USAGE_FRACTION = 0.98
LABEL_RUN = "gpufleet.run_id"
LABEL_JOB = "gpufleet.job_id"
LABEL_TOKEN = "gpufleet.token"

MOUNTS: Mapping[str, str] = {
    "checkpoints": "/gpufleet/checkpoints",
    "artifacts": "/gpufleet/artifacts",
    "resume": "/gpufleet/resume",
    "work": "/gpufleet/work",
}
"""Where the attempt's directories appear inside the container."""

CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
CDI_GPU_KIND = "nvidia.com/gpu"

_PODMAN_CONF = """\
# Written by the gpufleet agent; used through CONTAINERS_CONF for its own podman calls only.
[containers]
default_ulimits = []
[engine]
events_logger = "file"
"""


class EngineError(Exception):
    """The engine CLI failed (message: the command and its stderr)."""


class ImageUnavailable(EngineError):
    """The registry answered that the image does not exist or may not be pulled (not found,
    unauthorised, denied) or the reference is malformed: the job's fault, not the node's."""


# Substrings of the engines' pull errors that mean "this image, as named, cannot be had"
# (podman/containers-image and docker wordings). Anything else -- the registry unreachable,
# a TLS or network error, a timeout, the engine's storage failing -- is the node's fault.
IMAGE_UNAVAILABLE_MARKERS = (
    "manifest unknown",
    "name unknown",
    "not found",
    "repository does not exist",
    "requested access to the resource is denied",
    "unauthorized",
    "authentication required",
    "invalid reference format",
    "short-name",
    "no such host",
)


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


_COMMAND_PROBLEMS = (
    "executable file not found",
    "no such file or directory",
    "permission denied",
    "not a directory",
)
"""Start errors caused by the job's command or working dir (exec inside the container)."""


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
            raise EngineError(f"{self.kind} {args[0]}: no answer in {timeout:g} s") from exc
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

    def has_image(self, image: str) -> bool:
        if self.kind == "podman":
            return self._run(["image", "exists", image], check=False).returncode == 0
        return self._run(["image", "inspect", image], check=False).returncode == 0

    def pull(self, image: str, timeout: float = PULL_TIMEOUT_S) -> None:
        """Pull ``image``.

        Raises:
            ImageUnavailable: the registry says the image does not exist or is not
                authorised, or the reference is malformed (see ``IMAGE_UNAVAILABLE_MARKERS``).
            EngineError: anything else (registry unreachable, timeout, engine failure).
        """
        args = ["pull"]
        if self.kind == "podman":
            args.append("--quiet")
            if _is_loopback_registry(image):
                args.append("--tls-verify=false")
        try:
            self._run([*args, image], timeout=timeout)
        except ImageUnavailable:
            raise
        except EngineError as exc:
            text = str(exc).lower()
            if any(m in text for m in IMAGE_UNAVAILABLE_MARKERS):
                raise ImageUnavailable(str(exc)) from exc
            raise

    def ensure_present(self, image: str) -> bool:
        """Pull ``image`` unless present; True if it was pulled."""
        if self.has_image(image):
            return False
        self.pull(image)
        return True

    def images(self) -> list[ImageInfo]:
        """Local images with a name (dangling ones are left out)."""
        out = self._run(["images", "--format", "json"]).stdout
        result: list[ImageInfo] = []
        if self.kind == "podman":
            for img in json.loads(out or "[]"):
                for name in img.get("Names") or []:
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
        self._run(["rmi", "--force", image], check=False)

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
    ) -> str:
        """Create (not start) a container; returns its id. ``user``: ``uid:gid`` (and
        ``--group-add`` is not used: supplementary groups stay the image's)."""
        args = ["create", "--name", name, "--init", "--network", "host"]
        args += ["--env-file", str(env_file), "--workdir", workdir]
        if user:
            args += ["--user", user]
        for k, v in labels.items():
            args += ["--label", f"{k}={v}"]
        for host, inside, ro in mounts:
            args += ["--volume", f"{host}:{inside}{':ro' if ro else ''}"]
        for dev in devices:
            args += ["--device", dev]
        if memory_mb > 0:
            args += ["--memory", f"{memory_mb}m", "--memory-swap", f"{memory_mb}m"]
        if cpu > 0:
            args += ["--cpus", f"{cpu:g}"]
        if cgroup_parent:
            args += ["--cgroup-parent", cgroup_parent]
        return self._run([*args, image, *command]).stdout.strip().splitlines()[-1]

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


def cdi_gpu_spec_present(dirs: Iterable[Path] = CDI_DIRS) -> bool:
    """Whether a CDI spec for ``nvidia.com/gpu`` devices is installed on this node
    (``nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml``)."""
    for d in dirs:
        try:
            files = sorted(d.iterdir())
        except OSError:
            continue
        for f in files:
            if f.suffix not in (".yaml", ".yml", ".json"):
                continue
            with contextlib.suppress(OSError):
                text = f.read_text()
                if "nvidia.com" in text and "gpu" in text:
                    return True
    return False


@dataclass(slots=True, kw_only=True)
class ContainerHandle(RunHandle):
    """A live container attempt (the stop progress fields are :class:`RunHandle`'s).

    ``phases``: start phases in seconds (``pull_s``, ``create_s``, ``start_s``) and ``image``
    (``warm``/``cold``); empty for an adopted attempt. ``pid`` is the container's init as
    the host sees it.
    """

    runtime: ClassVar[str] = "container"
    name: str
    container_id: str = ""
    phases: dict[str, Any] = field(default_factory=dict)
    memory_mb: int = 0
    paths: RunPaths | None = None
    logs: subprocess.Popen[bytes] | None = None
    logs_pid: int = 0
    logs_start_ticks: int = 0
    next_inspect_at: float = 0.0
    follower_done: bool = False

    def log_fields(self) -> dict[str, Any]:
        """JSON fields for the ``started`` event of the assignment log."""
        return {
            "pid": self.pid,
            "boot_id": self.boot_id,
            "runtime_state": {
                "runtime": "container",
                "name": self.name,
                "container_id": self.container_id,
                "logs_pid": self.logs_pid,
                "logs_start_ticks": self.logs_start_ticks,
                "phases": self.phases,
                "memory_mb": self.memory_mb,
            },
        }


@dataclass(frozen=True, slots=True)
class ContainerLaunch:
    """What :meth:`ContainerRuntime.spawn` needs (the container subset of a runtime launch).

    ``env``: the job's environment plus the platform's variables (host paths; rewritten to
    :data:`MOUNTS` here). ``workdir``: the working directory *inside the image* ("" = the
    attempt's work directory mounted at ``/gpufleet/work``). ``user``: who the command runs
    as (``--user uid:gid``); None, or a user the agent cannot switch to, = the image's user.
    """

    paths: RunPaths
    image: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    gpu_ids: tuple[int, ...] = ()
    memory_mb: int = 0
    cpu: float = 0.0
    workdir: str = ""
    resume_dir: Path | None = None
    user: JobUser | None = None


class ContainerRuntime:
    """Attempts as containers (see the module doc).

    Args:
        engine: the engine adapter.
        cdi: pass GPUs as CDI devices (default: whether the node has an NVIDIA CDI spec).
        pull_timeout_s: bound on the pull phase.
    """

    kind = "container"

    def __init__(
        self,
        engine: ContainerEngine,
        *,
        cdi: bool | None = None,
        pull_timeout_s: float = PULL_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.cdi = cdi_gpu_spec_present() if cdi is None else cdi
        self.pull_timeout_s = pull_timeout_s

    def describe(self) -> str:
        gpus = "CDI nvidia.com/gpu" if self.cdi else "CUDA_VISIBLE_DEVICES only (no CDI spec)"
        return f"{self.engine.kind}; GPUs: {gpus}"

    # ------------------------------------------------------------------ start

    def ensure_image(self, image: str) -> tuple[str, float]:
        """Pull ``image`` unless present. Returns (``"warm"``/``"cold"``, seconds)."""
        t0 = time.monotonic()
        if self.engine.has_image(image):
            return "warm", time.monotonic() - t0
        self.engine.pull(image, timeout=self.pull_timeout_s)
        return "cold", time.monotonic() - t0

    def container_env(self, launch: ContainerLaunch) -> dict[str, str]:
        """The environment inside the container (directory variables point at the mounts)."""
        env = dict(launch.env)
        env["GPUFLEET_CHECKPOINT_DIR"] = MOUNTS["checkpoints"]
        env["GPUFLEET_ARTIFACTS_DIR"] = MOUNTS["artifacts"]
        env["GPUFLEET_RESUME_FROM"] = MOUNTS["resume"] if launch.resume_dir is not None else ""
        env["GPUFLEET_GPU_IDS"] = ",".join(str(i) for i in launch.gpu_ids)
        if self.cdi:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(launch.gpu_ids)))
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in launch.gpu_ids)
        return env

    def spawn(self, rec: Any, launch: Launch | ContainerLaunch) -> ContainerHandle:
        """Pull, create and start the attempt's container (once per run_id).

        ``rec`` needs ``run_id``, ``job_id``, ``token`` (and ``image``, ``env``,
        ``working_dir`` when ``launch`` is not a :class:`ContainerLaunch`). ``launch`` is a
        :class:`ContainerLaunch` or the agent runtime interface's ``Launch`` (``paths``,
        ``command``, ``env``, ``memory_mb``, ``cpu``, ``gpu_ids``, ``resume_dir``; see
        :func:`launch_of`).

        Raises:
            StartError: pull, create or start failed; no container of it is left.
        """
        if not isinstance(launch, ContainerLaunch):
            launch = launch_of(rec, launch)
        paths = launch.paths
        name = rec.run_id
        phases: dict[str, Any] = {}
        try:
            warmth, pull_s = self.ensure_image(launch.image)
        except ImageUnavailable as exc:  # the job named an image it cannot have
            raise StartError(f"cannot pull image {launch.image!r}: {exc}") from exc
        except EngineError as exc:  # registry unreachable, engine broken: the node's fault
            raise StartError(
                f"cannot pull image {launch.image!r}: {exc}", node_fault=True
            ) from exc
        phases.update(image=warmth, pull_s=round(pull_s, 4))
        env = self.container_env(launch)
        bad = [k for k, v in env.items() if "\n" in v or "\n" in k or "=" in k or not k]
        if bad:
            raise StartError(
                f"env {bad[0]!r}: a container's variable names cannot be empty or hold '=' or "
                "newlines, and values cannot hold newlines"
            )
        # the engine reads a KEY=value file, deleted right after create
        env_file = paths.root / "container.env"
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in env.items())
        mounts = [
            (paths.checkpoints, MOUNTS["checkpoints"], False),
            (paths.artifacts, MOUNTS["artifacts"], False),
            (paths.work, MOUNTS["work"], False),
        ]
        if launch.resume_dir is not None:
            mounts.append((launch.resume_dir, MOUNTS["resume"], True))
        devices = [f"{CDI_GPU_KIND}={i}" for i in launch.gpu_ids] if self.cdi else []
        labels = {LABEL_RUN: rec.run_id, LABEL_JOB: rec.job_id, LABEL_TOKEN: str(rec.token)}
        cgroup_parent = (
            f"/gpufleet/{name}" if self.engine.kind == "podman" and launch.memory_mb > 0 else ""
        )
        t0 = time.monotonic()
        try:
            cid = self.engine.create(
                name=name,
                image=launch.image,
                command=launch.command,
                env_file=env_file,
                labels=labels,
                mounts=mounts,
                workdir=launch.workdir or MOUNTS["work"],
                devices=devices,
                memory_mb=launch.memory_mb,
                cpu=launch.cpu,
                cgroup_parent=cgroup_parent,
                user=f"{launch.user.uid}:{launch.user.gid}"
                if launch.user is not None and launch.user.switch
                else "",
            )
        except EngineError as exc:
            self.engine.remove(name)
            raise StartError(f"cannot create the container: {exc}", node_fault=True) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                env_file.unlink()
        t1 = time.monotonic()
        phases["create_s"] = round(t1 - t0, 4)
        try:
            self.engine.start(name)
        except EngineError as exc:
            # the command not found in the image, or not executable, fails here too (the
            # OCI runtime's exec): the job's fault, unlike the engine failing
            self.engine.remove(name)
            text = str(exc).lower()
            job = any(m in text for m in _COMMAND_PROBLEMS)
            raise StartError(f"cannot start the container: {exc}", node_fault=not job) from exc
        phases["start_s"] = round(time.monotonic() - t1, 4)
        h = ContainerHandle(
            name=name,
            container_id=cid,
            boot_id=procfs.boot_id(),
            phases=phases,
            memory_mb=launch.memory_mb,
            paths=paths,
        )
        st = self.engine.inspect(name)
        h.pid = st.pid if st is not None else 0
        self._follow(h, paths)
        logger.info(
            "run %s: container %s started (%s image, pull %.3f s, create %.3f s, start %.3f s)",
            name,
            cid[:12],
            warmth,
            phases["pull_s"],
            phases["create_s"],
            phases["start_s"],
        )
        return h

    def _follow(self, h: ContainerHandle, paths: RunPaths) -> None:
        h.logs = self.engine.follow_logs(h.name, paths.log)
        h.logs_pid = h.logs.pid
        h.logs_start_ticks = procfs.start_ticks(h.logs.pid) or 0

    # ------------------------------------------------------------------ restart

    def resolve_unstarted(self, rec: Any, paths: RunPaths) -> ContainerHandle | None:
        """An attempt logged ``assigned`` but not ``started``: adopt its container if one was
        created (start it if it was only created), else None (it never starts)."""
        names = self.engine.find(LABEL_RUN, rec.run_id)
        if not names:
            return None
        st = self.engine.inspect(names[0])
        if st is None:
            return None
        if st.status in ("created", "configured"):
            self.engine.start(names[0])
            st = self.engine.inspect(names[0]) or st
        h = ContainerHandle(name=names[0], container_id=st.id, pid=st.pid, paths=paths)
        h.boot_id = procfs.boot_id()
        self._follow(h, paths)
        return h

    def adopt(self, rec: Any, paths: RunPaths) -> ContainerHandle:
        """A handle for a logged, started container attempt (no side effects but resuming
        the log follower if it died with the agent)."""
        state = getattr(rec, "runtime_state", None) or {}
        h = ContainerHandle(
            name=str(state.get("name") or rec.run_id),
            container_id=str(state.get("container_id", "")),
            pid=int(getattr(rec, "pid", 0) or 0),
            boot_id=str(getattr(rec, "boot_id", "") or ""),
            phases=dict(state.get("phases") or {}),
            memory_mb=int(state.get("memory_mb") or 0),
            logs_pid=int(state.get("logs_pid") or 0),
            logs_start_ticks=int(state.get("logs_start_ticks") or 0),
            paths=paths,
        )
        if not (h.logs_pid and procfs.is_same_process_alive(h.logs_pid, h.logs_start_ticks)):
            st = self.engine.inspect(h.name)
            if st is not None and st.running:
                # Lines written while no follower ran are skipped: resume from now on.
                with open(paths.log, "ab") as f:
                    f.write(b"[gpufleet: agent restarted; log follow resumed]\n")
                h.logs = self.engine.follow_logs(h.name, paths.log)
                h.logs_pid = h.logs.pid
                h.logs_start_ticks = procfs.start_ticks(h.logs.pid) or 0
        return h

    # ------------------------------------------------------------------ watch and stop

    def poll(
        self, rec: Any, h: RunHandle, now: float, paths: RunPaths | None = None
    ) -> ExitInfo | None:
        """One monitoring step (stop protocol and end detection; see the module doc).

        ``rec`` needs ``run_id``, ``stop_requested``, ``stop_reason``, ``stop_grace_s``.

        Returns:
            How it ended, once the container is verified not running and removed; else None.
        """
        if not isinstance(h, ContainerHandle):
            raise TypeError(f"run {rec.run_id}: not a container handle: {type(h).__name__}")
        paths = paths or h.paths
        if paths is None:
            raise ValueError(f"run {rec.run_id}: container handle without paths")
        if rec.stop_requested and h.term_sent_at is None:
            logger.info(
                "run %s: SIGTERM to container %s (%s)", rec.run_id, h.name, rec.stop_reason
            )
            self.engine.kill(h.name, "TERM")
            h.term_sent_at = now
            h.next_inspect_at = 0.0
        if (
            h.kill_sent_at is None
            and h.term_sent_at is not None
            and now - h.term_sent_at >= rec.stop_grace_s
        ):
            logger.warning(
                "run %s: container alive after %g s grace: SIGKILL", rec.run_id, rec.stop_grace_s
            )
            self.engine.kill(h.name, "KILL")
            h.kill_sent_at = h.kill_resent_at = now
            h.next_inspect_at = 0.0
        if not h.follower_done and self._follower_done(h):
            h.follower_done = True  # the container has most likely ended: look now
            h.next_inspect_at = 0.0
        if now < h.next_inspect_at:
            return None
        if h.term_sent_at is not None:
            every = INSPECT_STOPPING_S
        elif h.follower_done or (h.logs is None and not h.logs_pid):
            every = INSPECT_NO_FOLLOWER_S
        else:
            every = INSPECT_EVERY_S
        h.next_inspect_at = now + every
        st = self.engine.inspect(h.name)
        if st is not None and st.running:
            if h.kill_sent_at is not None:
                if now - (h.kill_resent_at or now) >= KILL_RESEND_S:
                    self.engine.kill(h.name, "KILL")
                    h.kill_resent_at = now
                if now - h.kill_sent_at >= KILL_VERIFY_TIMEOUT_S and not h.unkillable:
                    h.unkillable = True
                    logger.error("run %s: container survives SIGKILL", rec.run_id)
            return None
        h.main_exited = True
        self._drain_logs(h)
        info = self._exit_info(rec, h, st, paths)
        if st is not None:
            self.engine.remove(h.name)
        self._remove_cgroup(h.name)
        h.unkillable = False
        return info

    def _follower_done(self, h: ContainerHandle) -> bool:
        if h.logs is not None:
            return h.logs.poll() is not None
        if h.logs_pid:
            return not procfs.is_same_process_alive(h.logs_pid, h.logs_start_ticks)
        return False

    def _drain_logs(self, h: ContainerHandle) -> None:
        """Let the follower write the last lines (it exits once the container has)."""
        if h.logs is not None:
            try:
                h.logs.wait(timeout=LOG_DRAIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                h.logs.kill()
                h.logs.wait()
            return
        deadline = time.monotonic() + LOG_DRAIN_TIMEOUT_S
        while h.logs_pid and procfs.is_same_process_alive(h.logs_pid, h.logs_start_ticks):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(h.logs_pid, signal.SIGKILL)
                break
            time.sleep(0.05)

    def _exit_info(
        self, rec: Any, h: ContainerHandle, st: ContainerState | None, paths: RunPaths
    ) -> ExitInfo:
        saved = _read_json(paths.exit_file)
        if st is None and saved is not None and "exit_code" in saved:
            # Removed by an earlier pass that died before its report was logged.
            return ExitInfo(
                int(saved["exit_code"]),
                float(saved.get("finished_at_s", time.time())),
                message=str(saved.get("message", "")),
                reason=str(saved.get("reason", "")),
            )
        if st is None:
            return ExitInfo(
                -signal.SIGKILL, time.time(), message="the container disappeared; exit status lost"
            )
        code = st.exit_code
        reason, message = "", ""
        oom = st.oom_killed or (
            code == 128 + signal.SIGKILL
            and h.kill_sent_at is None
            and self._cgroup_hit_limit(h.name, h.memory_mb)
        )
        if oom:
            reason, message = OOM_KILLED, "killed by the memory limit (memory_mb)"
        elif h.kill_sent_at is not None and h.term_sent_at is not None and code == 137:
            message = f"killed with SIGKILL after {rec.stop_grace_s:g} s grace"
        if oom:
            code = -signal.SIGKILL
        info = ExitInfo(code, time.time(), message=message, reason=reason)
        with contextlib.suppress(OSError):
            paths.exit_file.write_text(
                json.dumps(
                    {
                        "exit_code": info.exit_code,
                        "finished_at_s": info.finished_at_s,
                        "message": info.message,
                        "reason": info.reason,
                    }
                )
            )
        return info

    @staticmethod
    def _cgroup_hit_limit(name: str, memory_mb: int) -> bool:
        """cgroup v1 (podman does not report OOMKilled there): the memory cgroup the agent put
        the container under (``/gpufleet/<run_id>``) peaked at the job's limit."""
        if memory_mb <= 0:
            return False
        try:
            peak = int(
                Path(
                    f"/sys/fs/cgroup/memory/gpufleet/{name}/memory.max_usage_in_bytes"
                ).read_text()
            )
        except (OSError, ValueError):
            return False
        return peak >= OOM_USAGE_FRACTION * (memory_mb << 20)

    @staticmethod
    def _remove_cgroup(name: str) -> None:
        for ctl in ("memory", "cpu", "cpuacct", "pids", "blkio", "cpuset", "devices", "freezer"):
            base = Path("/sys/fs/cgroup") / ctl / "gpufleet" / name
            if not base.is_dir():
                continue
            for sub in sorted(base.glob("**/"), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    sub.rmdir()

    def release(self, rec: Any) -> None:
        """Remove the attempt's container and cgroup if anything is left (idempotent).
        ``rec``: a run_id or a record with ``run_id``."""
        run_id = rec if isinstance(rec, str) else rec.run_id
        self.engine.remove(run_id)
        self._remove_cgroup(run_id)


def launch_of(rec: Any, launch: Launch) -> ContainerLaunch:
    """A :class:`ContainerLaunch` from the runtime interface's runtime-neutral ``Launch``.

    Of ``launch.env`` (built for a host process) only the job's own variables (``rec.env``)
    and the platform's (``GPUFLEET_*``, ``CUDA_*``) go into the container: the host's ``PATH``,
    ``HOME`` and the like would break the image. ``rec.working_dir`` is a directory inside the
    image; ``launch.cwd`` (a host path) is not used.
    """
    own = set(getattr(rec, "env", None) or {})
    env = {k: v for k, v in launch.env.items() if k in own or k.startswith(("GPUFLEET_", "CUDA_"))}
    return ContainerLaunch(
        paths=launch.paths,
        image=rec.image,
        command=tuple(launch.command),
        env=env,
        gpu_ids=tuple(launch.gpu_ids),
        memory_mb=int(launch.memory_mb),
        cpu=float(launch.cpu),
        workdir=getattr(rec, "working_dir", "") or "",
        resume_dir=launch.resume_dir,
        user=launch.user,
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class ImageReporter:
    """The node's local images for heartbeats (DD9) and pre-pulls asked by the controller.

    The list is re-read from the engine at most every ``refresh_s`` seconds, and on the next
    call after :meth:`mark_dirty` (a container start or a pull). Pre-pulls run one at a time in
    a background thread; a failed pull is logged and retried only when asked again.
    """

    def __init__(self, engine: ContainerEngine, refresh_s: float = 30.0) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._images: list[ImageInfo] | None = None
        self._read_at = 0.0
        self._pulling: set[str] = set()

    def mark_dirty(self) -> None:
        self._read_at = 0.0

    def images(self) -> list[ImageInfo] | None:
        """The current list, or None when the engine could not be asked."""
        now = time.monotonic()
        with self._lock:
            if self._images is None or now - self._read_at >= self.refresh_s or not self._read_at:
                try:
                    self._images = self.engine.images()
                except (EngineError, ValueError) as exc:
                    logger.warning("cannot list local images: %s", exc)
                    return None
                self._read_at = now
            return list(self._images)

    def prepull(self, images: Iterable[str]) -> None:
        """Pull each image not already present or being pulled, in the background."""
        with self._lock:
            todo = [i for i in images if i and i not in self._pulling]
            self._pulling.update(todo)
        for image in todo:
            threading.Thread(
                target=self._pull, args=(image,), name="agent-prepull", daemon=True
            ).start()

    def _pull(self, image: str) -> None:
        try:
            if not self.engine.has_image(image):
                t0 = time.monotonic()
                self.engine.pull(image)
                logger.info("pre-pulled %s in %.1f s", image, time.monotonic() - t0)
        except EngineError as exc:
            logger.warning("pre-pull of %s failed: %s", image, exc)
        finally:
            with self._lock:
                self._pulling.discard(image)
            self.mark_dirty()
