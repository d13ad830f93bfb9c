"""Completion webhook settings (services.notify): a team's signing secret (read, rotate)
and, for admins, a team's default webhook URLs. Mounted by ``create_app``."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gpufleet.api.app import Admin, AppState, Who, errors
from gpufleet.domain.errors import Forbidden
from gpufleet.domain.webhooks import MAX_URL_LENGTH, MAX_URLS
from gpufleet.services import auth, limits, notify


class NotifySecretOut(BaseModel):
    """A team's webhook secret: the HMAC-SHA256 key of its deliveries
    (``X-Gpufleet-Signature``)."""

    team: str
    secret: str


class NotifyUrlsPut(BaseModel):
    """PUT /v1/admin/teams/{team}/notify-urls: the URLs a job of the team submitted without
    ``notify`` is given (``[]``: none)."""

    model_config = ConfigDict(extra="forbid")
    urls: list[Annotated[str, Field(max_length=MAX_URL_LENGTH)]] = Field(max_length=MAX_URLS)


class NotifyUrlsOut(BaseModel):
    team: str
    urls: list[str]


def _team_of(who: auth.Principal, team: str | None) -> str:
    """The team a secret request is about: the token's own, or (admin) any."""
    if team is None or team == who.team_id:
        return who.team_id
    if not who.is_admin:
        raise Forbidden(f"a token of team {who.team_id!r} cannot read team {team!r}'s secret")
    return team


def router(state: AppState, *, admission: limits.SubmitAdmission) -> APIRouter:
    """``/v1/notify-secret`` (the token's team), ``/v1/teams/{team}/notify-secret`` (that
    team's token or an admin) and ``/v1/admin/teams/{team}/notify-urls``."""
    r = APIRouter()

    def secret(who: auth.Principal, team: str | None, rotate: bool) -> NotifySecretOut:
        team_id = _team_of(who, team)
        value = state.db.run_write(partial(notify.team_secret, team_id=team_id, rotate=rotate))
        return NotifySecretOut(team=team_id, secret=value)

    @r.get("/v1/notify-secret", response_model=NotifySecretOut, responses=errors(404))
    def get_own_secret(who: Who) -> NotifySecretOut:
        """The token's team's webhook secret (made on first read)."""
        return secret(who, None, False)

    @r.post("/v1/notify-secret", response_model=NotifySecretOut, responses=errors(404))
    def rotate_own_secret(who: Who) -> NotifySecretOut:
        """A new webhook secret for the token's team; deliveries from now on use it."""
        return secret(who, None, True)

    @r.get(
        "/v1/teams/{team}/notify-secret",
        response_model=NotifySecretOut,
        responses=errors(403, 404),
    )
    def get_secret(team: str, who: Who) -> NotifySecretOut:
        """A team's webhook secret (its own token, or an admin's; made on first read)."""
        return secret(who, team, False)

    @r.post(
        "/v1/teams/{team}/notify-secret",
        response_model=NotifySecretOut,
        responses=errors(403, 404),
    )
    def rotate_secret(team: str, who: Who) -> NotifySecretOut:
        """A new webhook secret for the team (its own token, or an admin's)."""
        return secret(who, team, True)

    @r.put(
        "/v1/admin/teams/{team}/notify-urls",
        response_model=NotifyUrlsOut,
        responses=errors(400, 403, 404, 413),
    )
    def put_urls(team: str, body: NotifyUrlsPut, _: Admin) -> NotifyUrlsOut:
        """Set the team's default webhook URLs (``[]`` clears them); 422 names a bad one."""
        urls = state.db.run_write(partial(notify.set_team_urls, team_id=team, urls=body.urls))
        admission.forget(team)  # its cached limits hold the defaults given at submit
        return NotifyUrlsOut(team=team, urls=urls)

    return r
