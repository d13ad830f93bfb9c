"""Value types shared by every layer: priority classes, resources, the normalized job spec."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpufleet.domain.mounts import Mount


class PriorityClass(enum.StrEnum):
    """Priority class of a job inside its team. Higher rank runs first; preemption is strictly
    by higher rank over lower rank."""

    CRITICAL = "CRITICAL"
    HIGH = "HIGH"
    NORMAL = "NORMAL"
    LOW = "LOW"

    @property
    def rank(self) -> int:
        """3 for CRITICAL down to 0 for LOW."""
        return _RANK[self]


_RANK: Mapping[PriorityClass, int] = MappingProxyType(
    {
        PriorityClass.CRITICAL: 3,
        PriorityClass.HIGH: 2,
        PriorityClass.NORMAL: 1,
        PriorityClass.LOW: 0,
    }
)


@dataclass(frozen=True, slots=True)
class Resources:
    """What one job needs: one node, or a gang of nodes reserved all-or-nothing.

    Attributes:
        gpu_count: GPUs of the whole job (all members together), int >= 1.
        gpu_types: acceptable GPU types in order of preference (e.g. ``("H100", "A100")``);
            empty means any type. A gang never mixes types.
        gpu_memory_mb: minimum memory per GPU, MiB; 0 means any.
        cpu: CPU cores per member (per node), float.
        memory_mb: host memory per member (per node), MiB.
        nodes: members of the gang; None derives it at placement (1 when ``gpu_count`` fits
            one node of the type, else whole nodes of the type); 1 is a single-node job.
        gpus_per_node: GPUs on each member; None derives it (``gpu_count / nodes``).
        allow_partial_nodes: a derived gang may split unevenly (e.g. 12 GPUs as 8 + 4);
            False means whole nodes only.
        gpu_fraction: a share of ONE GPU, 0 < f < 1 (then ``gpu_count`` is 1), in steps the
            fleet allows (``Settings.gpu_fraction_steps``); None: whole GPUs. A share lands
            only on a node whose GPUs are shareable (``GpuSharing``), beside other shares of
            the same GPU, never beside a whole-GPU job (docs/design/allocation.md, "GPU shares").
    """

    gpu_count: int
    gpu_types: tuple[str, ...] = ()
    gpu_memory_mb: int = 0
    cpu: float = 0.0
    memory_mb: int = 0
    nodes: int | None = None
    gpus_per_node: int | None = None
    allow_partial_nodes: bool = False
    gpu_fraction: float | None = None

    @property
    def gpu_milli(self) -> int:
        """The share in thousandths of a GPU (``gpu_fraction`` x 1000, rounded); 0 for a
        whole-GPU job."""
        return milli_of(self.gpu_fraction)

    @property
    def gpus(self) -> float:
        """GPUs this job charges (accounting, fair share, quota): ``gpu_fraction`` for a
        share, else ``gpu_count`` (an int then: whole-GPU arithmetic stays integral)."""
        return self.gpu_fraction if self.gpu_fraction is not None else self.gpu_count


GPU_MILLI = 1000
"""A whole GPU in share units: the database sums shares of one GPU as integers up to this
(``node_gpus.shared_milli``), so that 1/8 + ... + 1/8 is exactly 1 and never 1.0000001."""


SHARED_GPU_HOLDER = "*shared"
"""``node_gpus.holder_run_id`` of a GPU held by share reservations (no run id starts with
``*``): one holder column, so a whole-GPU claim (``holder_run_id IS NULL``) never takes a GPU
holding shares, and a share never lands on a GPU a run holds whole."""


def milli_of(fraction: float | None) -> int:
    """``fraction`` of a GPU in thousandths (0 for None: a whole-GPU job)."""
    return 0 if fraction is None else round(fraction * GPU_MILLI)


DEFAULT_FRACTION_STEPS = 8
"""Shares come in steps of 1/8 GPU unless the fleet says otherwise
(``Settings.gpu_fraction_steps``)."""


def fraction_problem(fraction: float | None, steps: int = DEFAULT_FRACTION_STEPS) -> str | None:
    """Why ``fraction`` is not a share the fleet allows (None: it is, or no fraction):
    0 < f < 1 and a whole number of ``1/steps`` steps. ``steps`` divides :data:`GPU_MILLI`
    (the settings check it), so every allowed share is a whole number of thousandths."""
    if fraction is None:
        return None
    if not 0 < fraction < 1:
        return f"gpu_fraction {fraction:g} is not between 0 and 1 (exclusive)"
    if abs(fraction * steps - round(fraction * steps)) > 1e-9:
        return (
            f"gpu_fraction {fraction:g} is not a multiple of 1/{steps}"
            f" (this fleet shares a GPU in steps of 1/{steps}, e.g. {1 / steps:g})"
        )
    return None


class GpuSharing(enum.StrEnum):
    """How a node's GPUs may be shared (agent ``--gpu-sharing``, reported at registration).

    NONE: whole GPUs only. TIMESLICE: several shares time-slice one GPU (no compute or memory
    isolation). MPS: shares run as clients of the node's MPS control daemon, each limited to
    its fraction of the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``)."""

    NONE = "none"
    TIMESLICE = "timeslice"
    MPS = "mps"


def sharing_of(reported: str) -> GpuSharing:
    """An agent's reported sharing mode; empty (an agent older than the field) or unknown
    (a newer agent's mode this controller does not know) is ``NONE``: whole GPUs only, the
    safe reading."""
    try:
        return GpuSharing(reported) if reported else GpuSharing.NONE
    except ValueError:
        return GpuSharing.NONE


@dataclass(frozen=True, slots=True)
class JobSpec:
    """The normalized, immutable request a user submitted (stored as JSON on the job row)."""

    command: tuple[str, ...]
    resources: Resources
    priority: PriorityClass = PriorityClass.NORMAL
    name: str = ""
    image: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    max_retries: int = 0
    expected_duration_s: float | None = None
    max_runtime_s: float | None = None
    preemptible: bool = True
    node_selector: Mapping[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    """Absolute directory the command starts in (None: the attempt's own work directory)."""
    pids_limit: int | None = None
    """Most processes and threads the job may hold at once on a node (its cgroup's
    ``pids.max``; a container's ``--pids-limit``); None: the node's default."""
    disk_mb: int | None = None
    """Size of the attempt's scratch filesystem (work, checkpoints, artifacts, /tmp), MiB;
    None: the node's default."""
    mounts: tuple[Mount, ...] = ()
    """Host paths mounted into a container job (``domain.mounts``); a process job has none."""
    shm_size_mb: int | None = None
    """Size of the attempt's ``/dev/shm``, MiB; None: ``domain.mounts.default_shm_mb``."""
    notify: tuple[str, ...] = ()
    """Webhook URLs POSTed the job's final record when it ends (``services.notify``);
    empty: its team's default URLs, if any."""


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU on a node: its index (the ``CUDA_VISIBLE_DEVICES`` value), uuid, type, memory."""

    index: int
    uuid: str
    gpu_type: str
    memory_mb: int
