"""The node agent's certificate work, done in a short-lived child process so that the
long-running agent never loads ``cryptography`` (~12 MB of its resident memory, issue 11):
making a key and its CSR (join, renewal) and checking saved or received credentials.

The agent runs ``python -m gpufleet.agent.pkichild`` with one JSON request on stdin and reads
one JSON answer on stdout (:func:`gpufleet.agent.identity.new_csr`,
:func:`gpufleet.agent.identity.inspect`); the private key comes back over that pipe and is
written to disk only by the agent (mode 0600, ``tls.NodeCredentials.save``). A process that
has ``cryptography`` loaded already (tests, an agent run in-process) calls :func:`handle`
directly instead.

Requests and answers (PEM as text):

* ``{"op": "csr", "node_id": N}`` -> ``{"key_pem": ..., "csr_pem": ...}``;
* ``{"op": "inspect", "node_id": N, "key_pem": ..., "chain_pem": ..., "ca_pem": ...}`` ->
  ``{"problem": str | null, "facts": {"serial", "not_before", "not_after"} | null}``
  (``problem`` as :meth:`gpufleet.rpc.tls.NodeCredentials.problem`; ``facts`` null only when
  the certificate cannot be read).

Exit status 0 with the answer; 2 with one ``error:`` line on stderr for a bad request.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from gpufleet.rpc import tls


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """Answer one request (see the module docstring). Raises ValueError for a bad one."""
    op = request.get("op")
    node_id = str(request.get("node_id", ""))
    if op == "csr":
        key = tls.new_key()
        return {
            "key_pem": tls.key_pem(key).decode(),
            "csr_pem": tls.make_csr(key, node_id).decode(),
        }
    if op == "inspect":
        creds = tls.NodeCredentials(
            str(request["key_pem"]).encode(),
            str(request["chain_pem"]).encode(),
            str(request["ca_pem"]).encode(),
        )
        try:
            facts: dict[str, str] | None = creds.facts().to_json()
        except ValueError:
            facts = None
        return {"problem": creds.problem(node_id), "facts": facts}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    try:
        answer = handle(json.loads(sys.stdin.read()))
    except (ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
