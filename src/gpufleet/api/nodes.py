"""``GET /v1/nodes``: the fleet's nodes and free GPUs, for any token. Mounted by
``create_app``; the admin node routes are in ``api.admin`` and ``api.admin_nodes``."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from gpufleet.api.app import AppState, Who
from gpufleet.api.schemas import NodeList, NodeOut
from gpufleet.domain.labels import effective_labels
from gpufleet.services import jobs
from gpufleet.store.tables import NodeCapacityRow, NodeGpuRow, NodeRow


def router(state: AppState) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/nodes", response_model=NodeList)
    def nodes(who: Who) -> NodeList:
        """Nodes and free GPUs. Agent addresses are shown to admin tokens only (``null``
        otherwise): a team needs capacity, not where to reach an agent."""
        with state.db.read() as s:
            rows = s.execute(
                select(NodeRow, NodeCapacityRow)
                .join(NodeCapacityRow, NodeCapacityRow.node_id == NodeRow.id)
                .order_by(NodeRow.id)
            ).all()
            shared: dict[str, dict[str, float]] = {}
            for node_id, index, milli in s.execute(
                select(NodeGpuRow.node_id, NodeGpuRow.gpu_index, NodeGpuRow.shared_milli).where(
                    NodeGpuRow.shared_milli > 0
                )
            ):
                shared.setdefault(node_id, {})[str(index)] = milli / 1000
            return NodeList(
                items=[
                    NodeOut(
                        node_id=n.id,
                        status=n.status,
                        gpu_type=n.gpu_type,
                        gpu_memory_mb=n.gpu_memory_mb,
                        total_gpus=c.total_gpus,
                        available_gpus=c.available_gpus,
                        labels=effective_labels(n.labels, n.admin_labels),
                        admin_labels=n.admin_labels or {},
                        address=n.address if who.is_admin else None,
                        last_heartbeat_at=jobs.iso(n.last_heartbeat_at),
                        agent_epoch=n.agent_epoch,
                        status_reason=n.status_reason,
                        reported_gpus=n.reported_gpus,
                        reported_gpu_type=n.reported_gpu_type,
                        # disk paths of the node are for operators only
                        health=n.health
                        if who.is_admin or not n.health
                        else {k: v for k, v in n.health.items() if k != "disk_free_mb"},
                        images=sorted(str(i.get("name", "")) for i in n.images or []),
                        gpu_sharing=n.gpu_sharing,
                        shared_gpus=shared.get(n.id, {}),
                    )
                    for n, c in rows
                ]
            )

    return r
