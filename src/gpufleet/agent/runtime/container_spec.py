"""What a container attempt is made of: its launch, its mounts, labels, GPUs and environment.

:class:`ContainerLaunch` is what :meth:`.ContainerRuntime.spawn` needs (:func:`launch_of`
derives it from the runtime interface's ``Launch``). Inside the container the attempt's
directories are bind-mounted at :data:`MOUNTS` and the ``GPUFLEET_*_DIR`` variables point at
them (:func:`container_env`); the container carries the :data:`LABEL_RUN`, :data:`LABEL_JOB`
and :data:`LABEL_TOKEN` labels (found again by them after an agent restart); GPUs are passed as
CDI devices (``nvidia.com/gpu=<index>``) when the node has a CDI spec for NVIDIA GPUs
(:func:`cdi_gpu_spec_present`), with ``CUDA_VISIBLE_DEVICES`` renumbered ``0..n-1``, else
only ``CUDA_VISIBLE_DEVICES`` names the reservation's host indexes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.agent.runtime.base import JobUser, Launch
from gpufleet.agent.workdir import CHECKPOINT_DONE_NAME, RunPaths
from gpufleet.domain.mounts import Mount

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


@dataclass(frozen=True, slots=True)
class ContainerLaunch:
    """What :meth:`.ContainerRuntime.spawn` needs (the container subset of a runtime launch).

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
    mounts: tuple[Mount, ...] = ()
    """The job's host mounts (already allowed by the node, sources resolved)."""
    shm_mb: int = 0
    """``/dev/shm`` size, MiB (``--shm-size``); 0 = the engine's default."""


def container_env(launch: ContainerLaunch, *, cdi: bool) -> dict[str, str]:
    """The environment inside the container (directory variables point at the mounts);
    ``cdi``: the GPUs are passed as CDI devices."""
    env = dict(launch.env)
    env["GPUFLEET_CHECKPOINT_DIR"] = MOUNTS["checkpoints"]
    env["GPUFLEET_ARTIFACTS_DIR"] = MOUNTS["artifacts"]
    env["GPUFLEET_RESUME_FROM"] = MOUNTS["resume"] if launch.resume_dir is not None else ""
    env["GPUFLEET_CHECKPOINT_DONE"] = f"{MOUNTS['work']}/{CHECKPOINT_DONE_NAME}"
    env["GPUFLEET_GPU_IDS"] = ",".join(str(i) for i in launch.gpu_ids)
    if cdi:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(launch.gpu_ids)))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in launch.gpu_ids)
    return env


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
        mounts=tuple(launch.mounts),
        shm_mb=int(launch.shm_mb),
    )
