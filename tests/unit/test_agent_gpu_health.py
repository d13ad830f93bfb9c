"""GPU health checks against a stand-in for the NVML driver (this machine has no GPU; NVML is
the one true external edge here). The stand-in keeps NVML's call shapes: handles by UUID,
ECC counters, pending page retirement, and an XID event set polled with a zero timeout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gpufleet.agent.gpu_health import CHECK_EVERY_S, GpuHealth
from gpufleet.domain.types import GpuDevice


class NVMLError(Exception):
    pass


@dataclass
class Event:
    device: str
    eventData: int


@dataclass
class FakeNvml:
    ecc: dict[str, int] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    events: list[Event] = field(default_factory=list)
    init_fails: bool = False
    calls: int = 0
    nvmlEventTypeXidCriticalError: int = 8

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise NVMLError("Driver Not Loaded")

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, handle: str, kinds: int, events: str) -> None:
        assert kinds == self.nvmlEventTypeXidCriticalError and events == "set"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.calls += 1
        if uuid in self.lost:
            raise NVMLError("GPU is lost")
        return uuid

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        return handle.encode()

    def nvmlDeviceGetTotalEccErrors(self, handle: str, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)  # uncorrected, volatile
        return self.ecc.get(handle, 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: str) -> int:
        return int(handle in self.pending)

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> Event:
        assert timeout_ms == 0  # never blocks a heartbeat
        if not self.events:
            raise NVMLError("Timeout")
        return self.events.pop(0)


GPUS = [GpuDevice(i, f"GPU-{i}", "H100", 81559) for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def health(nvml: Any) -> tuple[GpuHealth, Clock]:
    clock = Clock()
    return GpuHealth(GPUS, nvml, clock=clock), clock


def test_healthy_gpus_report_nothing() -> None:
    checker, _ = health(FakeNvml())
    assert checker.problem() is None


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ({"ecc": {"GPU-2": 3}}, "GPU 2 (GPU-2): 3 uncorrectable ECC error(s)"),
        ({"lost": {"GPU-1"}}, "GPU 1 (GPU-1): unavailable (GPU is lost)"),
        ({"pending": {"GPU-3"}}, "GPU 3 (GPU-3): memory page retirement pending"),
    ],
)
def test_each_device_fault_is_named(fault: dict[str, Any], expected: str) -> None:
    checker, _ = health(FakeNvml(**fault))
    problem = checker.problem()
    assert problem is not None and problem.startswith(expected), problem


def test_a_critical_xid_sticks_and_application_xids_do_not_count() -> None:
    nvml = FakeNvml(events=[Event("GPU-0", 13), Event("GPU-0", 31)])
    checker, clock = health(nvml)
    assert checker.problem() is None  # 13 and 31 are the job's own faults
    nvml.events = [Event("GPU-2", 79)]  # fallen off the bus
    clock.now += CHECK_EVERY_S
    assert checker.problem() == "GPU 2: critical XID 79 (see the driver's log)"
    clock.now += CHECK_EVERY_S
    assert checker.problem() == "GPU 2: critical XID 79 (see the driver's log)"  # sticky


def test_nvml_is_asked_at_most_every_interval() -> None:
    nvml = FakeNvml()
    checker, clock = health(nvml)
    checker.problem()
    after_first = nvml.calls
    nvml.ecc["GPU-0"] = 1
    assert checker.problem() is None  # the cached answer, no NVML calls
    assert nvml.calls == after_first
    clock.now += CHECK_EVERY_S
    assert "uncorrectable ECC" in (checker.problem() or "")


def test_no_checks_for_declared_gpus_or_without_a_driver() -> None:
    assert GpuHealth.for_inventory(GPUS, "declared").problem() is None
    checker, _ = health(FakeNvml(init_fails=True))
    assert checker.problem() is None
