"""Operator actions on nodes through REST (admin tokens): cordon, uncordon, drain, fence,
one node's state with its active attempts, and image pre-pulls. What ``gpufleet admin node``
calls; mounted by ``api.app.create_app`` through :func:`add_admin_node_routes`."""

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpufleet.domain.errors import ValidationFailed
from gpufleet.domain.images import reference_problem
from gpufleet.domain.states import NodeStatus
from gpufleet.queue import Waker
from gpufleet.services import auth, node_lookup, nodes
from gpufleet.settings import Settings
from gpufleet.store.db import Database

Reason = Annotated[str | None, Field(default=None, max_length=512, pattern=r"^[^\x00]*$")]


class NodeAction(BaseModel):
    """Body of cordon / drain: why (kept on the node and shown)."""

    model_config = ConfigDict(extra="forbid")
    reason: Reason = None


class FenceRequest(BaseModel):
    """Body of fence: ``confirm_dead`` must be true (the operator vouches the node is dead,
    so its quarantined GPUs can be offered again); ``force`` fences a node heard from within
    the heartbeat window too (else 409, field ``force``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    confirm_dead: bool = False
    force: bool = False
    reason: Reason = None


class PrepullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(min_length=1, max_length=512, pattern=r"^[^\x00\s]+$")
    gpu_type: str | None = Field(default=None, min_length=1, max_length=64)

    @field_validator("image")
    @classmethod
    def _image_reference(cls, v: str) -> str:
        """An OCI reference, as for a job's ``image`` (``domain.images``)."""
        if (problem := reference_problem(v)) is not None:
            raise ValueError(f"image reference {v[:80]!r} {problem}")
        return v


class ActiveRunOut(BaseModel):
    run_id: str
    job_id: str
    status: str


class NodeStateOut(BaseModel):
    """One node's status (and the reason) and the attempts still active on it."""

    node_id: str
    status: str
    previous_status: str | None = None
    status_reason: str | None
    active_runs: list[ActiveRunOut]


class FenceOut(BaseModel):
    node_id: str
    status: str
    fenced: list[dict[str, Any]]
    released_gpus: int | float
    """Whole GPUs released, plus the fractions of the shares released."""


def add_admin_node_routes(
    app: FastAPI,
    *,
    db: Database,
    settings: Settings,
    waker: Waker,
    admin: Callable[..., Any],
    errors: Callable[..., dict[int | str, dict[str, Any]]],
) -> None:
    """Add ``/v1/admin/nodes/{node_id}`` (GET), ``.../cordon``, ``.../uncordon``,
    ``.../drain``, ``.../fence`` (POST) and ``/v1/admin/prepull`` (POST)."""
    # a local alias: annotations here are evaluated at once (no postponed annotations)
    Admin = Annotated[auth.Principal, Depends(admin)]

    def state(node_id: str, before: str | None = None) -> NodeStateOut:
        with db.read() as s:
            node = node_lookup.fleet_node(s, node_id)
            active = nodes.active_runs_on(s, node_id)
            return NodeStateOut(
                node_id=node_id,
                status=node.status,
                previous_status=before,
                status_reason=node.status_reason,
                active_runs=[ActiveRunOut(run_id=r, job_id=j, status=st) for r, j, st in active],
            )

    def move(node_id: str, to: NodeStatus, message: str, reason: str | None) -> NodeStateOut:
        before = db.run_write(
            partial(nodes.set_node_status, node_id=node_id, to=to, message=message, reason=reason)
        )
        waker.wake()
        return state(node_id, before)

    @app.get("/v1/admin/nodes/{node_id}", response_model=NodeStateOut, responses=errors(403, 404))
    def node_state(node_id: str, _: Admin) -> NodeStateOut:
        """A node's status and its active attempts (what ``admin node drain`` waits on)."""
        return state(node_id)

    @app.post(
        "/v1/admin/nodes/{node_id}/cordon",
        response_model=NodeStateOut,
        responses=errors(400, 403, 404, 409, 413),
    )
    def cordon(node_id: str, body: NodeAction, _: Admin) -> NodeStateOut:
        """No new placements on the node; running work continues. 409 from a status with no
        edge to CORDONED."""
        return move(node_id, NodeStatus.CORDONED, "cordoned by an operator", body.reason)

    @app.post(
        "/v1/admin/nodes/{node_id}/uncordon",
        response_model=NodeStateOut,
        responses=errors(403, 404, 409),
    )
    def uncordon(node_id: str, _: Admin) -> NodeStateOut:
        """Accept placements again (also ends a FENCED node's exclusion)."""
        return move(node_id, NodeStatus.HEALTHY, "uncordoned by an operator", None)

    @app.post(
        "/v1/admin/nodes/{node_id}/drain",
        response_model=NodeStateOut,
        responses=errors(400, 403, 404, 409, 413),
    )
    def drain(node_id: str, body: NodeAction, _: Admin) -> NodeStateOut:
        """DRAINING: no new placements; the controller marks it CORDONED once its active
        attempts (listed in the answer) have ended."""
        return move(node_id, NodeStatus.DRAINING, "drain requested by an operator", body.reason)

    @app.post(
        "/v1/admin/nodes/{node_id}/fence",
        response_model=FenceOut,
        responses=errors(400, 403, 404, 409, 413),
    )
    def fence(node_id: str, body: FenceRequest, _: Admin) -> FenceOut:
        """Give a dead node up: its attempts are fenced (jobs re-placed), its QUARANTINED
        GPUs released, and it is FENCED until uncordoned. 422 without ``confirm_dead``; 409
        (field ``force``) when the node was heard from within ``suspect_after_missed``
        heartbeat intervals and is neither FENCED nor revoked, unless ``force``."""
        if not body.confirm_dead:
            raise ValidationFailed(
                "confirm_dead must be true: fencing releases GPUs that processes on the node"
                " might still use if it is alive",
                field="confirm_dead",
            )
        fenced, back = db.run_write(
            partial(
                nodes.operator_fence,
                node_id=node_id,
                reason=body.reason or "confirmed dead by an operator",
                max_node_failures=settings.max_node_failures,
                live_within_s=settings.suspect_after_missed * settings.heartbeat_interval_s,
                force=body.force,
            )
        )
        waker.wake()
        return FenceOut(
            node_id=node_id,
            status=NodeStatus.FENCED,
            fenced=[
                {"run_id": f.run_id, "job_id": f.job_id, "job_status": f.job_status}
                for f in fenced
            ],
            released_gpus=back,
        )

    @app.post("/v1/admin/prepull", responses=errors(400, 403, 413))
    def prepull(body: PrepullRequest, _: Admin) -> dict[str, Any]:
        """Ask healthy nodes that lack ``image`` to pull it (in their next heartbeat answer);
        returns the nodes asked."""
        asked = db.run_write(
            partial(nodes.prepull_images, image=body.image, gpu_type=body.gpu_type)
        )
        return {"image": body.image, "nodes": list(asked)}
