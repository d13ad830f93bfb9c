"""Value types shared by every layer: priority classes, resources, the normalized job spec."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


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
    """What one job needs on one node (all-or-nothing on a single node).

    Attributes:
        gpu_count: GPUs, int >= 1.
        gpu_types: acceptable GPU types in order of preference (e.g. ``("H100", "A100")``);
            empty means any type.
        gpu_memory_mb: minimum memory per GPU, MiB; 0 means any.
        cpu: CPU cores, float.
        memory_mb: host memory, MiB.
    """

    gpu_count: int
    gpu_types: tuple[str, ...] = ()
    gpu_memory_mb: int = 0
    cpu: float = 0.0
    memory_mb: int = 0


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


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU on a node: its index (the ``CUDA_VISIBLE_DEVICES`` value), uuid, type, memory."""

    index: int
    uuid: str
    gpu_type: str
    memory_mb: int
