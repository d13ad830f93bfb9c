"""gRPC clients for node agents (controller -> agent calls), one channel per agent address."""

from __future__ import annotations

import threading

import grpc

from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc

RPC_TIMEOUT_S = 5.0


class AgentClients:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.AgentStub]] = {}

    def stub(self, address: str) -> pb_grpc.AgentStub:
        with self._lock:
            found = self._stubs.get(address)
            if found is None:
                channel = grpc.insecure_channel(address)
                found = (channel, pb_grpc.AgentStub(channel))
                self._stubs[address] = found
            return found[1]

    def assign(self, address: str, req: pb.AssignJobRequest) -> pb.AssignJobResponse:
        """Raises grpc.RpcError when the agent cannot be reached."""
        resp: pb.AssignJobResponse = self.stub(address).AssignJob(req, timeout=RPC_TIMEOUT_S)
        return resp

    def stop(self, address: str, req: pb.StopRunRequest) -> pb.StopRunResponse:
        resp: pb.StopRunResponse = self.stub(address).StopRun(req, timeout=RPC_TIMEOUT_S)
        return resp

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
