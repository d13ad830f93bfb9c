"""The agent's NVML sampling of each attempt's GPUs (``agent.gpu_usage``), with a stand-in
for the ``pynvml`` module: this machine has no GPU, NVML is the one true external edge."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gpufleet.agent.gpu_usage import GpuSampler
from gpufleet.agent.outbox import _resources
from gpufleet.controller.servicer import _resources as received
from gpufleet.rpc.protos import fleet_pb2 as pb

GIB = 1024**3


class FakeNvml:
    """``pynvml``'s calls the sampler makes; ``util``/``used`` per GPU index, changeable."""

    def __init__(self, util: dict[int, int], used: dict[int, int], fail: bool = False) -> None:
        self.util, self.used, self.fail, self.inits = util, used, fail, 0

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index not in self.util:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=self.util[handle], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(used=self.used[handle], total=80 * GIB, free=0)


def test_mean_utilization_and_peak_memory_per_attempt() -> None:
    nvml = FakeNvml({0: 100, 1: 50, 2: 10}, {0: 10 * GIB, 1: 5 * GIB, 2: GIB})
    clock = [0.0]
    s = GpuSampler(nvml, every_s=5.0, clock=lambda: clock[0])
    assert s.enabled and nvml.inits == 1
    s.sample([("r1", [0, 1]), ("r2", [2])])  # r1: 75% and 15 GiB
    nvml.util[0], nvml.used[0] = 0, 20 * GIB
    s.sample([("r1", [0, 1])])  # within every_s: skipped
    clock[0] = 5.0
    s.sample([("r1", [0, 1])])  # r1: 25% and 25 GiB
    assert s.take("r1") == {"gpu_util_pct": 50.0, "gpu_mem_peak_bytes": 25 * GIB}
    assert s.take("r1") == {}  # forgotten once taken
    assert s.take("r2") == {"gpu_util_pct": 10.0, "gpu_mem_peak_bytes": GIB}


def test_no_nvml_or_a_failing_one_measures_nothing() -> None:
    off = GpuSampler(None)
    off.sample([("r1", [0])])
    assert not off.enabled and off.take("r1") == {}
    assert GpuSampler.for_inventory("declared").enabled is False
    broken = GpuSampler(FakeNvml({}, {}, fail=True))
    assert not broken.enabled
    flaky = GpuSampler(FakeNvml({0: 90}, {0: GIB}))
    flaky.sample([("r1", [0, 7])])  # GPU 7 is gone: the sample is skipped, not a zero
    assert flaky.take("r1") == {}


def test_figures_cross_the_report_unchanged_and_absent_ones_stay_absent() -> None:
    sent = _resources({"peak_rss_bytes": 210 * 1024 * 1024, "cpu_seconds": 1.5})
    assert sent is not None
    req = pb.ReportCompletionRequest(run_id="r", resources=sent)
    back = pb.ReportCompletionRequest.FromString(req.SerializeToString())
    assert received(back) == {"peak_rss_bytes": 210 * 1024 * 1024, "cpu_seconds": 1.5}
    assert _resources({}) is None
    assert received(pb.ReportCompletionRequest(run_id="r")) is None
    gpu = _resources({"gpu_util_pct": 0.0, "gpu_mem_peak_bytes": 0})
    assert received(pb.ReportCompletionRequest(resources=gpu)) == {
        "gpu_util_pct": 0.0,
        "gpu_mem_peak_bytes": 0,
    }
