"""The container engine's CLI behind one adapter: the only code of the agent that runs it.

:class:`ContainerEngine` wraps podman (the default; daemonless, run here as
``podman --runtime runc --cgroup-manager cgroupfs`` with the agent's own ``containers.conf``, so
no global configuration is needed) or docker (``gpufleet agent --runtime docker``): images
(present?, pull, list, remove) and containers (create, start, inspect, find by label, kill,
remove, follow logs). Registries on loopback are pulled with ``--tls-verify=false``. A failed
pull is :class:`ImageUnavailable` (the job's fault) when the engine's message says the image
does not exist, is not authorised or is malformed (:data:`IMAGE_UNAVAILABLE_MARKERS`), else
:class:`EngineError` (the node's). What the runtime does with these calls is in
:mod:`gpufleet.agent.runtime.container`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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
        network: str = "host",
    ) -> str:
        """Create (not start) a container; returns its id. ``user``: ``uid:gid`` (and
        ``--group-add`` is not used: supplementary groups stay the image's). ``network``:
        the ``--network`` value (``ns:/run/netns/NAME``: the attempt's namespace)."""
        args = ["create", "--name", name, "--init", "--network", network]
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
