"""How soon a gRPC client gets through again after its server was down, with gRPC's default
channel options and with the agent's (``gpufleet.rpc.channel_options.CLIENT_OPTIONS``).

A real gRPC server (a ControllerServicer answering Heartbeat) on a loopback port is stopped
for each outage length and started again on the same port; two clients, one per option set,
call Heartbeat every 0.1 s throughout (without ``wait_for_ready``, as the agent calls). The
table gives, per outage, the seconds from the server listening again to each client's first
answered call (median and max of ``--repeats`` runs).

    .venv/bin/python benchmarks/agent_reconnect.py                 # outages 5, 20, 45 s
    .venv/bin/python benchmarks/agent_reconnect.py --outages 3,12 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time
from concurrent import futures
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc loads: no GOAWAY lines

import grpc

from gpufleet.rpc.channel_options import CLIENT_OPTIONS, SERVER_OPTIONS
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Answer(pb_grpc.ControllerServicer):
    def Heartbeat(self, request: Any, context: Any) -> pb.HeartbeatResponse:  # noqa: ARG002
        return pb.HeartbeatResponse(leader_epoch=1)


def _serve(port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=list(SERVER_OPTIONS))
    pb_grpc.add_ControllerServicer_to_server(_Answer(), server)  # type: ignore[abstract]
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def _caller(stub: pb_grpc.ControllerStub, ok_at: list[float], stop: threading.Event) -> None:
    while not stop.wait(0.1):
        try:
            stub.Heartbeat(pb.HeartbeatRequest(node_id="bench"), timeout=2)
            ok_at.append(time.monotonic())
        except grpc.RpcError:
            pass


def one(outage_s: float) -> dict[str, float]:
    port = free_port()
    server = _serve(port)
    channels = {
        "grpc defaults": grpc.insecure_channel(f"127.0.0.1:{port}"),
        "CLIENT_OPTIONS": grpc.insecure_channel(f"127.0.0.1:{port}", options=list(CLIENT_OPTIONS)),
    }
    stop = threading.Event()
    oks: dict[str, list[float]] = {k: [] for k in channels}
    threads = [
        threading.Thread(
            target=_caller, args=(pb_grpc.ControllerStub(c), oks[k], stop), daemon=True
        )
        for k, c in channels.items()
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    server.stop(grace=0).wait()
    time.sleep(outage_s)
    server = _serve(port)
    back = time.monotonic()
    deadline = back + 180
    while time.monotonic() < deadline and not all(any(t >= back for t in v) for v in oks.values()):
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    server.stop(grace=0).wait()
    for c in channels.values():
        c.close()
    return {
        k: min((t for t in v if t >= back), default=float("inf")) - back for k, v in oks.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outages", default="5,20,45", help="outage lengths, seconds")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    print("| outage (s) | grpc defaults: s to first answer (median / max) | CLIENT_OPTIONS |")
    print("|---|---|---|")
    for outage in (float(x) for x in args.outages.split(",")):
        runs = [one(outage) for _ in range(args.repeats)]
        cells = []
        for key in ("grpc defaults", "CLIENT_OPTIONS"):
            values = [r[key] for r in runs]
            cells.append(f"{statistics.median(values):.2f} / {max(values):.2f}")
        print(f"| {outage:.0f} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
