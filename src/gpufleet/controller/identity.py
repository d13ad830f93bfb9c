"""Node identity on the controller: its TLS material, the join/renew service, and the check
every agent call passes (who the certificate names, and whether it is still valid).

* :class:`ControllerTls` loads the fleet CA and issues this controller's certificate at start.
* :class:`NodeAuthenticator` turns a call's client certificate into a node id, refusing
  unknown, revoked, expired or mismatched certificates (PERMISSION_DENIED, one log line,
  nothing changed). Revocation is read from the database with a cache of at most
  ``REVOCATION_CACHE_S`` per serial, so a revocation reaches every replica within a second.
* :class:`BootstrapServicer`: Join (join port, no client certificate; a join token pays for
  it) and Renew (mutual-TLS port; the current certificate pays for it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import grpc

from gpufleet.controller.rpc_errors import guard
from gpufleet.rpc import tls
from gpufleet.rpc.ca import csr_key_sha256
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import node_identity
from gpufleet.store.db import Database

log = logging.getLogger("gpufleet.controller")

REVOCATION_CACHE_S = 0.5
"""How long one serial's database answer is reused (a revocation takes effect within it)."""

REFUSAL_LOG_EVERY_S = 60.0
"""A refused caller is logged once per reason per this many seconds."""

BOOTSTRAP_METHODS = frozenset({"/gpufleet.v1.Bootstrap/Join", "/gpufleet.v1.Bootstrap/Renew"})


class ControllerTls:
    """The fleet CA plus a controller certificate issued from it at start.

    Raises:
        tls.PkiError: no CA in ``pki_dir``.
    """

    def __init__(self, pki_dir: Path, hostnames: list[str]) -> None:
        self.ca = tls.load_ca(pki_dir)
        self.key_pem, self.chain_pem = self.ca.issue_controller(hostnames)
        self.ca_pem = self.ca.cert_pem

    def server_credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials:
        return tls.server_credentials(
            self.key_pem, self.chain_pem, self.ca_pem, require_client_auth=require_client_auth
        )

    def agent_channel_credentials(self) -> grpc.ChannelCredentials:
        return tls.channel_credentials(self.ca_pem, self.key_pem, self.chain_pem)


class NodeAuthenticator:
    """The node id of a call, from its verified client certificate; never from the message."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, bool, str]] = {}  # serial: (when, valid, node)
        self._refusals_logged: dict[str, float] = {}

    def node_of(self, context: grpc.ServicerContext, method: str, claimed: str = "") -> str:
        """The node id of the caller of ``method`` (named in the log line). Aborts the call
        (PERMISSION_DENIED) when its certificate is not a valid node certificate, or names
        another node than ``claimed`` (if given)."""
        ident = tls.peer_identity(context)
        if ident is None or ident.role != tls.ROLE_NODE:
            self._refuse(context, method, "needs a node certificate")
        assert ident is not None
        if ident.not_after <= datetime.now(UTC):
            self._refuse(context, method, f"certificate {ident.serial} expired")
        if not self.valid(ident.serial, ident.name):
            self._refuse(context, method, f"certificate {ident.serial} is revoked or unknown")
        if claimed and claimed != ident.name:
            self._refuse(
                context, method, f"node {ident.name!r} may not speak for node {claimed!r}"
            )
        return ident.name

    def valid(self, serial: str, node_id: str) -> bool:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(serial)
        if hit is not None and now - hit[0] < REVOCATION_CACHE_S:
            return hit[1]
        with self.db.read() as s:
            ok = node_identity.cert_is_valid(s, serial, node_id)
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[serial] = (now, ok, node_id)
        return ok

    def forget_node(self, node_id: str) -> None:
        """Drop this replica's cached answers for ``node_id``'s certificates (after a rejoin
        revoked them here; other replicas see it within ``REVOCATION_CACHE_S``)."""
        with self._lock:
            for serial in [k for k, v in self._cache.items() if v[2] == node_id]:
                del self._cache[serial]

    def _refuse(self, context: grpc.ServicerContext, method: str, why: str) -> None:
        # one line per caller and reason a minute: a revoked agent retrying its heartbeats
        # must not fill the log
        key, now = f"{tls.peer_name(context)}|{why}", time.monotonic()
        with self._lock:
            last = self._refusals_logged.get(key)
            if last is None or now - last >= REFUSAL_LOG_EVERY_S:
                if len(self._refusals_logged) > 10_000:
                    self._refusals_logged.clear()
                self._refusals_logged[key] = now
                last = None
        if last is None:
            log.warning("refused %s from %s: %s", method, tls.peer_name(context), why)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, why)


class BootstrapServicer(pb_grpc.BootstrapServicer):
    """Join and Renew. ``ttl_s``: lifetime of a node certificate, seconds."""

    def __init__(
        self,
        db: Database,
        ca: tls.FleetCA,
        auth: NodeAuthenticator,
        ttl_s: float,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.db, self.ca, self.auth, self.ttl_s = db, ca, auth, ttl_s
        self.on_change = on_change

    def Join(
        self, request: pb.JoinRequest, context: grpc.ServicerContext
    ) -> pb.CertificateResponse:
        node_id = request.node_id
        # the token first (one indexed read): this port needs no certificate, so nothing is
        # signed for a caller without a usable token. The CSR's key names a repeat of a join
        # whose answer was lost (the agent retries the same request after a timeout).
        key_sha256 = csr_key_sha256(request.csr_pem)
        guard(context, lambda: self._check_token(request.token, node_id, key_sha256))
        try:
            cert = self.ca.sign_node_csr(request.csr_pem, node_id, self.ttl_s)
        except ValueError as exc:
            log.warning("refused Join of %r from %s: %s", node_id, context.peer(), exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        serial = tls.serial_hex(cert)
        guard(
            context,
            lambda: self.db.run_write(
                partial(
                    node_identity.join,
                    secret=request.token,
                    node_id=node_id,
                    serial=serial,
                    not_after=cert.not_valid_after_utc,
                    agent_epoch=request.agent_epoch,
                    held={r.run_id: r.token for r in request.held_runs},
                    key_sha256=key_sha256,
                )
            ),
        )
        self.auth.forget_node(node_id)  # its older certificates were just revoked
        log.info("node %s joined from %s: certificate %s", node_id, context.peer(), serial)
        return self._answer(cert, node_id)

    def Renew(
        self, request: pb.RenewRequest, context: grpc.ServicerContext
    ) -> pb.CertificateResponse:
        node_id = guard(context, lambda: self.auth.node_of(context, "Renew"))
        ident = tls.peer_identity(context)
        assert ident is not None  # node_of refused the call otherwise
        try:
            cert = self.ca.sign_node_csr(request.csr_pem, node_id, self.ttl_s)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        serial = tls.serial_hex(cert)
        # the presented certificate is checked again in the transaction that records the new
        # one (not from the cache): a renewal racing a revocation cannot outlive it
        guard(
            context,
            lambda: self.db.run_write(
                partial(
                    node_identity.record_renewal,
                    node_id=node_id,
                    old_serial=ident.serial,
                    serial=serial,
                    not_after=cert.not_valid_after_utc,
                )
            ),
        )
        log.info("node %s renewed its certificate: %s", node_id, serial)
        return self._answer(cert, node_id)

    def _check_token(self, secret: str, node_id: str, key_sha256: str) -> None:
        with self.db.read() as s:
            node_identity.check_join_token(
                s, secret=secret, node_id=node_id, key_sha256=key_sha256
            )

    def _answer(self, cert: object, node_id: str) -> pb.CertificateResponse:
        return pb.CertificateResponse(
            certificate_pem=tls.cert_pem(cert) + self.ca.cert_pem,  # type: ignore[arg-type]
            ca_pem=self.ca.cert_pem,
            node_id=node_id,
        )
