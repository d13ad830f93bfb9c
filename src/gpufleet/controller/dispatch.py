"""Dispatch of assignments: AssignJob for an attempt the scheduler reserved, after commit.

Holds :class:`AssignmentDispatch` (the ``dispatch``/``_assignment`` methods of
:class:`~gpufleet.controller.scheduler.Scheduler`, which runs them in its assign pool; the
reconciler re-sends through the same ``dispatch``), the one query that builds an AssignJob
request, and the environment of a job and of a gang member (:func:`gang_env`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from typing import Any

import grpc
from sqlalchemy import bindparam, select
from sqlalchemy.orm import aliased

from gpufleet.controller.agents import AgentClients
from gpufleet.controller.leadership import Leadership
from gpufleet.controller.rpc_errors import loop_failed
from gpufleet.controller.stops import record_never_started
from gpufleet.domain.states import RunStatus
from gpufleet.domain.types import milli_of
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.services import nodes, runs
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.tables import JobRow, JobRunRow, NodeRow, ReservationRow

log = logging.getLogger("gpufleet.controller")


@cache
def _assignment_query() -> Any:
    """ONE statement, built once (``p_run``): the attempt, its job, node and reservation, and
    the checkpoint to resume from: the latest earlier attempt's that stored one (of a gang:
    every rank resumes from rank 0's, else from the lowest rank that stored one)."""
    earlier = aliased(JobRunRow)
    prior_q = (
        select(earlier.checkpoint_prefix)
        .where(
            earlier.job_id == JobRunRow.job_id,
            earlier.checkpoint_prefix.is_not(None),
            earlier.attempt < JobRunRow.attempt,
        )
        .order_by(earlier.attempt.desc(), earlier.rank)
        .limit(1)
        .correlate(JobRunRow)
        .scalar_subquery()
    )
    return (
        select(JobRunRow, JobRow, NodeRow, ReservationRow.id, prior_q)
        .join(JobRow, JobRow.id == JobRunRow.job_id)
        .join(NodeRow, NodeRow.id == JobRunRow.node_id)
        .join(ReservationRow, ReservationRow.run_id == JobRunRow.id)
        .where(JobRunRow.id == bindparam("p_run", type_=JobRunRow.id.type))
    )


class AssignmentDispatch:
    """AssignJob for ASSIGNED attempts, and acting on the agent's answer (a base of
    :class:`~gpufleet.controller.scheduler.Scheduler`, which sets these attributes)."""

    db: Database
    store: ObjectStore
    settings: Settings
    leadership: Leadership
    agents: AgentClients
    _pool: ThreadPoolExecutor

    def dispatch(self, run_id: str) -> None:
        """Send AssignJob for ``run_id`` (idempotent at the agent); record delivery. Runs in
        the assign pool, after the reservation committed; failures are left to the reconciler,
        which re-sends unconfirmed assignments."""
        try:
            found = self._assignment(run_id)
            if found is None:
                return
            node_id, address, req = found
            resp = self.agents.assign(node_id, address, req)
        except grpc.RpcError as exc:
            log.warning("AssignJob %s failed: %s (the reconciler retries)", run_id, exc.code())
            return
        except Exception as exc:
            loop_failed(f"dispatch of {run_id}", exc)
            return
        if resp.result == pb.AssignJobResponse.NODE_UNHEALTHY:
            # nothing was logged or started, and the agent refuses later copies: re-place the
            # job elsewhere, charged to the node (no user retry), and stop placing there
            log.warning("agent %s refused %s: %s", node_id, run_id, resp.message)
            self.db.run_write(partial(nodes.mark_unhealthy, node_id=node_id, reason=resp.message))
            record_never_started(
                self.db,
                self.store,
                self.leadership,
                run_id=run_id,
                token=req.token,
                message=resp.message or "node unhealthy",
                node_fault=True,
                node_refused=True,
                max_node_failures=self.settings.max_node_failures,
            )
            return
        if resp.result == pb.AssignJobResponse.REJECTED_STALE:
            # the agent refused a run_id it had not logged (and tombstoned it): it never
            # started. Leader-fenced: a deposed leader's late answer writes nothing, and a
            # confirmed attempt is never overridden by this inference.
            log.warning("agent %s rejected %s as stale: %s", node_id, run_id, resp.message)
            record_never_started(
                self.db,
                self.store,
                self.leadership,
                run_id=run_id,
                token=req.token,
                message=f"agent refused it: {resp.message}",
            )
            return
        if req.gang_size > 1 or resp.result != pb.AssignJobResponse.STARTED:
            self.db.run_write(partial(runs.mark_delivered, run_id=run_id))
        # else: a fresh start, whose ConfirmAssignment (sent by the agent as it answers, and
        # retried until answered) records the delivery with the start in one transaction;
        # this write would only queue behind or ahead of it on the same row. Should the
        # confirmation never come, the reconciler re-sends after 2 s (not the confirm
        # timeout) and the agent's ALREADY_RUNNING answer is recorded here.
        if (
            req.gang_size > 1
            and req.rank == 0
            and resp.master_port
            and resp.result in (pb.AssignJobResponse.STARTED, pb.AssignJobResponse.ALREADY_RUNNING)
        ):
            # rank 0 runs (or ran) and its agent chose MASTER_PORT: now the other ranks
            others = self.db.run_write(
                partial(runs.record_master_port, run_id=run_id, port=resp.master_port)
            )
            for other in others:
                self._pool.submit(self.dispatch, other)

    def _assignment(self, run_id: str) -> tuple[str, str, pb.AssignJobRequest] | None:
        """(node_id, agent address, AssignJob request) of an ASSIGNED attempt, else None;
        None too while this controller is not leader (its lease lapsed or a renewal failed:
        ``leadership.epoch`` is then 0 or stale). An AssignJob sent with epoch 0 was refused
        by the agent as stale and tombstoned, and the job charged a failed start; the
        attempt stays ASSIGNED instead, and the leader's reconciler re-sends it."""
        epoch = self.leadership.epoch
        if not self.leadership.is_leader:
            log.info("AssignJob %s not sent: not leader (the leader re-sends it)", run_id)
            return None
        with self.db.read() as s:
            found = s.execute(_assignment_query(), {"p_run": run_id}).first()
            if found is None or found[0].status != RunStatus.ASSIGNED:
                return None
            run, job, node, reservation_id, prior = found
            env = dict(spec_env(job.spec))
            if run.gang_size > 1:
                rank0 = s.execute(
                    select(JobRunRow.master_port, NodeRow.address)
                    .join(NodeRow, NodeRow.id == JobRunRow.node_id)
                    .where(
                        JobRunRow.job_id == job.id,
                        JobRunRow.token == run.token,
                        JobRunRow.rank == 0,
                    )
                ).one()
                if run.rank > 0 and not rank0.master_port:
                    return None  # rank 0's agent has not chosen MASTER_PORT yet
                env.update(
                    gang_env(
                        rank=run.rank,
                        gang_size=run.gang_size,
                        gpus_here=len(run.gpu_ids),
                        gpu_count=job.gpu_count,
                        master_addr=host_of(rank0.address),
                        master_port=rank0.master_port,
                    )
                )
        spec = job.spec
        req = pb.AssignJobRequest(
            run_id=run.id,
            job_id=job.id,
            reservation_id=reservation_id,
            token=run.token,
            leader_epoch=epoch,
            gpu_ids=run.gpu_ids,
            command=spec["command"],
            env=env,
            image=spec.get("image") or "",
            resume_from_uri=self.store.uri(prior) if prior else "",
            max_runtime_s=float(spec.get("max_runtime_s") or 0),
            attempt=run.attempt,
            working_dir=spec.get("working_dir") or "",
            memory_mb=int((spec.get("resources") or {}).get("memory_mb") or 0),
            cpu=float((spec.get("resources") or {}).get("cpu") or 0),
            rank=run.rank,
            gang_size=run.gang_size,
            pids_limit=int(spec.get("pids_limit") or 0),
            disk_mb=int(spec.get("disk_mb") or 0),
            mount_sources=[str(m["source"]) for m in spec.get("mounts") or []],
            mount_targets=[str(m["target"]) for m in spec.get("mounts") or []],
            mount_read_only=[bool(m.get("read_only")) for m in spec.get("mounts") or []],
            shm_size_mb=int(spec.get("shm_size_mb") or 0),
            gpu_milli=milli_of((spec.get("resources") or {}).get("gpu_fraction")),
        )
        return node.id, node.address, req


def spec_env(spec: Mapping[str, object]) -> Mapping[str, str]:
    env = spec.get("env") or {}
    assert isinstance(env, dict)
    return env


def host_of(address: str) -> str:
    """The host part of an agent's ``host:port`` gRPC address (brackets of IPv6 removed)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"


def gang_env(
    *,
    rank: int,
    gang_size: int,
    gpus_here: int,
    gpu_count: int,
    master_addr: str,
    master_port: int | None,
) -> dict[str, str]:
    """The distributed-training environment of one gang member (docs/design/gangs.md).

    The platform starts ONE process per node (the job's command); so, for a plain script
    that calls ``torch.distributed.init_process_group("gloo"/"nccl")`` with ``env://``:
    ``WORLD_SIZE`` = members, ``RANK`` = ``NODE_RANK`` = this member's rank, ``LOCAL_RANK``
    = 0, ``LOCAL_WORLD_SIZE`` = 1, ``MASTER_ADDR``/``MASTER_PORT`` = rank 0's node and the
    port its agent chose. A command that is ``torchrun`` (one worker per GPU) finds its
    arguments in ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE`` (this node's
    GPUs), ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` and then sets ``WORLD_SIZE``/``RANK``/
    ``LOCAL_*`` of its workers itself. ``GPUFLEET_GANG_SIZE``/``GPUFLEET_NNODES``,
    ``GPUFLEET_NODE_RANK``, ``GPUFLEET_GPUS_PER_NODE`` and ``GPUFLEET_WORLD_GPUS`` (all the
    job's GPUs) name the same facts in the platform's own words. ``master_port`` None
    (rank 0 before its agent chose it): rank 0's agent adds ``MASTER_PORT`` itself."""
    env = {
        "WORLD_SIZE": str(gang_size),
        "RANK": str(rank),
        "NODE_RANK": str(rank),
        "GROUP_RANK": str(rank),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": master_addr,
        "GPUFLEET_GANG_SIZE": str(gang_size),
        "GPUFLEET_NNODES": str(gang_size),
        "GPUFLEET_NODE_RANK": str(rank),
        "GPUFLEET_GPUS_PER_NODE": str(gpus_here),
        "GPUFLEET_WORLD_GPUS": str(gpu_count),
        "PET_NNODES": str(gang_size),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": str(max(1, gpus_here)),
        "PET_MASTER_ADDR": master_addr,
    }
    if master_port:
        env["MASTER_PORT"] = env["PET_MASTER_PORT"] = str(master_port)
    return env
