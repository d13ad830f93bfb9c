"""Job runtimes of the agent: one interface (:mod:`.base`), one module per backend.

* ``process`` (:mod:`.process`): the command as a host process under a per-attempt shim,
  contained in its own cgroup where the node allows it (:mod:`.containment`).
* ``container`` (:mod:`.container`): an OCI engine (podman/docker), registered by the agent
  unless ``gpufleet agent --runtime none`` or the engine is not installed.

:class:`Runtimes` picks one per job: ``container`` when the job has an ``image``, ``process``
otherwise, and after a restart the one that started the attempt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpufleet.agent.runtime.base import (
    NO_CONTAINER_RUNTIME,
    ExitInfo,
    JobUser,
    Launch,
    RunHandle,
    Runtime,
    StartError,
)

if TYPE_CHECKING:
    from gpufleet.agent.assignment_log import RunRecord

__all__ = [
    "ExitInfo",
    "JobUser",
    "Launch",
    "RunHandle",
    "Runtime",
    "Runtimes",
    "StartError",
]


class Runtimes:
    """The runtimes registered on this node.

    Args:
        process: the host-process runtime (always present).
        container: the container runtime, or None when the node has no engine.
    """

    def __init__(self, process: Runtime, container: Runtime | None = None) -> None:
        self.process = process
        self.container = container

    def for_job(self, rec: RunRecord) -> Runtime:
        """The runtime that must start ``rec``.

        Raises:
            StartError: the job has an image and no container runtime is registered.
        """
        if rec.image:
            if self.container is None:
                raise StartError(NO_CONTAINER_RUNTIME)
            return self.container
        return self.process

    def for_record(self, rec: RunRecord) -> Runtime:
        """The runtime that started (or was starting) ``rec``, for adoption after a restart.

        Attempts logged before runtimes were recorded are process attempts.

        Raises:
            StartError: it was started by a container runtime this agent no longer has.
        """
        kind = rec.runtime or "process"
        if kind == "container":
            if self.container is None:
                raise StartError(NO_CONTAINER_RUNTIME)
            return self.container
        return self.process

    def describe(self) -> str:
        """One line: each runtime's description."""
        parts = [f"process: {self.process.describe()}"]
        parts.append(
            f"container: {self.container.describe()}" if self.container else "container: none"
        )
        return "; ".join(parts)
