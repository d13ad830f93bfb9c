"""``gpufleet why --suggest`` prints the ``gpufleet update`` flags that apply each change."""

from __future__ import annotations

from gpufleet.cli.jobs import _update_flags


def test_update_flags_of_each_kind() -> None:
    assert _update_flags({"gpu_count": 4}) == "--gpus 4"
    assert _update_flags({"gpu_types": ["A100"]}) == "--gpu-type A100"
    assert _update_flags({"max_runtime_s": 3300.0}) == "--time 55m"
    assert _update_flags({"priority": "HIGH"}) == "--priority HIGH"
