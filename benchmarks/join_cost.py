"""What a Join costs the controller: a bad token (refused before the CSR is parsed or
signed) against a good one (signed and recorded), over a real TLS join port on SQLite.

    python benchmarks/join_cost.py [--calls 200]

Prints a table: per kind, calls, p50 and p99 latency (ms) at the client and the CPU time
the server process spent per call (ms; this process serves the port, so it is
``time.process_time`` minus the client's share, an upper bound).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from concurrent import futures
from functools import partial
from pathlib import Path

import grpc

from gpufleet.controller.identity import BootstrapServicer, ControllerTls, NodeAuthenticator
from gpufleet.rpc import tls
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import node_identity
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q / 100))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # one refusal line a minute anyway
    tmp = Path(tempfile.mkdtemp(prefix="join-cost-"))
    db = Database(f"sqlite:///{tmp / 'db.sqlite'}")
    migrate(db)
    tls.init_ca(tmp / "pki")
    ctl = ControllerTls(tmp / "pki", [])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_BootstrapServicer_to_server(
        BootstrapServicer(db, ctl.ca, NodeAuthenticator(db), 3600.0), server
    )
    port = server.add_secure_port("127.0.0.1:0", ctl.server_credentials(require_client_auth=False))
    server.start()
    stub = pb_grpc.BootstrapStub(
        tls.secure_channel(
            f"127.0.0.1:{port}", tls.channel_credentials(ctl.ca_pem), tls.CONTROLLER_NAME
        )
    )
    csrs = [tls.make_csr(tls.new_key(), f"b{i}") for i in range(args.calls)]  # before timing
    tokens = [
        db.run_write(partial(node_identity.create_join_token, node_id=f"b{i}", ttl_s=600))[0]
        for i in range(args.calls)
    ]
    rows = []
    for kind in ("bad token", "good token"):
        lat: list[float] = []
        cpu0 = time.process_time()
        for i in range(args.calls):
            token = "not-a-token" if kind == "bad token" else tokens[i]
            req = pb.JoinRequest(token=token, node_id=f"b{i}", csr_pem=csrs[i])
            t0 = time.perf_counter()
            try:
                stub.Join(req, timeout=10)
            except grpc.RpcError as exc:
                if kind != "bad token" or exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                    raise
            lat.append((time.perf_counter() - t0) * 1000)
        cpu = (time.process_time() - cpu0) * 1000 / args.calls
        rows.append((kind, args.calls, _pct(lat, 50), _pct(lat, 99), cpu))
    server.stop(grace=0)
    print(f"{'join':<12} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/call':>12}")
    for kind, n, p50, p99, cpu in rows:
        print(f"{kind:<12} {n:>6} {p50:>8.2f} {p99:>8.2f} {cpu:>12.2f}")


if __name__ == "__main__":
    main()
