"""The ``container`` runtime: attempts of jobs with an ``image`` run as OCI containers.

Everything that talks to the container engine goes through :class:`.ContainerEngine`, a thin
adapter over the engine's CLI: podman by default (daemonless; this build runs it as
``podman --runtime runc --cgroup-manager cgroupfs`` with its own ``containers.conf``, so no
global configuration is needed), docker when the agent runs with ``--runtime docker``.

One attempt (:class:`ContainerRuntime`):

* **pull** (timed, a phase of its own): skipped when the engine already has the image
  (``warm``), else ``pull`` (``cold``). Registries on loopback are pulled with
  ``--tls-verify=false``.
* **create**: name = run_id; labels ``gpufleet.run_id``, ``gpufleet.job_id``,
  ``gpufleet.token``; ``--init`` (so SIGTERM reaches the command even as PID 1);
  ``--network ns:/run/netns/<the attempt's namespace>`` (:mod:`.jobnet`; ``host`` without
  job namespaces, for gang members, and with docker); the attempt's
  checkpoints/artifacts/resume/work directories bind-mounted at :data:`.MOUNTS` with the
  ``GPUFLEET_*_DIR`` variables pointing at them;
  ``memory_mb`` -> ``--memory``, ``cpu`` -> ``--cpus``; ``--user uid:gid`` = the attempt's job
  user (when the agent can switch users); the job's GPUs by their CDI names
  (``--device nvidia.com/gpu=<index>``) when the node has a CDI spec for NVIDIA GPUs. The
  environment is the job's own plus the platform's (never the agent's), passed in a 0600 env
  file deleted after create. ``CUDA_VISIBLE_DEVICES`` is the reservation's host indexes
  without CDI, and ``0..n-1`` with CDI (the container then only has those devices, renumbered);
  ``GPUFLEET_GPU_IDS`` always holds the host indexes. Hardening (:meth:`security_for`,
  :class:`.ContainerSecurity`): ``--cap-drop ALL``, ``--security-opt no-new-privileges``,
  ``--pids-limit`` (the job's ``pids_limit``, else the node's), ``nosuid,nodev`` mounts, a
  read-only root filesystem when the node asks, and a user namespace whose root is not host
  root when the engine can run one; a container never runs as host uid 0. A failed pull is the
  job's fault (:class:`.ImageUnavailable`: the reference, the registry's answer, the registry
  unreachable or in the job-egress deny list), and so is a failed create or start, unless the
  node's own check right then fails (:meth:`.ContainerEngine.node_problem`: then
  ``StartError.node_fault``; docs/design/runtime.md has the table).
* **start**, then ``logs --follow`` appends the container's output to the attempt's
  ``output.log`` (the agent's LogStreamer mirrors that file to the object store). The follower
  runs in its own session, so it keeps logging while a crashed agent is restarted.
* **cgroup** (podman, on a node with cgroup containment): the container's ``--cgroup-parent``
  is the attempt's own group under the agent's (:meth:`.Containment.engine_parent`); podman
  puts ``conmon/`` and ``libpod-<id>/`` below it. The agent watches that group itself, as it
  does a process attempt's, and runs podman with an OCI runtime wrapper that saves the
  container group's OOM counters before ``runc delete`` removes it
  (:meth:`.ContainerEngine.keep_oom_counters`).
* **poll**: the end is seen when the log follower exits (cheap), or by ``inspect`` at most
  every :data:`.INSPECT_EVERY_S` seconds while a follower runs (every
  :data:`.INSPECT_NO_FOLLOWER_S` without one; each ``inspect`` costs tens of ms of CPU). A
  container the engine calls running whose conmon is dead and whose cgroup holds no process
  has ended (exit status lost, processes verified gone; podman would say running for good).
  The exit code comes from ``inspect``; OOM is the process runtime's rule
  (:func:`.containment.oom_verdict`: the kernel's OOM-kill counter and a failed command).
* **stop** (seed DD5): ``kill --signal TERM``, ``rec.stop_grace_s`` seconds of grace,
  ``kill --signal KILL`` (re-sent every second; through the cgroup while processes are left
  or when the engine does not answer), *verified gone* = the engine says the container is
  not running, or conmon is dead and the cgroup is empty; then its exit is saved to
  ``exit.json`` and it is removed (``rm --force --time 0``, retried) before the attempt is
  reported, so its GPUs are released only after that.
* **adopt** after an agent restart: ``ps -a --filter label=gpufleet.run_id=<run_id>``; an
  attempt logged ``assigned`` but not ``started`` whose container exists is adopted, never
  started a second time; with no container it is abandoned (NEVER_STARTED).

The start phases (``pull_s``, ``create_s``, ``start_s``, ``image``: warm/cold) are kept on the
handle (:attr:`.ContainerHandle.phases`), logged with the ``started`` event and reported to the
controller with the confirmation.

The code, one module per phase (this module keeps :class:`ContainerRuntime`, which drives
them, and re-exports the others' public names):

* :mod:`.container_engine`: the engine CLI adapter (images, pulls and registries, containers);
* :mod:`.container_spec`: what a container is made of (launch, mounts, labels, GPUs, env);
* :mod:`.container_watch`: the started attempt's handle, polling, stop and exit;
* :mod:`.container_images`: the node's image list and pre-pulls, for heartbeats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.agent import procfs
from gpufleet.agent.runtime.base import OOM_KILLED, ExitInfo, Launch, RunHandle, StartError
from gpufleet.agent.runtime.container_engine import (
    CLI_TIMEOUT_S,
    DEFAULT_PIDS_LIMIT,
    ENGINES,
    IMAGE_UNAVAILABLE_MARKERS,
    PULL_TIMEOUT_S,
    USERNS_HOST_BASE,
    ContainerEngine,
    ContainerSecurity,
    ContainerState,
    EngineError,
    ImageInfo,
    ImageUnavailable,
    PullStopped,
)
from gpufleet.agent.runtime.container_images import ImageReporter
from gpufleet.agent.runtime.container_spec import (
    CDI_DIRS,
    CDI_GPU_KIND,
    LABEL_JOB,
    LABEL_RUN,
    LABEL_TOKEN,
    MOUNTS,
    ContainerLaunch,
    cdi_gpu_spec_present,
    container_env,
    launch_of,
)
from gpufleet.agent.runtime.container_watch import (
    INSPECT_EVERY_S,
    INSPECT_NO_FOLLOWER_S,
    INSPECT_STOPPING_S,
    LOG_DRAIN_TIMEOUT_S,
    LOST_EXIT,
    OOM_USAGE_FRACTION,
    ContainerHandle,
    poll_container,
    remove_cgroup,
)
from gpufleet.agent.runtime.containment import Containment, JobCgroup, remove_engine_parent
from gpufleet.agent.runtime.jobnet import JobNet, attempt_namespace, drop_netns
from gpufleet.agent.workdir import RunPaths

__all__ = [
    "CDI_DIRS",
    "CDI_GPU_KIND",
    "CLI_TIMEOUT_S",
    "DEFAULT_PIDS_LIMIT",
    "ENGINES",
    "IMAGE_UNAVAILABLE_MARKERS",
    "INSPECT_EVERY_S",
    "INSPECT_NO_FOLLOWER_S",
    "INSPECT_STOPPING_S",
    "LABEL_JOB",
    "LABEL_RUN",
    "LABEL_TOKEN",
    "LOG_DRAIN_TIMEOUT_S",
    "LOST_EXIT",
    "MOUNTS",
    "OOM_KILLED",
    "OOM_USAGE_FRACTION",
    "PULL_TIMEOUT_S",
    "USERNS_MODES",
    "ContainerEngine",
    "ContainerHandle",
    "ContainerLaunch",
    "ContainerRuntime",
    "ContainerSecurity",
    "ContainerState",
    "EngineError",
    "ImageInfo",
    "ImageReporter",
    "ImageUnavailable",
    "PullStopped",
    "cdi_gpu_spec_present",
    "launch_of",
]

logger = logging.getLogger("gpufleet.agent")

USERNS_MODES = ("auto", "on", "off")
"""``--container-userns``: ``auto`` = a user namespace when the engine can run one (probed
once at start; else a warning and none), ``on`` = required (container jobs fail to start,
as the node's fault, when the engine cannot), ``off`` = none."""


class ContainerRuntime:
    """Attempts as containers (see the module doc).

    Args:
        engine: the engine adapter.
        cdi: pass GPUs as CDI devices (default: whether the node has an NVIDIA CDI spec).
        pull_timeout_s: bound on the pull phase.
        userns: one of :data:`USERNS_MODES` (only for an agent running as root: a rootless
            engine always runs containers in its own user namespace).
        pids_limit: ``--pids-limit`` of a job that sets no ``pids_limit``; 0 = the engine's.
        read_only: every container's root filesystem read-only (``/tmp`` and the mounts
            stay writable).
        state_dir: where the user-namespace probe writes its throwaway tar (default: a temp
            dir).
        containment: the node's (:func:`.containment.detect`); with cgroups, podman
            containers go under the attempt's group and are watched there (module doc).
            None: the engine's word only.

    Raises:
        ValueError: unknown ``userns`` mode or a negative ``pids_limit``.
    """

    kind = "container"

    def __init__(
        self,
        engine: ContainerEngine,
        *,
        cdi: bool | None = None,
        pull_timeout_s: float = PULL_TIMEOUT_S,
        jobnet: JobNet | None = None,
        userns: str = "auto",
        pids_limit: int = DEFAULT_PIDS_LIMIT,
        read_only: bool = False,
        state_dir: Path | None = None,
        containment: Containment | None = None,
    ) -> None:
        if userns not in USERNS_MODES:
            raise ValueError(f"container userns {userns!r}: use one of {', '.join(USERNS_MODES)}")
        if pids_limit < 0:
            raise ValueError(f"container pids limit {pids_limit}: must be >= 0")
        self.engine = engine
        self.cdi = cdi_gpu_spec_present() if cdi is None else cdi
        self.pull_timeout_s = pull_timeout_s
        # the attempt's own network namespace (podman joins it: --network ns:PATH); docker
        # cannot join a named namespace, so its containers keep the host's (said at start)
        self.jobnet = jobnet if engine.kind == "podman" else None
        # pulls (the runtime's and the prepulls') are refused the job-egress deny list
        engine.jobnet = jobnet

        self.pids_limit = pids_limit
        self.read_only = read_only
        self.containment = (
            containment
            if containment is not None and containment.is_cgroup and engine.kind == "podman"
            else None
        )
        if self.containment is not None:
            bases = [
                self.containment.bases[c]
                for c in ("memory", "unified")
                if c in self.containment.bases
            ]
            engine.keep_oom_counters(bases)
        self.userns = False
        self.userns_problem = ""
        """Why container jobs cannot start here (``--container-userns on`` and the engine
        cannot run a user namespace); "" = none."""
        if userns != "off" and os.geteuid() == 0:
            why = engine.userns_works(state_dir or Path(tempfile.gettempdir()))
            self.userns = not why
            if why and userns == "on":
                self.userns_problem = (
                    f"--container-userns on, but {engine.kind} cannot run a container in a user"
                    f" namespace here: {why}"
                )
                logger.error("%s", self.userns_problem)
            elif why:
                logger.warning(
                    "containers run WITHOUT a user namespace (%s cannot: %s): a job still runs"
                    " as its own uid (never host root) with no capabilities and"
                    " no-new-privileges",
                    engine.kind,
                    why,
                )

    def describe(self) -> str:
        gpus = "CDI nvidia.com/gpu" if self.cdi else "CUDA_VISIBLE_DEVICES only (no CDI spec)"
        userns = (
            "user namespace"
            if self.userns
            else ("the engine's rootless user namespace" if os.geteuid() else "no user namespace")
        )
        net = "the attempt's netns" if self.jobnet and self.jobnet.kind == "netns" else "host"
        return f"{self.engine.kind}; GPUs: {gpus}; {userns}; network: {net}"

    def security_for(self, rec: Any, launch: ContainerLaunch) -> ContainerSecurity:
        """The hardening of one attempt's container: no capabilities, no-new-privileges,
        ``pids_limit`` (the job's ``pids_limit`` when it set one, else the node's), the node's
        read-only choice, and the user namespace keeping the job's uid/gid when it runs as
        its own user."""
        user = launch.user
        keep = (user.uid, user.gid) if user is not None and user.switch else None
        return ContainerSecurity(
            pids_limit=int(getattr(rec, "pids_limit", 0) or 0) or self.pids_limit,
            read_only=self.read_only,
            userns=self.userns,
            keep_ids=keep,
        )

    # ------------------------------------------------------------------ start

    def ensure_image(
        self, image: str, should_stop: Callable[[], bool] | None = None
    ) -> tuple[str, float]:
        """Pull ``image`` unless present (a ``should_stop()`` that turns true ends the pull:
        :class:`.PullStopped`). Returns (``"warm"``/``"cold"``, seconds)."""
        t0 = time.monotonic()
        if self.engine.has_image(image):
            return "warm", time.monotonic() - t0
        self.engine.pull(image, timeout=self.pull_timeout_s, should_stop=should_stop)
        return "cold", time.monotonic() - t0

    def container_env(self, launch: ContainerLaunch) -> dict[str, str]:
        """The environment inside the container (directory variables point at the mounts)."""
        return container_env(launch, cdi=self.cdi)

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
        if self.userns_problem:
            raise StartError(self.userns_problem, node_fault=True)
        paths = launch.paths
        name = rec.run_id
        phases: dict[str, Any] = {}
        try:
            # a stop (cancel, preemption) during the pull ends it: the attempt never started
            warmth, pull_s = self.ensure_image(
                launch.image, should_stop=lambda: bool(getattr(rec, "stop_reason", ""))
            )
        except PullStopped as exc:
            raise StartError(
                f"stopped during the pull of image {launch.image[:120]!r} (never started)"
            ) from exc
        except ImageUnavailable as exc:  # the reference, the registry's answer or reach
            raise StartError(f"cannot pull image {launch.image[:120]!r}: {exc}") from exc
        except EngineError as exc:  # the node's own engine or storage failed
            raise StartError(
                f"cannot pull image {launch.image[:120]!r}: {exc}", node_fault=True
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
        # the attempt's private tmp/ (in its scratch filesystem: bounded by disk_mb) is the
        # container's /tmp and /var/tmp, where jobs write; with the node's read-only root
        # (the default) nothing else of the image is writable but podman's tmpfs /run
        paths.tmp.mkdir(exist_ok=True)  # the runner made it (1777); a bare Launch has none
        os.chmod(paths.tmp, 0o1777)
        mounts += [(paths.tmp, "/tmp", False), (paths.tmp, "/var/tmp", False)]
        # the job's host mounts last (nosuid,nodev like every bind mount; their owners as on
        # the host: never chowned); their targets were checked not to cover the ones above
        job_mounts = [(Path(m.source), m.target, m.read_only) for m in launch.mounts]
        devices = [f"{CDI_GPU_KIND}={i}" for i in launch.gpu_ids] if self.cdi else []
        labels = {LABEL_RUN: rec.run_id, LABEL_JOB: rec.job_id, LABEL_TOKEN: str(rec.token)}
        group = self.group_of(name)
        cgroup_parent = group[0] if group is not None else ""
        netns = attempt_namespace(self.jobnet, rec.run_id, launch.env)
        security = self.security_for(rec, launch)
        user = launch.user
        run_as = f"{user.uid}:{user.gid}" if user is not None and user.switch else ""
        if not run_as and os.geteuid() == 0:
            # jobs as the agent's user (root): a container must still never be host root. In
            # a user namespace its root is host USERNS_HOST_BASE; without one it runs as that
            # uid outright. Its writable directories go to that uid.
            if not security.userns:
                run_as = f"{USERNS_HOST_BASE}:{USERNS_HOST_BASE}"
            for d, _, ro in mounts:  # the attempt's own directories, not the job's mounts
                if not ro:
                    os.chown(d, USERNS_HOST_BASE, USERNS_HOST_BASE)
        t0 = time.monotonic()
        try:
            cid = self.engine.create(
                name=name,
                image=launch.image,
                command=launch.command,
                env_file=env_file,
                labels=labels,
                mounts=[*mounts, *job_mounts],
                workdir=launch.workdir or MOUNTS["work"],
                devices=devices,
                memory_mb=launch.memory_mb,
                cpu=launch.cpu,
                cgroup_parent=cgroup_parent,
                shm_mb=launch.shm_mb,
                user=run_as,
                security=security,
                network=f"ns:{netns.path}" if netns is not None else "host",
            )
        except EngineError as exc:
            self.engine.remove(name)
            drop_netns(self.jobnet, rec.run_id)
            # the job's (the image it named, its config) unless the node's own check fails:
            # the engine's message is never searched for blame (an image's content is in it)
            problem = "" if isinstance(exc, ImageUnavailable) else self.engine.node_problem()
            raise StartError(
                f"cannot create the container: {exc}"
                + (f"; the node's own check: {problem}" if problem else ""),
                node_fault=bool(problem),
            ) from exc
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
            drop_netns(self.jobnet, rec.run_id)
            problem = self.engine.node_problem()
            raise StartError(
                f"cannot start the container: {exc}"
                + (f"; the node's own check: {problem}" if problem else ""),
                node_fault=bool(problem),
            ) from exc
        phases["start_s"] = round(time.monotonic() - t1, 4)
        h = ContainerHandle(
            name=name,
            container_id=cid,
            boot_id=procfs.boot_id(),
            phases=phases,
            memory_mb=launch.memory_mb,
            paths=paths,
        )
        self._watch(h, group)
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

    def group_of(self, run_id: str) -> tuple[str, JobCgroup] | None:
        """The attempt's ``--cgroup-parent`` and its group (None: no cgroup watching)."""
        return self.containment.engine_parent(run_id) if self.containment is not None else None

    def _watch(self, h: ContainerHandle, group: tuple[str, JobCgroup] | None) -> None:
        """Fill in what the agent watches besides the engine: the container's init and conmon
        (pids and start times) and its cgroup."""
        st = self.engine.inspect(h.name)
        h.pid = st.pid if st is not None else 0
        if st is not None and st.conmon_pid:
            h.conmon_pid = st.conmon_pid
            h.conmon_start_ticks = procfs.start_ticks(st.conmon_pid) or 0
        if group is not None:
            h.cgroup_parent, h.cgroup = group
        h.oom_dir = self.engine.oom_dir

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
            drop_netns(self.jobnet, rec.run_id)
            return None
        st = self.engine.inspect(names[0])
        if st is None:
            drop_netns(self.jobnet, rec.run_id)
            return None
        if st.status in ("created", "configured"):
            self.engine.start(names[0])
            st = self.engine.inspect(names[0]) or st
        h = ContainerHandle(name=names[0], container_id=st.id, pid=st.pid, paths=paths)
        h.boot_id = procfs.boot_id()
        group = self.group_of(rec.run_id)
        self._watch(h, group if group is not None and st.cgroup_parent == group[0] else None)
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
            cgroup_parent=str(state.get("cgroup_parent") or ""),
            conmon_pid=int(state.get("conmon_pid") or 0),
            conmon_start_ticks=int(state.get("conmon_start_ticks") or 0),
            oom_dir=self.engine.oom_dir,
        )
        cgroup = state.get("cgroup")
        if isinstance(cgroup, dict):
            h.cgroup = JobCgroup.from_json(cgroup)
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
        """One monitoring step (stop protocol and end detection; see the module doc and
        :func:`.poll_container`).

        ``rec`` needs ``run_id``, ``stop_requested``, ``stop_reason``, ``stop_grace_s``.

        Returns:
            How it ended, once the container is verified not running and removed; else None.
        """
        if not isinstance(h, ContainerHandle):
            raise TypeError(f"run {rec.run_id}: not a container handle: {type(h).__name__}")
        paths = paths or h.paths
        if paths is None:
            raise ValueError(f"run {rec.run_id}: container handle without paths")
        info = poll_container(self.engine, rec, h, now, paths)
        if info is not None:  # the container is gone: so is the use of its namespace
            drop_netns(self.jobnet, rec.run_id)
            group = self.group_of(rec.run_id)
            if group is not None and not info.resources:
                # the --cgroup-parent group outlives the container's own: hierarchical
                # counters (v1 with use_hierarchy, v2 always) hold its processes' use
                info = dataclasses.replace(info, resources=group[1].usage())
        return info

    def release(self, rec: Any) -> None:
        """Remove the attempt's container and cgroup if anything is left (idempotent).
        ``rec``: a run_id or a record with ``run_id``."""
        run_id = rec if isinstance(rec, str) else rec.run_id
        self.engine.remove(run_id)
        state = {} if isinstance(rec, str) else getattr(rec, "runtime_state", None) or {}
        group = self.group_of(run_id)
        parent = str(state.get("cgroup_parent") or "") or (group[0] if group else "")
        if parent:
            remove_engine_parent(parent)
        remove_cgroup(run_id)  # an attempt of an agent that used /gpufleet/<run_id>
        cid = str(state.get("container_id") or "")
        if self.engine.oom_dir is not None and cid:
            with contextlib.suppress(OSError):
                (self.engine.oom_dir / cid).unlink()
        drop_netns(self.jobnet, run_id)
