"""GPU inventory: declared specs, NVML product names, the fallback when NVML is absent."""

from __future__ import annotations

import pytest

from gpufleet.agent.inventory import gpu_type_from_name, load_inventory, parse_gpu_spec
from gpufleet.domain.types import GpuDevice


class TestParseGpuSpec:
    @pytest.mark.parametrize(
        ("spec", "want"),
        [
            pytest.param("8xH100-80GB", [("H100", 81920)] * 8, id="count x type - memory"),
            pytest.param(
                "2xA100-40GB,2xA100-80GB",
                [("A100", 40960)] * 2 + [("A100", 81920)] * 2,
                id="comma list",
            ),
            pytest.param("L4-24GB", [("L4", 24576)], id="count defaults to 1"),
            pytest.param(
                " 2 x a100-sxm4-40gb ",
                [("A100-SXM4", 40960)] * 2,
                id="dashes in the type, spaces and case",
            ),
            pytest.param("1xRTX4090-24576MB", [("RTX4090", 24576)], id="memory in MB"),
            pytest.param("1xH200-141GiB", [("H200", 144384)], id="GiB"),
        ],
    )
    def test_valid_specs(self, spec: str, want: list[tuple[str, int]]) -> None:
        gpus = parse_gpu_spec(spec, "n1")
        assert [(g.gpu_type, g.memory_mb) for g in gpus] == want
        assert [g.index for g in gpus] == list(range(len(want)))
        assert [g.uuid for g in gpus] == [f"declared-n1-{i}" for i in range(len(want))]

    @pytest.mark.parametrize(
        "spec",
        [
            pytest.param("", id="empty"),
            pytest.param("8xH100", id="no memory"),
            pytest.param("0xH100-80GB", id="zero count"),
            pytest.param("8xH100-0GB", id="zero memory"),
            pytest.param("8xH100-80XB", id="unknown unit"),
            pytest.param("8xH100-80GB,", id="trailing comma"),
            pytest.param("eight x H100-80GB", id="count not a number"),
        ],
    )
    def test_bad_specs_raise_naming_the_spec(self, spec: str) -> None:
        with pytest.raises(ValueError, match="invalid GPU spec") as err:
            parse_gpu_spec(spec, "n1")
        assert repr(spec) in str(err.value)


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("NVIDIA L4", "L4"),
    ],
)
def test_gpu_type_from_nvml_name(name: str, want: str) -> None:
    assert gpu_type_from_name(name) == want


class TestLoadInventory:
    def test_without_nvml_the_declared_spec_is_used(self) -> None:
        inv = load_inventory("n1", "2xA100-40GB", probe_nvml=lambda: None)
        assert inv.source == "declared"
        assert len(inv.gpus) == 2
        assert inv.cpu >= 1
        assert inv.memory_mb > 0

    def test_without_nvml_or_spec_the_node_has_no_gpus(self) -> None:
        inv = load_inventory("n1", None, probe_nvml=lambda: None)
        assert (inv.gpus, inv.source) == ((), "declared")

    def test_nvml_wins_over_a_declared_spec(self) -> None:
        real = [GpuDevice(index=0, uuid="GPU-abc", gpu_type="H200", memory_mb=143771)]
        inv = load_inventory("n1", "8xH100-80GB", probe_nvml=lambda: real)
        assert (inv.gpus, inv.source) == (tuple(real), "nvml")

    def test_a_bad_spec_fails_even_when_nvml_would_win(self) -> None:
        with pytest.raises(ValueError, match="8xH100"):
            load_inventory("n1", "8xH100", probe_nvml=lambda: [])

    def test_on_this_machine_nvml_absent_falls_back_gracefully(self) -> None:
        inv = load_inventory("n1", "1xT4-16GB")  # the real probe: NVML may or may not exist
        assert inv.source in {"nvml", "declared"}
        assert inv.gpus
