"""Container image references: checked against the OCI distribution reference grammar
(:func:`reference_problem`, :func:`check_reference`) and normalized so that the name a job asks
for and the names a node's engine reports compare equal
(``busybox`` == ``docker.io/library/busybox:latest``)."""

from __future__ import annotations

import re

from gpufleet.domain.errors import ValidationFailed

DEFAULT_REGISTRY = "docker.io"

# The grammar of github.com/distribution/reference (what docker and podman parse):
#   reference := name [ ":" tag ] [ "@" digest ]
#   name      := [ domain "/" ] path-component [ "/" path-component ]*
#   domain    := host [ ":" port ]      host: DNS name, IPv4 or [IPv6]
#   path-component := [a-z0-9]+ ( ( "." | "_" | "__" | "-"+ ) [a-z0-9]+ )*
#   tag       := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
#   digest    := algorithm ":" hex      (sha256: 64 hex digits)
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(
    rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}")
NAME_MAX = 255
"""Longest repository name (domain and path) the grammar allows, characters."""
REFERENCE_MAX = 512
"""Longest reference accepted (name, tag and digest), characters."""


def split_reference(ref: str) -> tuple[str, str, str, str]:
    """``(domain, path, tag, digest)`` of ``ref`` as docker splits it (no checks; "" for a
    part it has not). The first component is a domain when it holds ``.`` or ``:`` or is
    ``localhost``, as the docker/podman CLIs decide."""
    name, _, digest = ref.partition("@")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first, rest, tag, digest
    return "", name, tag, digest


def reference_problem(ref: str) -> str | None:
    """What is wrong with ``ref`` as an image reference, or None when it is valid.

    Valid: ``busybox``, ``python:3.11``, ``127.0.0.1:5000/gpufleet/busybox:1``,
    ``ghcr.io/org/img@sha256:<64 hex>``. Refused (each with its reason): a blank name,
    whitespace or control characters, a leading ``-`` (it would read as an option), an
    upper-case repository (``UPPER/case``), an empty path component (``a//b``), a bad tag or
    digest, a name over :data:`NAME_MAX` characters.
    """
    if not ref:
        return "must not be empty"
    if len(ref) > REFERENCE_MAX:
        return f"is longer than {REFERENCE_MAX} characters"
    if ref.startswith("-"):
        return "must not start with '-' (an image reference is never an option)"
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in ref):
        return "must not contain whitespace or control characters"
    if "://" in ref:
        return "is a registry reference (host/repository:tag), not a URL or transport"
    if ref.count("@") > 1:
        return "has more than one '@'"
    domain, path, tag, digest = split_reference(ref)
    if domain and not _DOMAIN.fullmatch(domain):
        return f"registry {domain!r} is not a host name, IPv4/[IPv6] address or host:port"
    if domain and ":" in domain.rsplit("]", 1)[-1]:
        port = domain.rsplit(":", 1)[1]
        if not port.isdigit() or not 0 < int(port) < 65536:
            return f"registry port {port!r} is not a TCP port (1-65535)"
    if not path:
        return "has no repository name"
    for part in path.split("/"):
        if not part:
            return "has an empty path component ('//' or a trailing '/')"
        if part.lower() != part and _PATH_COMPONENT.fullmatch(part.lower()):
            return f"repository {path!r} must be lower-case"
        if not _PATH_COMPONENT.fullmatch(part):
            return (
                f"repository component {part!r} may hold only a-z, 0-9 and single '.', '_',"
                " '__' or '-' runs between them"
            )
    if len(domain) + 1 + len(path) > NAME_MAX:
        return f"repository name is longer than {NAME_MAX} characters"
    name = ref.partition("@")[0]
    if name.rfind(":") > name.rfind("/") and not tag:
        return "has an empty tag after ':'"
    if tag and not _TAG.fullmatch(tag):
        return f"tag {tag!r} may hold only A-Z, a-z, 0-9, '_', '.', '-' (at most 128)"
    if "@" in ref and not _DIGEST.fullmatch(digest):
        return f"digest {digest!r} is not algorithm:hex (e.g. sha256:<64 hex digits>)"
    if digest.startswith("sha256:") and len(digest) != len("sha256:") + 64:
        return "a sha256 digest has 64 hex digits"
    return None


def check_reference(ref: str, field: str = "image") -> str:
    """``ref`` unchanged when valid.

    Raises:
        ValidationFailed: naming ``field`` (422 at the API), with :func:`reference_problem`'s
            reason.
    """
    problem = reference_problem(ref)
    if problem is not None:
        raise ValidationFailed(f"image reference {ref[:80]!r} {problem}", field=field)
    return ref


def normalize_image(ref: str) -> str:
    """The canonical form ``registry/path:tag`` (or ``registry/path@digest``) of ``ref``.

    Rules of the docker/podman CLIs: no registry (the first component has no ``.`` or ``:``
    and is not ``localhost``) means Docker Hub, a one-component Hub name is under
    ``library/``, and no tag means ``:latest``. Blank input returns "".
    """
    ref = ref.strip()
    if not ref:
        return ""
    first, _, rest = ref.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        ref = f"{DEFAULT_REGISTRY}/{ref}" if rest else f"{DEFAULT_REGISTRY}/library/{ref}"
    if "@" in ref:
        return ref
    last = ref.rsplit("/", 1)[-1]
    return ref if ":" in last else f"{ref}:latest"
