"""Many hollow node agents in one process: ``python -m gpufleet.agent.hollow --count N ...``.

Each node is :func:`gpufleet.agent.main.run_agent` in a thread with its own node id, state dir
(``{state_root}/{node_id}``), node certificate (joined with its own single-use token), gRPC
port and assignment log, and the hollow runtime (:mod:`gpufleet.agent.runtime.hollow`):
attempts are simulated, everything else is the agent's code. What the nodes share: the
process, one pool serving their gRPC calls, the gRPC library's polling threads, and one
loaded ``cryptography`` (a real agent makes keys in a child process to keep it out of its
memory; here it is paid once for all nodes).

Silencing (a partition of chosen nodes, for fencing runs): ``--control FILE`` is read every
half second; the node ids listed in it (one a line) are cut off from the control plane until
they leave the file. ``SIGSTOP`` would freeze every node of the process at once.

Exit status: 0 after SIGTERM/SIGINT, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpufleet.agent.main import AgentConfig, run_agent
from gpufleet.agent.runtime.hollow import HollowOptions

logger = logging.getLogger("gpufleet.agent.hollow")

HOLLOW_LABEL = "gpufleet/hollow"
"""Node label every hollow node registers with (value ``true``): never mistake it for GPUs."""
CONTROL_POLL_S = 0.5


def node_ids(prefix: str, count: int, first: int = 0) -> list[str]:
    """``{prefix}{i:04d}`` for ``i`` in ``first .. first+count-1``."""
    return [f"{prefix}{i:04d}" for i in range(first, first + count)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpufleet.agent.hollow", description=__doc__)
    p.add_argument("--count", type=int, required=True, help="hollow nodes to run")
    p.add_argument("--first", type=int, default=0, help="index of the first node id")
    p.add_argument("--prefix", default="hollow-", help="node ids are PREFIX0000, PREFIX0001...")
    p.add_argument("--controller", required=True, help="controllers' host:port, comma-separated")
    p.add_argument("--join-address", required=True, help="join services' host:port, comma-sep.")
    p.add_argument("--object-store-url", required=True)
    p.add_argument("--ca-cert", type=Path, required=True, help="the fleet CA certificate")
    p.add_argument(
        "--tokens",
        type=Path,
        help="JSON file {node_id: join token} (nodes whose state dir holds a certificate "
        "need none)",
    )
    p.add_argument("--state-root", type=Path, required=True)
    p.add_argument("--gpus", default="8xH100-80GB", help="declared GPUs of every node")
    p.add_argument(
        "--gpu-mix",
        default="",
        help="SPEC=N,... : the first N nodes get SPEC, the next ones the next SPEC (overrides "
        "--gpus for the nodes it covers)",
    )
    p.add_argument("--heartbeat-s", type=float, default=None, help="default: the controller's")
    p.add_argument("--default-grace-s", type=float, default=5.0)
    p.add_argument("--control", type=Path, help="file listing the node ids to silence")
    p.add_argument("--grpc-workers", type=int, default=16, help="the shared gRPC server pool")
    p.add_argument("--start-rate", type=float, default=50.0, help="node starts per second")
    p.add_argument("--monitor-interval-s", type=float, default=0.25)
    p.add_argument("--log-level", default="WARNING")
    return p


def _gpus_for(ids: list[str], default: str, mix: str) -> dict[str, str]:
    out = dict.fromkeys(ids, default)
    i = 0
    for part in filter(None, mix.split(",")):
        spec, _, n = part.partition("=")
        for node in ids[i : i + int(n)]:
            out[node] = spec
        i += int(n)
    return out


class _DropNoise(logging.Filter):
    """Per-node start-up warnings that say "this node is hollow" N times over."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(
            ("job network: host", "no container runtime", "jobs run as the agent's own user")
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(threadName)s %(message)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropNoise())
    # one copy of `cryptography` for every node: joins and certificate checks then run in
    # this process, not in a child interpreter per node (agent.identity._pki)
    import cryptography.x509  # noqa: F401

    ids = node_ids(args.prefix, args.count, args.first)
    tokens: dict[str, str] = json.loads(args.tokens.read_text()) if args.tokens else {}
    gpus = _gpus_for(ids, args.gpus, args.gpu_mix)
    cfg = AgentConfig(
        controller_address=args.controller,
        join_address=args.join_address,
        object_store_url=args.object_store_url,
        heartbeat_interval_s=args.heartbeat_s or 10.0,
        default_grace_s=args.default_grace_s,
        agent_disk_reserve_mb=0,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    pool = ThreadPoolExecutor(max_workers=args.grpc_workers, thread_name_prefix="hollow-rpc")
    silenced = {n: threading.Event() for n in ids}

    def one(node_id: str) -> None:
        try:
            run_agent(
                cfg,
                node_id=node_id,
                gpus=gpus[node_id],
                port=0,
                state_dir=args.state_root / node_id,
                labels={HOLLOW_LABEL: "true"},
                heartbeat_interval_s=args.heartbeat_s,
                stop_event=stop,
                join_token=tokens.get(node_id),
                ca_cert=args.ca_cert,
                hollow=HollowOptions(
                    rpc_executor=pool,
                    silenced=silenced[node_id],
                    monitor_interval_s=args.monitor_interval_s,
                ),
            )
        except Exception:
            logger.exception("hollow node %s stopped", node_id)

    threads = []
    for node_id in ids:
        if stop.is_set():
            break
        t = threading.Thread(target=one, args=(node_id,), name=f"hollow-{node_id}", daemon=True)
        t.start()
        threads.append(t)
        if args.start_rate > 0:
            stop.wait(1.0 / args.start_rate)
    logger.warning("%d hollow nodes started", len(threads))
    while not stop.wait(CONTROL_POLL_S):
        _apply_control(args.control, silenced)
    deadline = time.monotonic() + 15
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    pool.shutdown(wait=False, cancel_futures=True)
    return 0


def _apply_control(path: Path | None, silenced: dict[str, threading.Event]) -> None:
    if path is None:
        return
    try:
        wanted = set(path.read_text().split())
    except OSError:
        wanted = set()
    for node_id, event in silenced.items():
        if node_id in wanted and not event.is_set():
            logger.warning("hollow node %s silenced", node_id)
            event.set()
        elif node_id not in wanted and event.is_set():
            logger.warning("hollow node %s heard again", node_id)
            event.clear()


if __name__ == "__main__":
    sys.exit(main())
