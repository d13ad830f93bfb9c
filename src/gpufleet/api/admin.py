"""Admin routes (admin tokens only): teams and their quotas, node identities (join tokens,
certificates, admin labels, forgetting a node) and API tokens. Mounted by ``create_app``;
cordon, drain, fence and pre-pulls are in ``api.admin_nodes``."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Query

from gpufleet.api.app import Admin, AppState, errors
from gpufleet.api.schemas import (
    JoinTokenCreate,
    NodeLabelsOut,
    NodeLabelsPatch,
    NodeLabelsPut,
    TeamCreate,
    TeamQuotaUpdate,
    TokenCreate,
    TokenList,
    TokenOut,
)
from gpufleet.rpc import tls
from gpufleet.services import auth, fleet_ca, jobs, limits, node_identity, node_labels, teams


def router(
    state: AppState, *, defaults: limits.TeamLimits, admission: limits.SubmitAdmission
) -> APIRouter:
    """The ``/v1/admin/teams``, ``/v1/admin/nodes`` (identity and labels) and
    ``/v1/admin/tokens`` routes; ``admission`` forgets a team's cached limits on change."""
    r = APIRouter()

    @r.post("/v1/admin/teams", status_code=201, responses=errors(400, 403, 409, 413))
    def create_team(body: TeamCreate, _: Admin) -> dict[str, str]:
        name = state.db.run_write(lambda s: auth.create_team(s, body.name, weight=body.weight))
        return {"team": name}

    @r.get("/v1/admin/teams", responses=errors(403))
    def list_teams(_: Admin) -> dict[str, Any]:
        with state.db.read() as s:
            return {"items": teams.describe_teams(s, defaults)}

    @r.put("/v1/admin/teams/{team_id}", responses=errors(400, 403, 404, 413))
    def set_quota(team_id: str, body: TeamQuotaUpdate, _: Admin) -> dict[str, Any]:
        """Set a team's quota and limits. 422 names the field for a quota that can never be
        met (a GPU type no node has, with the known types listed; a guarantee above the
        type's GPUs; a lending limit above the guarantee); ``warnings`` lists quotas that may
        not be met (guarantees of all teams above a type's GPUs, a fleet with no nodes yet,
        the deprecated ``lending_limit_gpus``)."""
        upd = teams.QuotaUpdate(**body.to_update())
        change = state.db.run_write(partial(teams.update_quota, team_id=team_id, upd=upd))
        admission.forget(team_id)
        state.waker.wake()
        with state.db.read() as s:
            out = next(t for t in teams.describe_teams(s, defaults) if t["team"] == team_id)
        return {**out, "warnings": change.warnings}

    @r.get("/v1/admin/nodes", responses=errors(403))
    def admin_nodes(_: Admin) -> dict[str, Any]:
        """Nodes and node ids with certificates: state, address, certificate serial/expiry."""
        with state.db.read() as s:
            return {"items": node_identity.describe_nodes(s)}

    @r.post("/v1/admin/nodes/join-tokens", status_code=201, responses=errors(400, 403, 409, 413))
    def create_join_token(body: JoinTokenCreate, _: Admin) -> dict[str, Any]:
        """A single-use join token (``gfj1.<CA sha256>.<secret>``) for ``gpufleet agent
        --join-token``. The CA is this server's ``ca.crt`` (only the public certificate is
        needed) or, without one, the fleet CA recorded in the database. 409 (``pki_dir``)
        when this server's ``ca.crt`` is not the recorded CA, or there is neither."""
        fp, ca_path = tls.local_ca_fingerprint(state.settings.resolved_pki_dir())

        def make(s: Any) -> tuple[str, str, Any]:
            ca = fleet_ca.join_token_ca(s, fp, ca_path)
            secret, expires = node_identity.create_join_token(
                s, node_id=body.node_id, ttl_s=body.ttl_s
            )
            return ca, secret, expires

        ca, secret, expires = state.db.run_write(make)
        return {
            "token": tls.format_join_token(ca, secret),
            "node_id": body.node_id,
            "expires_at": jobs.iso(expires),
        }

    @r.put(
        "/v1/admin/nodes/{node_id}/labels",
        response_model=NodeLabelsOut,
        responses=errors(400, 403, 404, 413, 422),
    )
    def put_node_labels(node_id: str, body: NodeLabelsPut, _: Admin) -> NodeLabelsOut:
        """Replace the node's admin labels (topology such as ``rack``, ``switch``). They are
        kept across agent re-registrations and win over the agent's labels on a shared key;
        ``gpufleet/`` keys are the agent's. 422 names the bad key (``labels.KEY``)."""
        return _set_labels(node_id, dict(body.labels), replace=True)

    @r.patch(
        "/v1/admin/nodes/{node_id}/labels",
        response_model=NodeLabelsOut,
        responses=errors(400, 403, 404, 413, 422),
    )
    def patch_node_labels(node_id: str, body: NodeLabelsPatch, _: Admin) -> NodeLabelsOut:
        """Merge-patch the node's admin labels: a value sets, ``null`` removes (the agent's
        value for that key, if any, shows again)."""
        return _set_labels(node_id, body.labels, replace=False)

    def _set_labels(node_id: str, changes: dict[str, str | None], replace: bool) -> NodeLabelsOut:
        set_labels = partial(node_labels.set_admin_labels, node_id=node_id, changes=changes)
        out = state.db.run_write(partial(set_labels, replace=replace))
        state.waker.wake()  # a job waiting for a label may fit now
        return NodeLabelsOut(**out)

    @r.post("/v1/admin/nodes/{node_id}/revoke", responses=errors(403, 404))
    def revoke_node(node_id: str, _: Admin) -> dict[str, Any]:
        """Revoke every certificate of the node; its next call is refused (within 1 s)."""
        n = state.db.run_write(partial(node_identity.revoke_node, node_id=node_id))
        return {"node_id": node_id, "revoked_certs": n}

    @r.delete("/v1/admin/nodes/{node_id}", responses=errors(403, 404, 409))
    def forget_node(
        node_id: str,
        _: Admin,
        force: Annotated[
            bool, Query(description="Forget a node that sent a heartbeat recently, too.")
        ] = False,
    ) -> dict[str, Any]:
        """Forget a node with no reserved GPUs; its certificates are revoked. 409 when GPUs
        are reserved, or (without ``force``) when it sent a heartbeat within the last
        ``suspect_after_missed`` heartbeat intervals and its certificates are not revoked."""
        n = state.db.run_write(
            partial(
                node_identity.forget_node,
                node_id=node_id,
                force=force,
                live_within_s=state.settings.suspect_after_missed
                * state.settings.heartbeat_interval_s,
            )
        )
        return {"node_id": node_id, "forgotten": True, "revoked_certs": n}

    @r.post("/v1/admin/tokens", status_code=201, responses=errors(400, 403, 413))
    def create_token(body: TokenCreate, _: Admin) -> dict[str, str]:
        raw = state.db.run_write(
            lambda s: auth.create_token(
                s,
                body.team,
                name=body.name,
                is_admin=body.admin,
                create_team_if_missing=body.create_team,
                user=body.user,
            )
        )
        return {"team": body.team, "token": raw}

    @r.get("/v1/admin/tokens", response_model=TokenList, responses=errors(403))
    def list_tokens(
        _: Admin,
        team: Annotated[str | None, Query(max_length=64)] = None,
        include_revoked: bool = True,
    ) -> TokenList:
        """Every token (or one team's): id, team, name, admin, created and revoked times;
        never the token itself."""
        with state.db.read() as s:
            items = auth.list_tokens(s, team, include_revoked=include_revoked)
        return TokenList(items=[TokenOut(**t) for t in items])

    @r.delete("/v1/admin/tokens/{token_id}", response_model=TokenOut, responses=errors(403, 404))
    def revoke_token(token_id: str, _: Admin) -> TokenOut:
        """Revoke a token: every API server refuses it within ``PRINCIPAL_TTL_S`` (this one
        at once). Revoking it again is a no-op."""
        out = state.db.run_write(lambda s: auth.revoke_token(s, token_id))
        for raw, (_at, who) in list(state.principals.items()):
            if who.token_id == token_id:
                state.principals.pop(raw, None)
        return TokenOut(**out)

    return r
