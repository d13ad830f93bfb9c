"""Fleet PKI and gRPC credentials: certificates in, credentials out (the overview).

The controller, the agent and the CLI share this plane; it is split by who does what, and
this module re-exports every public name (``from gpufleet.rpc import tls``; ``tls.FleetCA``):

* :mod:`gpufleet.rpc.pki`: names, constants, :class:`PkiError`, :class:`Identity`, keys, PEM
  and fingerprints (shared by every side);
* :mod:`gpufleet.rpc.ca`: the fleet CA, issuing the controller's certificate and signing
  node CSRs;
* :mod:`gpufleet.rpc.node_certs`: a node's CSR, saved credentials and renewal timing;
* :mod:`gpufleet.rpc.peers`: the verified peer of a gRPC call and :class:`RoleInterceptor`;
* :mod:`gpufleet.rpc.credentials`: gRPC server and channel credentials;
* :mod:`gpufleet.rpc.join`: join tokens and fetching the CA a token pins.

``cryptography`` (~12 MB of a process's memory) is imported by the functions that use it,
never by importing these modules: the node agent's long-running process does its certificate
work in a short-lived child (``gpufleet.agent.pkichild``) and uses only what needs no
``cryptography`` (credentials for gRPC, :class:`RoleInterceptor`, :func:`fingerprint` of PEM
bytes, :func:`fetch_ca_by_fingerprint`, join tokens). The shapes:

* **Fleet CA** (``{pki_dir}/ca.key`` mode 0600, ``ca.crt``): a self-signed EC P-256 CA. Whoever
  holds ``ca.key`` can mint any identity, so it lives only where controllers run.
* **Controller certificate**: subject ``O=gpufleet, OU=controller``, SAN ``controller.gpufleet``
  (the name agents verify, whatever address they dial), loopback addresses and the configured
  host names; EKU server + client auth (it serves agents and calls them). Issued by the
  controller from the CA at every start.
* **Node certificate**: subject ``O=gpufleet, OU=node, CN=<node id>``, SAN
  ``<node id>.node.gpufleet`` (the name the controller verifies when it calls that node's
  agent); EKU server + client auth. The key is made on the node; the controller signs its CSR
  after a join token or, for renewal, the node's current certificate.

The role is the subject's OU and is only ever set by the CA, never taken from a CSR.
A node SAN always ends in ``.node.gpufleet``, so no node certificate can carry the
controller's name.
"""

from gpufleet.rpc.ca import (
    CA_CERT,
    CA_KEY,
    FleetCA,
    ca_paths,
    init_ca,
    load_ca,
    local_ca_fingerprint,
    read_ca_cert,
)
from gpufleet.rpc.credentials import (
    ReloadableServerCredentials,
    channel_credentials,
    secure_channel,
    server_credentials,
)
from gpufleet.rpc.join import (
    JOIN_PREFIX,
    fetch_ca_by_fingerprint,
    format_join_token,
    hash_secret,
    parse_join_token,
)
from gpufleet.rpc.node_certs import CertFacts, NodeCredentials, make_csr, renew_at
from gpufleet.rpc.peers import (
    RoleInterceptor,
    peer_identity,
    peer_name,
    peer_role,
    peer_subject,
)
from gpufleet.rpc.pki import (
    CA_TTL_S,
    CLOCK_SKEW_S,
    CONTROLLER_CERT_TTL_S,
    CONTROLLER_NAME,
    NODE_ID,
    NODE_SUFFIX,
    ORG,
    ROLE_API,
    ROLE_CONTROLLER,
    ROLE_NODE,
    Identity,
    PkiError,
    cert_pem,
    check_node_id,
    fingerprint,
    first_der,
    identity_of,
    key_pem,
    new_key,
    node_target_name,
    serial_hex,
    write_private,
)

__all__ = [
    "CA_CERT",
    "CA_KEY",
    "CA_TTL_S",
    "CLOCK_SKEW_S",
    "CONTROLLER_CERT_TTL_S",
    "CONTROLLER_NAME",
    "JOIN_PREFIX",
    "NODE_ID",
    "NODE_SUFFIX",
    "ORG",
    "ROLE_API",
    "ROLE_CONTROLLER",
    "ROLE_NODE",
    "CertFacts",
    "FleetCA",
    "Identity",
    "NodeCredentials",
    "PkiError",
    "ReloadableServerCredentials",
    "RoleInterceptor",
    "ca_paths",
    "cert_pem",
    "channel_credentials",
    "check_node_id",
    "fetch_ca_by_fingerprint",
    "fingerprint",
    "first_der",
    "format_join_token",
    "hash_secret",
    "identity_of",
    "init_ca",
    "key_pem",
    "load_ca",
    "local_ca_fingerprint",
    "make_csr",
    "new_key",
    "node_target_name",
    "parse_join_token",
    "peer_identity",
    "peer_name",
    "peer_role",
    "peer_subject",
    "read_ca_cert",
    "renew_at",
    "secure_channel",
    "serial_hex",
    "server_credentials",
    "write_private",
]
