"""The agent's node identity: its key and certificate in ``{state_dir}/tls`` (mode 0600), the
join that first obtains them, the channel to the controller built on them, and renewal.

* **Join** (no certificate yet, or an unusable one): the key is made here and never leaves
  the node; a CSR and the join token's secret go to the controller's join port over TLS that
  verifies the controller against the fleet CA (given with ``--ca-cert``, or fetched from the
  controller and accepted only if its sha256 is the one in the join token).
* **Renewal** at 2/3 of the certificate's lifetime, over the mutual-TLS channel (the current
  certificate authenticates the request); new connections, outgoing and incoming, use the new
  certificate at once.

The keys, CSRs and certificate checks are made by ``cryptography`` in a short-lived child
process (:mod:`gpufleet.agent.pkichild`), so the long-running agent never loads it (~12 MB of
its memory): it holds its credentials as PEM bytes (for gRPC) and :class:`tls.CertFacts`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from gpufleet.rpc import tls, tls_hint
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc

logger = logging.getLogger("gpufleet.agent")

CALL_TIMEOUT_S = 10.0
RETRY_MAX_S = 5.0
OLD_CHANNEL_GRACE_S = 30.0
"""A replaced channel is closed this long after the swap (calls in flight finish on it)."""
PKI_CHILD_TIMEOUT_S = 120.0
"""Seconds a certificate child process (key, CSR, checks: ~0.2 s of CPU) may take."""


class JoinRefused(tls.PkiError):
    """The controller refused the join (bad, used or expired token; wrong node id)."""


class JoinTokens:
    """Where an agent's join token comes from: one given at start (``--join-token``), or a
    file read again at every join (``--join-token-file``), so that a running agent can be
    let back in with a new token, without a restart, after its certificate expired or was
    revoked. A token is good for one join: :meth:`fresh` never answers the one the last
    join used (``spent``)."""

    def __init__(self, token: str | None, path: Path | None) -> None:
        if token and path is not None:
            raise ValueError("give --join-token or --join-token-file, not both")
        self.token, self.path = token or None, path
        self.spent: str | None = None

    def current(self) -> str | None:
        """The token there is now (the file's first line, stripped); None when there is
        none or the file cannot be read (logged)."""
        if self.path is None:
            return self.token
        try:
            text = self.path.read_text()
        except OSError as exc:
            logger.error("cannot read the join token file %s: %s", self.path, exc)
            return None
        lines = text.strip().splitlines()
        return lines[0].strip() if lines else None

    def fresh(self) -> str | None:
        """:meth:`current` unless a join already used it."""
        token = self.current()
        return None if token == self.spent else token

    def where(self) -> str:
        """Where a new token goes, for messages."""
        if self.path is not None:
            return f"write it to {self.path} (--join-token-file)"
        return "restart the agent with it (--join-token, or --join-token-file to need no restart)"


def tls_dir(state_dir: Path) -> Path:
    return state_dir / "tls"


def _pki(request: dict[str, Any], *, child: bool | None = None) -> dict[str, Any]:
    """Answer ``request`` with :mod:`gpufleet.agent.pkichild`: in a child process, unless
    ``child`` is False or (``child`` None) this process has ``cryptography`` loaded already.

    Raises:
        tls.PkiError: the child failed (its ``error:`` line or exit status in the message).
    """
    if child is None:
        child = "cryptography" not in sys.modules
    if not child:
        from gpufleet.agent import pkichild

        return pkichild.handle(request)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpufleet.agent.pkichild"],
            input=json.dumps(request).encode(),
            capture_output=True,
            timeout=PKI_CHILD_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise tls.PkiError(f"certificate helper process failed: {exc}") from None
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        raise tls.PkiError(
            f"certificate helper process exited {done.returncode}: {why[0]}"
        ) from None
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def new_csr(node_id: str, *, child: bool | None = None) -> tuple[bytes, bytes]:
    """A new EC P-256 key for ``node_id`` and its CSR: (key PEM, CSR PEM). ``child``: see
    :func:`_pki`. Raises tls.PkiError when the helper process fails."""
    answer = _pki({"op": "csr", "node_id": node_id}, child=child)
    return str(answer["key_pem"]).encode(), str(answer["csr_pem"]).encode()


def inspect(
    creds: tls.NodeCredentials, node_id: str, *, child: bool | None = None
) -> tuple[str | None, tls.CertFacts | None]:
    """(why ``creds`` cannot be used for ``node_id`` now or None, the certificate's facts or
    None when unreadable): :meth:`tls.NodeCredentials.problem` and ``facts``. ``child``: see
    :func:`_pki`. Raises tls.PkiError when the helper process fails."""
    answer = _pki(
        {
            "op": "inspect",
            "node_id": node_id,
            "key_pem": creds.key_pem.decode(errors="replace"),
            "chain_pem": creds.chain_pem.decode(errors="replace"),
            "ca_pem": creds.ca_pem.decode(errors="replace"),
        },
        child=child,
    )
    facts = answer.get("facts")
    problem = answer.get("problem")
    return (
        None if problem is None else str(problem),
        None if facts is None else tls.CertFacts.from_json(facts),
    )


def _fingerprint_or_none(pem: bytes) -> str | None:
    try:
        return tls.fingerprint(pem)
    except ValueError:
        return None


def ensure_credentials(
    state_dir: Path,
    node_id: str,
    *,
    join_address: str,
    join_token: str | None,
    ca_cert: Path | None,
    stop: threading.Event,
    rejoin: bool = False,
    held: Callable[[], HeldState] | None = None,
) -> tuple[tls.NodeCredentials, tls.CertFacts] | None:
    """This node's usable credentials and their certificate's facts: the saved ones, else
    new ones from a join; with ``rejoin``, new ones from a join whatever is saved (the
    controller refused the saved certificate as revoked). ``held``: what the state dir
    holds, sent with a join (see :func:`join`).

    Returns None only if ``stop`` is set while the controller is unreachable.

    Raises:
        tls.PkiError: no usable certificate and no join token; a join token or CA that does
            not match; JoinRefused.
        ValueError: a malformed join token.
    """
    directory = tls_dir(state_dir)
    saved = tls.NodeCredentials.load(directory)
    problem, facts = inspect(saved, node_id) if saved is not None else ("none saved", None)
    if saved is not None and rejoin:
        problem = "refused by the controller as revoked"
    if saved is not None and problem is None and join_token:
        pin = tls.parse_join_token(join_token)[0]
        if _fingerprint_or_none(saved.ca_pem) != pin:
            problem = "issued by another fleet CA than the join token's"
    if saved is not None and problem is None and facts is not None:
        if join_token:
            logger.info("node %s has a valid certificate; the join token is not used", node_id)
        return saved, facts
    if not join_token:
        raise tls.PkiError(
            f"no usable node certificate in {directory} ({problem}): start the agent with "
            f"--join-token (from `gpufleet admin node join-token --node-id {node_id}`), "
            "or --insecure for plaintext"
        )
    if saved is not None:
        logger.warning("node certificate in %s unusable (%s): joining again", directory, problem)
    return join(
        state_dir,
        node_id,
        join_address=join_address,
        join_token=join_token,
        ca_cert=ca_cert,
        stop=stop,
        held=held,
    )


HeldState = tuple[int, list[pb.RunRef]]
"""What an agent's state dir holds, sent with a join: (its agent epoch, 0 = none; the
attempts its assignment log has not seen reported)."""


def join(
    state_dir: Path,
    node_id: str,
    *,
    join_address: str,
    join_token: str,
    ca_cert: Path | None,
    stop: threading.Event,
    held: Callable[[], HeldState] | None = None,
) -> tuple[tls.NodeCredentials, tls.CertFacts] | None:
    """Join with ``join_token``: a new key, a certificate for it from the controller's join
    service, saved in ``state_dir``'s TLS directory (replacing what was there). Also used
    when the controller refuses a saved certificate as revoked (``admin node forget``) and
    the agent was started with a new token.

    ``held``: what the state dir holds (:data:`HeldState`), read just before the request is
    made. The controller keeps the attempts it names (a certificate that expired while the
    agent was stopped is no re-install) and fences the node's other attempts; without it
    (or with agent epoch 0) the join is taken for a re-install and every attempt is fenced.

    Returns None only if ``stop`` is set while the controller is unreachable.

    Raises:
        tls.PkiError: a CA that does not match the token; an unusable answer.
        JoinRefused: the controller refused the token (spent, expired, another node's).
        ValueError: a malformed join token.
    """
    directory = tls_dir(state_dir)
    pin, secret = tls.parse_join_token(join_token)
    # a comma-separated list: one join service per controller, tried in turn
    addresses = [a.strip() for a in join_address.split(",") if a.strip()] or [join_address]
    ca_pem = _ca_for_join(pin, ca_cert, addresses, stop)
    if ca_pem is None:
        return None
    key_pem, csr_pem = new_csr(node_id)
    agent_epoch, held_runs = held() if held is not None else (0, [])
    request = pb.JoinRequest(
        token=secret,
        node_id=node_id,
        csr_pem=csr_pem,
        agent_epoch=agent_epoch,
        held_runs=held_runs,
    )
    channels = [
        tls.secure_channel(a, tls.channel_credentials(ca_pem), tls.CONTROLLER_NAME)
        for a in addresses
    ]
    turn = iter(range(1 << 62))
    try:
        resp = _call_until_answered(
            lambda: pb_grpc.BootstrapStub(channels[next(turn) % len(channels)]).Join(
                request, timeout=CALL_TIMEOUT_S
            ),
            stop,
            f"controller join service at {join_address}",
        )
    finally:
        for channel in channels:
            channel.close()
    if resp is None:
        return None
    creds = tls.NodeCredentials(key_pem, resp.certificate_pem, resp.ca_pem)
    bad, facts = inspect(creds, node_id)
    if bad is not None or facts is None or _fingerprint_or_none(resp.ca_pem) != pin:
        raise tls.PkiError(f"the controller answered an unusable certificate: {bad}")
    creds.save(directory)
    logger.info(
        "node %s joined: certificate %s valid until %s, saved in %s",
        node_id,
        facts.serial,
        f"{facts.not_after:%Y-%m-%d %H:%M:%S}Z",
        directory,
    )
    return creds, facts


def _ca_for_join(
    pin: str, ca_cert: Path | None, join_addresses: list[str], stop: threading.Event
) -> bytes | None:
    if ca_cert is not None:
        ca_pem = ca_cert.read_bytes()
        if tls.fingerprint(ca_pem) != pin:
            raise tls.PkiError(f"{ca_cert} is not the CA the join token names")
        return ca_pem
    delay, attempts = 0.1, 0
    while not stop.is_set():
        join_address = join_addresses[attempts % len(join_addresses)]
        try:
            return tls.fetch_ca_by_fingerprint(join_address, pin)
        except OSError as exc:
            attempts += 1
            if attempts in (1, 10) or attempts % 100 == 0:
                logger.warning(
                    "controller join service at %s not reachable (%s)", join_address, exc
                )
            stop.wait(delay)
            delay = min(RETRY_MAX_S, delay * 2)
    return None


def _call_until_answered(call: Callable[[], Any], stop: threading.Event, what: str) -> Any:
    delay, attempts = 0.1, 0
    while not stop.is_set():
        try:
            return call()
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                details = exc.details() if callable(getattr(exc, "details", None)) else exc
                raise JoinRefused(
                    f"join refused ({code.name if code else '?'}): {details}"
                ) from None
            attempts += 1
            if attempts in (1, 10) or attempts % 100 == 0:
                hint = tls_hint.hint(exc)
                if hint is not None:  # it answered; the handshake failed on a certificate
                    logger.error("cannot reach the %s: %s; retrying", what, hint)
                else:
                    logger.warning("%s not reachable yet (%s); retrying", what, code.name)
            stop.wait(delay)
            delay = min(RETRY_MAX_S, delay * 2)
    return None


class ControllerChannel:
    """The agent's channel to the controller, usable as a ``ControllerStub`` (attribute access
    goes to the current stub). ``reconnect()`` swaps in a channel built from the newest
    credentials, so holders never keep a stub with a stale certificate."""

    def __init__(self, make: Callable[[], grpc.Channel]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._channel = make()
        self._stub = pb_grpc.ControllerStub(self._channel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def bootstrap(self) -> pb_grpc.BootstrapStub:
        with self._lock:
            return pb_grpc.BootstrapStub(self._channel)

    def reconnect(self) -> None:
        channel = self._make()
        with self._lock:
            old, self._channel = self._channel, channel
            self._stub = pb_grpc.ControllerStub(channel)
        timer = threading.Timer(OLD_CHANNEL_GRACE_S, old.close)
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        with self._lock:
            self._channel.close()


EXPIRED_RETRY_S = 5.0
"""Seconds between looks for an unspent join token once the node certificate has expired
(a join is tried only with one; the "cannot join again" error is said once a minute)."""


class Renewer:
    """Renews the node certificate at 2/3 of its lifetime over the mutual-TLS channel, saves
    it, and calls ``on_renewed(credentials)``. A failed renewal is retried every
    ``min(60 s, 1/10 of the time left)``. ``facts`` are those of ``creds``' certificate
    (:func:`ensure_credentials`); the key and CSR are made by :func:`new_csr`.

    A certificate that expired before it was renewed (the agent was stopped or cut off past
    its lifetime) cannot renew itself: ``on_expired()`` is called instead, every
    :data:`EXPIRED_RETRY_S`, until it answers True (it joined again and replaced
    ``creds``/``facts``)."""

    def __init__(
        self,
        creds: tls.NodeCredentials,
        facts: tls.CertFacts,
        node_id: str,
        directory: Path,
        channel: ControllerChannel,
        on_renewed: Callable[[tls.NodeCredentials], None],
        stop: threading.Event,
        on_expired: Callable[[], bool] | None = None,
    ) -> None:
        self.creds, self.facts, self.node_id, self.directory = creds, facts, node_id, directory
        self.channel, self.on_renewed, self.stop = channel, on_renewed, stop
        self.on_expired = on_expired
        self.thread = threading.Thread(target=self._loop, name="agent-renew", daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            now = dt.datetime.now(dt.UTC)
            wait_s = (self.facts.renew_at() - now).total_seconds()
            if wait_s > 0:
                self.stop.wait(wait_s)
                continue
            if now >= self.facts.not_after:  # no renewal over an expired certificate
                if self.on_expired is not None and self.on_expired():
                    continue  # joined again: new credentials and facts
                self.stop.wait(EXPIRED_RETRY_S)
                continue
            try:
                self.renew_once()
            except Exception as exc:  # keep the current certificate; try again soon
                left = (self.facts.not_after - dt.datetime.now(dt.UTC)).total_seconds()
                logger.warning("certificate renewal failed (%s); %.0f s left", exc, left)
                self.stop.wait(max(1.0, min(60.0, left / 10)))

    def renew_once(self) -> None:
        key_pem, csr_pem = new_csr(self.node_id)
        resp = self.channel.bootstrap().Renew(
            pb.RenewRequest(csr_pem=csr_pem), timeout=CALL_TIMEOUT_S
        )
        creds = tls.NodeCredentials(key_pem, resp.certificate_pem, resp.ca_pem)
        bad, facts = inspect(creds, self.node_id)
        if bad is not None or facts is None:
            raise tls.PkiError(f"renewed certificate unusable: {bad}")
        creds.save(self.directory)
        self.creds, self.facts = creds, facts
        self.on_renewed(creds)
        logger.info(
            "renewed the node certificate: %s, valid until %s",
            facts.serial,
            f"{facts.not_after:%Y-%m-%d %H:%M:%S}Z",
        )
