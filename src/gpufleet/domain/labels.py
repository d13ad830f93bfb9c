"""Node labels: syntax (Kubernetes' label rules), the ``key=value`` / ``key-`` argument form,
and how the agent's labels and an admin's combine.

Two sources label a node. The **agent** reports labels at every registration (``gpufleet agent
--label rack=r1``, ``GPUFLEET_AGENT_LABELS``; plus its own ``gpufleet/...`` facts such as the
containment kind) and a re-registration replaces them. An **admin** sets labels through
``PUT/PATCH /v1/admin/nodes/{id}/labels`` (``gpufleet admin node label``); they are kept apart
(``nodes.admin_labels``) so that an agent's re-registration never undoes them, and they win on
a shared key: the node's effective labels are ``{**agent, **admin}``. Removing an admin label
(``key-``, or ``null`` in a PATCH) lets the agent's value, if any, show again. Keys under
``gpufleet/`` belong to the agent and cannot be set by an admin.

Syntax (``kubernetes.io/docs/concepts/overview/working-with-objects/labels``): a key is
``[prefix/]name``, the name 1-63 characters ``[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?``, the
optional prefix a DNS subdomain of at most 253 characters; a value is empty or 1-63 characters
of the same form as a name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from gpufleet.domain.errors import ValidationFailed

RESERVED_PREFIX = "gpufleet/"
"""Keys the agent sets about itself (``gpufleet/containment`` ...); not settable by an admin."""
MAX_LABELS = 64
"""Admin labels per node (a bound on the row's size, far above rack/switch/zone use)."""

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_PREFIX = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")


def key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid label key, or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and not prefix:
        return f"label key {key!r}: empty prefix before '/'"
    if slash and (len(prefix) > 253 or not _PREFIX.fullmatch(prefix)):
        return f"label key {key!r}: the prefix must be a DNS subdomain (a-z, 0-9, '-', '.')"
    if not _NAME.fullmatch(name):
        return (
            f"label key {key!r}: the name must be 1-63 characters of A-Z a-z 0-9 '-' '_' '.',"
            " starting and ending with a letter or digit"
        )
    return None


def value_problem(key: str, value: str) -> str | None:
    """Why ``value`` is not a valid label value (for ``key``), or None. Empty is valid."""
    if value and not _NAME.fullmatch(value):
        return (
            f"label {key}={value!r}: a value must be empty or 1-63 characters of A-Z a-z 0-9"
            " '-' '_' '.', starting and ending with a letter or digit"
        )
    return None


def validate_labels(labels: Mapping[str, str | None], *, field: str = "labels") -> None:
    """Check every key (and every non-None value) of labels an admin or an operator's agent
    flags set.

    Raises:
        ValidationFailed: ``field`` is ``{field}.{key}`` for the first bad key or value, or
            ``field`` for too many labels.
    """
    if len(labels) > MAX_LABELS:
        raise ValidationFailed(f"at most {MAX_LABELS} labels per node", field=field)
    for key, value in labels.items():
        problem = key_problem(key)
        if problem is None and key.startswith(RESERVED_PREFIX):
            problem = f"label key {key!r}: keys under {RESERVED_PREFIX} are set by the agent"
        if problem is None and value is not None:
            problem = value_problem(key, value)
        if problem:
            raise ValidationFailed(problem, field=f"{field}.{key}")


def parse_label_args(items: Iterable[str], *, allow_remove: bool = True) -> dict[str, str | None]:
    """``["rack=r1", "switch-"]`` -> ``{"rack": "r1", "switch": None}`` (None: remove), checked
    with :func:`validate_labels`. A later item for the same key wins.

    Raises:
        ValidationFailed: an item that is neither ``key=value`` nor ``key-`` (``key-`` only
            with ``allow_remove``), or a bad key or value (field ``labels.{key}``).
    """
    out: dict[str, str | None] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if eq:
            out[key] = value
        elif allow_remove and item.endswith("-") and len(item) > 1:
            out[item[:-1]] = None
        else:
            form = "key=value or key-" if allow_remove else "key=value"
            raise ValidationFailed(f"label {item!r}: use {form}", field="labels")
    validate_labels(out)
    return out


def parse_label_list(text: str) -> dict[str, str]:
    """``"rack=r1,switch=s3"`` (commas or whitespace between items; the form of
    ``GPUFLEET_AGENT_LABELS``) -> ``{"rack": "r1", "switch": "s3"}``.

    Raises:
        ValidationFailed: as :func:`parse_label_args` without removals.
    """
    items = [i for i in re.split(r"[,\s]+", text.strip()) if i]
    return {k: v for k, v in parse_label_args(items, allow_remove=False).items() if v is not None}


def effective_labels(
    agent: Mapping[str, str] | None, admin: Mapping[str, str] | None
) -> dict[str, str]:
    """The node's labels as placement and ``/v1/nodes`` see them: the agent's, with the
    admin's set over them (the admin wins on a shared key)."""
    return {**(agent or {}), **(admin or {})}
