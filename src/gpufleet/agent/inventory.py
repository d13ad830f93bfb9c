"""What the node offers: its GPUs (from NVML, or declared by the operator), CPU cores and memory.

NVML (``pynvml``, package ``nvidia-ml-py``) is the authority when it initializes and reports at
least one GPU, as Slurm's ``AutoDetect=nvml`` is: a declared spec cannot claim GPUs the driver
does not show. Without NVML (no driver, a laptop, CI, a simulated fleet) the operator declares
the GPUs with a spec such as ``8xH100-80GB`` or ``2xA100-40GB,2xA100-80GB``; the devices are then
numbered 0..n-1 in the order written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpufleet.domain.types import GpuDevice

logger = logging.getLogger("gpufleet.agent")

SOURCE_NVML = "nvml"
SOURCE_DECLARED = "declared"

# "8xH100-80GB": count, "x", type (may itself contain dashes, e.g. A100-SXM4), "-", memory+unit.
_GROUP_RE = re.compile(
    r"^(?:(?P<count>\d+)\s*[xX]\s*)?(?P<type>[A-Za-z0-9][A-Za-z0-9_.\-]*?)"
    r"-(?P<mem>\d+(?:\.\d+)?)\s*(?P<unit>GB|GiB|G|MB|MiB|M|TB|TiB|T)$",
    re.IGNORECASE,
)
# Memory units in MiB. GPU vendors write "80GB" for 80 GiB, so GB is read as GiB.
_UNIT_MIB = {"m": 1, "mb": 1, "mib": 1, "g": 1024, "gb": 1024, "gib": 1024}
_UNIT_MIB.update({"t": 1024 * 1024, "tb": 1024 * 1024, "tib": 1024 * 1024})


@dataclass(frozen=True, slots=True)
class Inventory:
    """The node as registered with the controller.

    Attributes:
        gpus: the GPUs, ``index`` 0..n-1 (the value used in ``CUDA_VISIBLE_DEVICES``).
        source: ``"nvml"`` or ``"declared"``.
        cpu: usable CPU cores.
        memory_mb: host memory, MiB.
        gpu_sharing: whether and how its GPUs may be shared by several jobs (``--gpu-sharing``,
            ``domain.types.GpuSharing``): reported at registration; the node takes GPU shares
            only when it is not ``none``.
    """

    gpus: tuple[GpuDevice, ...]
    source: str
    cpu: float
    memory_mb: int
    gpu_sharing: str = "none"


def parse_gpu_spec(spec: str, node_id: str) -> list[GpuDevice]:
    """Parse a declared GPU spec into devices.

    Args:
        spec: comma-separated groups ``[COUNTx]TYPE-MEMORY``, e.g. ``8xH100-80GB`` or
            ``2xA100-40GB,2xA100-80GB``. Memory units: MB/MiB/M, GB/GiB/G (read as GiB, so
            ``80GB`` is 81920 MiB), TB. A count defaults to 1.
        node_id: used in the synthetic uuids ``declared-{node_id}-{index}``.

    Returns:
        One device per GPU, indexes 0..n-1 in spec order.

    Raises:
        ValueError: the spec (named in the message) is empty or a group is malformed, has a zero
            count or zero memory.
    """
    groups = [g.strip() for g in spec.split(",")]
    if not spec.strip() or any(not g for g in groups):
        raise ValueError(f"invalid GPU spec {spec!r}: expected e.g. '8xH100-80GB'")
    devices: list[GpuDevice] = []
    for group in groups:
        m = _GROUP_RE.match(group)
        if m is None:
            raise ValueError(
                f"invalid GPU spec {spec!r}: group {group!r} is not COUNTxTYPE-MEMORY "
                "(e.g. '8xH100-80GB')"
            )
        count = int(m["count"]) if m["count"] is not None else 1
        memory_mb = int(float(m["mem"]) * _UNIT_MIB[m["unit"].lower()])
        if count < 1 or memory_mb < 1:
            raise ValueError(f"invalid GPU spec {spec!r}: group {group!r} has no GPUs or memory")
        for _ in range(count):
            i = len(devices)
            devices.append(
                GpuDevice(
                    index=i,
                    uuid=f"declared-{node_id}-{i}",
                    gpu_type=m["type"].upper(),
                    memory_mb=memory_mb,
                )
            )
    return devices


def gpu_type_from_name(name: str) -> str:
    """Short GPU type from an NVML product name.

    ``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``, ``"NVIDIA A100-SXM4-40GB"`` -> ``"A100"``,
    ``"NVIDIA GeForce RTX 4090"`` -> ``"RTX4090"``, ``"Tesla V100-SXM2-16GB"`` -> ``"V100"``.
    """
    words = [w for w in name.replace("_", " ").split() if w.upper() not in _VENDOR_WORDS]
    if not words:
        return name.strip().upper() or "UNKNOWN"
    head = words[0].split("-")[0].upper()
    if head in {"RTX", "GTX", "QUADRO", "TITAN"} and len(words) > 1:
        head += words[1].split("-")[0].upper()
    return head


_VENDOR_WORDS = {"NVIDIA", "TESLA", "GEFORCE"}


def nvml_gpus() -> list[GpuDevice] | None:
    """GPUs as NVML sees them, or None when NVML cannot initialize (no driver or library).

    Indexes are NVML's (PCI bus order); the runner sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so
    CUDA numbers devices the same way.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.info("NVML unavailable (%s); using the declared GPU inventory", exc)
        return None
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            devices.append(
                GpuDevice(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    gpu_type=gpu_type_from_name(_text(pynvml.nvmlDeviceGetName(handle))),
                    memory_mb=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20),
                )
            )
        return devices
    except pynvml.NVMLError as exc:
        logger.warning("NVML initialized but listing GPUs failed (%s)", exc)
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def host_cpu() -> float:
    """CPU cores this process may use (its affinity mask), at least 1."""
    try:
        return float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return float(os.cpu_count() or 1)


def host_memory_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Total host memory in MiB, from ``/proc/meminfo`` (``MemTotal``, kB) or ``sysconf``."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    except (ValueError, OSError, AttributeError):
        return 0


def load_inventory(
    node_id: str,
    declared: str | None,
    *,
    probe_nvml: Callable[[], list[GpuDevice] | None] = nvml_gpus,
) -> Inventory:
    """The node's inventory: NVML when it reports GPUs, else the declared spec, else no GPUs.

    Args:
        node_id: this node's id (used in declared uuids).
        declared: a spec for :func:`parse_gpu_spec`, or None.
        probe_nvml: how to ask NVML (a parameter so tests can pin the no-driver case).

    Raises:
        ValueError: ``declared`` is malformed (checked even when NVML wins, so a typo in the
            operator's configuration is never silently ignored).
    """
    declared_gpus = parse_gpu_spec(declared, node_id) if declared is not None else None
    found = probe_nvml()
    if found:
        if declared_gpus is not None:
            logger.warning(
                "NVML reports %d GPU(s); ignoring the declared spec %r", len(found), declared
            )
        gpus, source = found, SOURCE_NVML
    elif declared_gpus is not None:
        gpus, source = declared_gpus, SOURCE_DECLARED
    else:
        logger.warning("no NVML and no declared GPU spec: this node offers no GPUs")
        gpus, source = [], SOURCE_DECLARED
    return Inventory(gpus=tuple(gpus), source=source, cpu=host_cpu(), memory_mb=host_memory_mb())
