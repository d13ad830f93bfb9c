"""Container image references, normalized so that the name a job asks for and the names a
node's engine reports compare equal (``busybox`` == ``docker.io/library/busybox:latest``)."""

from __future__ import annotations

DEFAULT_REGISTRY = "docker.io"


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
