"""The GPUFLEET_FAULT_RPC test hook (controller/agents.py) used by tests/chaos."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from gpufleet.controller.agents import _FaultInterceptor


class _Outcome:
    def result(self) -> str:
        return "answer"


def test_drop_one_fails_every_call_unavailable_and_sometimes_after_it_was_sent() -> None:
    hook = _FaultInterceptor("drop=1,delay_ms=0")
    sent: list[Any] = []

    def call(details: Any, request: Any) -> _Outcome:
        sent.append(request)
        return _Outcome()

    for i in range(200):
        with pytest.raises(grpc.RpcError) as info:
            hook.intercept_unary_unary(call, None, i)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 0 < len(sent) < 200  # some lost before sending, some replies lost


def test_drop_zero_passes_calls_through() -> None:
    hook = _FaultInterceptor("drop=0")
    outcome = hook.intercept_unary_unary(lambda *_: _Outcome(), None, 1)
    assert outcome.result() == "answer"


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method


def test_assign_hold_delays_only_assign_job(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("gpufleet.controller.agents.time.sleep", slept.append)
    hook = _FaultInterceptor("assign_hold_ms=1500")
    hook.intercept_unary_unary(lambda *_: _Outcome(), _Details("/gpufleet.v1.Agent/StopRun"), 1)
    assert slept == []
    outcome = hook.intercept_unary_unary(
        lambda *_: _Outcome(), _Details("/gpufleet.v1.Agent/AssignJob"), 1
    )
    assert slept == [1.5]
    assert outcome.result() == "answer"
