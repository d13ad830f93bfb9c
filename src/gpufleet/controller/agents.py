"""gRPC clients for node agents (controller -> agent calls), one channel per (node, address).

With TLS credentials, each channel presents the controller certificate and accepts only a
server certificate naming that node (``<node>.node.gpufleet``): work and its secrets go only
to the node they were placed on, even if another node registered the same address."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any

import grpc

from gpufleet.rpc import tls
from gpufleet.rpc.channel_options import CLIENT_OPTIONS
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc

RPC_TIMEOUT_S = 5.0
log = logging.getLogger("gpufleet.controller")


class _FaultInterceptor(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """TEST HOOK (tests/chaos): ``GPUFLEET_FAULT_RPC="drop=0.1,delay_ms=200"`` makes every
    controller->agent call fail with UNAVAILABLE with probability ``drop`` (before it is sent,
    or after it was answered: a lost reply), and wait a random 0..``delay_ms`` ms first.
    ``assign_hold_ms=N`` holds every AssignJob exactly N ms after its request was built and
    before it is sent (its deadline starts at the send): a deposed leader's late AssignJob
    (tests/e2e/test_fencing_late_assign.py). Read once at import; unset (production) it is
    never installed."""

    def __init__(self, spec: str) -> None:
        opts = dict(kv.split("=", 1) for kv in spec.split(",") if "=" in kv)
        self.drop = float(opts.get("drop", 0))
        self.delay_s = float(opts.get("delay_ms", 0)) / 1000.0
        self.assign_hold_s = float(opts.get("assign_hold_ms", 0)) / 1000.0
        self.rng = random.Random()

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if self.assign_hold_s and str(getattr(details, "method", "")).endswith("/AssignJob"):
            log.warning(
                "holding AssignJob %s for %.0f ms (GPUFLEET_FAULT_RPC test hook)",
                getattr(request, "run_id", "?"),
                self.assign_hold_s * 1000,
            )
            time.sleep(self.assign_hold_s)
        if self.delay_s:
            time.sleep(self.rng.uniform(0, self.delay_s))
        r = self.rng.random()
        if r < self.drop / 2:
            raise _Dropped()
        lost_reply = r < self.drop
        outcome = continuation(details, request)
        if lost_reply:
            outcome.result()  # the agent acted on it; the controller never hears back
            raise _Dropped()
        return outcome


class _Dropped(grpc.RpcError):  # type: ignore[misc]
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "dropped by GPUFLEET_FAULT_RPC (test hook)"


_FAULT_RPC = os.environ.get("GPUFLEET_FAULT_RPC", "")


class AgentClients:
    """``credentials``: the controller's TLS client credentials; None = plaintext
    (``--insecure``)."""

    def __init__(self, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._lock = threading.Lock()
        self._credentials = credentials
        self._stubs: dict[tuple[str, str], tuple[grpc.Channel, pb_grpc.AgentStub]] = {}

    def stub(self, node_id: str, address: str) -> pb_grpc.AgentStub:
        with self._lock:
            found = self._stubs.get((node_id, address))
            if found is None:
                if self._credentials is None:
                    channel = grpc.insecure_channel(address, options=list(CLIENT_OPTIONS))
                else:
                    channel = tls.secure_channel(
                        address, self._credentials, tls.node_target_name(node_id)
                    )
                if _FAULT_RPC:
                    channel = grpc.intercept_channel(channel, _FaultInterceptor(_FAULT_RPC))
                found = (channel, pb_grpc.AgentStub(channel))
                self._stubs[(node_id, address)] = found
            return found[1]

    def assign(self, node_id: str, address: str, req: pb.AssignJobRequest) -> pb.AssignJobResponse:
        """Raises grpc.RpcError when the agent cannot be reached (or is not ``node_id``)."""
        stub = self.stub(node_id, address)
        resp: pb.AssignJobResponse = stub.AssignJob(req, timeout=RPC_TIMEOUT_S)
        return resp

    def stop(self, node_id: str, address: str, req: pb.StopRunRequest) -> pb.StopRunResponse:
        stub = self.stub(node_id, address)
        resp: pb.StopRunResponse = stub.StopRun(req, timeout=RPC_TIMEOUT_S)
        return resp

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
