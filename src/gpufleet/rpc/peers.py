"""Who is calling: the verified peer certificate of a gRPC call, and the role check.

gRPC has verified the client certificate against the fleet CA before a handler runs; these
read what it says. :func:`peer_identity` parses it with ``cryptography`` (cached per
certificate); :func:`peer_subject` and :func:`peer_role` read gRPC's ``x509_subject``
without it, so :class:`RoleInterceptor` (PERMISSION_DENIED for the wrong role) costs a
process that uses it no ``cryptography``.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from gpufleet.rpc.pki import ORG, Identity, identity_of

_PARSED: dict[bytes, Identity | None] = {}
_PARSED_LOCK = threading.Lock()


def peer_identity(context: grpc.ServicerContext) -> Identity | None:
    """The identity of the TLS client that made this call, from the certificate gRPC has
    already verified against the fleet CA; None on a plaintext call or without a client cert.
    Parsed certificates are cached (one peer makes many calls)."""
    auth = context.auth_context()
    pems = auth.get("x509_pem_cert")
    if not pems:
        return None
    from cryptography import x509

    pem = pems[0]
    with _PARSED_LOCK:
        if pem in _PARSED:
            return _PARSED[pem]
    try:
        ident = identity_of(x509.load_pem_x509_certificate(pem))
    except ValueError:
        ident = None
    with _PARSED_LOCK:
        if len(_PARSED) > 4096:
            _PARSED.clear()
        _PARSED[pem] = ident
    return ident


def peer_name(context: grpc.ServicerContext) -> str:
    """A short description of the caller for log lines."""
    ident = peer_identity(context)
    who = f"{ident.role} {ident.name!r} serial {ident.serial}" if ident else "no certificate"
    return f"{context.peer()} ({who})"


def peer_subject(context: grpc.ServicerContext) -> dict[str, str] | None:
    """The attributes of the subject of the client certificate gRPC verified for this call,
    as gRPC reports it (``x509_subject``, RFC 2253: ``CN=n1,OU=node,O=gpufleet`` ->
    ``{"CN": "n1", "OU": "node", "O": "gpufleet"}``), read without ``cryptography``.

    None on a plaintext call, without a client certificate, or for a subject that cannot be
    read unambiguously (an escaped character, a multi-valued RDN, a repeated attribute):
    the fleet CA issues none of those (node ids are ``NODE_ID``), so such a peer is refused.
    """
    subjects = context.auth_context().get("x509_subject")
    if not subjects:
        return None
    text = subjects[0].decode("utf-8", "replace")
    if "\\" in text or "+" in text or '"' in text:
        return None
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key in out:
            return None
        out[key] = value
    return out


def peer_role(context: grpc.ServicerContext) -> str | None:
    """The role (``controller`` / ``node``) of this call's verified client certificate, from
    :func:`peer_subject` (no ``cryptography``); None when it names none or another org, on a
    plaintext call, or without a certificate. Agrees with ``peer_identity(context).role``."""
    subject = peer_subject(context)
    if subject is None or subject.get("O") != ORG or not subject.get("CN"):
        return None
    return subject.get("OU") or None


class RoleInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Refuses every call whose client certificate does not carry ``role``
    (PERMISSION_DENIED), except ``exempt`` methods (full names). Logs one line per refusal.
    Every kind of handler (unary or streaming) is guarded. The role is read from gRPC's
    view of the verified certificate (:func:`peer_role`), so a process using it needs no
    ``cryptography``."""

    def __init__(
        self,
        role: str,
        logger: Any,
        exempt: frozenset[str] = frozenset(),
        roles: dict[str, str] | None = None,
    ) -> None:
        self.role, self.log, self.exempt = role, logger, exempt
        self.roles = dict(roles or {})
        """Methods (full names) that need another role than ``role`` (``Agent.Exec``:
        ``api``); the others need ``role``."""

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in self.exempt:
            return handler
        needed = self.roles.get(method, self.role)

        def guard(inner: Any) -> Any:
            def checked(request: Any, context: grpc.ServicerContext) -> Any:
                if peer_role(context) != needed:
                    subject = context.auth_context().get("x509_subject")
                    self.log.warning(
                        "refused %s from %s (%s): needs a %s certificate",
                        method.rsplit("/", 1)[-1],
                        context.peer(),
                        subject[0].decode("utf-8", "replace") if subject else "no certificate",
                        needed,
                    )
                    context.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"this call needs a {needed} certificate",
                    )
                return inner(request, context)

            return checked

        for kind, make in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        ):
            inner = getattr(handler, kind)
            if inner is not None:
                return make(
                    guard(inner),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler
