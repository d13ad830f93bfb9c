"""Client configuration: which gpufleet server to talk to, and with which token.

Resolution, per field: command flags (``--url``/``--token``) > environment
(``GPUFLEET_URL``/``GPUFLEET_TOKEN``) > the client config file > the default URL. The file
is ``$GPUFLEET_CONFIG`` if set, else ``$GPUFLEET_DATA_DIR/client.yaml``, else
``~/.gpufleet/client.yaml``; it holds YAML ``{url: ..., token: ...}`` and ``gpufleet up``
writes it with :func:`write_client_config`.

An https server whose certificate is not signed by a system CA is trusted through a CA
bundle: ``GPUFLEET_CA_BUNDLE`` (a PEM file), else ``ca_bundle:`` in the config file. A token
sent over plain http to a host other than loopback is warned about (:func:`cleartext_warning`):
API tokens must not cross a network in clear.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpufleet.client.errors import GpufleetClientError

DEFAULT_URL = "http://127.0.0.1:8420"
CLIENT_CONFIG_NAME = "client.yaml"


class ConfigError(GpufleetClientError):
    """The client configuration is unusable (unreadable file, missing token)."""


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where the server is (``url``, no trailing slash) and the bearer token, if any."""

    url: str
    token: str | None
    ca_bundle: str | None = None
    """PEM file of the CA(s) that sign the server's certificate; None = the system CAs."""


def client_config_path(data_dir: Path) -> Path:
    """The client config file that ``gpufleet up`` writes for a data directory."""
    return data_dir.expanduser() / CLIENT_CONFIG_NAME


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """The config file to read: ``GPUFLEET_CONFIG``, else under ``GPUFLEET_DATA_DIR`` or ``~``."""
    env = os.environ if env is None else env
    if env.get("GPUFLEET_CONFIG"):
        return Path(env["GPUFLEET_CONFIG"]).expanduser()
    return client_config_path(Path(env.get("GPUFLEET_DATA_DIR") or "~/.gpufleet"))


# a `key: plain-scalar` line, as yaml.safe_dump writes {url, token}: read without importing
# PyYAML (its import compiles dozens of regexes, a noticeable part of a CLI call's start-up)
_PLAIN_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*):[ \t]+([^\s'\"\[\]{}&*!|>%@`#,][^\s#]*)")


def _plain_mapping(text: str) -> dict[str, object] | None:
    """``text`` as a flat mapping of plain strings, or None when it needs a YAML parser."""
    data: dict[str, object] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _PLAIN_LINE.fullmatch(line.rstrip())
        if m is None or ": " in m.group(2) or m.group(2).lower() in _YAML_SPECIAL:
            return None
        data[m.group(1)] = m.group(2)
    return data


_YAML_SPECIAL = frozenset({"null", "~", "true", "false", "yes", "no", "on", "off"})


def _read_file(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read client config {path}: {exc}") from exc
    plain = _plain_mapping(text)
    if plain is not None:
        return plain
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot read client config {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"client config {path} must be a mapping {{url: ..., token: ...}}")
    return data


def resolve_client_config(
    url: str | None = None,
    token: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ClientConfig:
    """Resolve the config from flags, environment, config file and defaults (in that order).

    Args:
        url: the ``--url`` flag, or None.
        token: the ``--token`` flag, or None.
        env: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: the config file exists but is not valid YAML mapping.
    """
    env = os.environ if env is None else env
    file_url: object = None
    file_token: object = None
    file_ca: object = None
    if not (url and token) and not (env.get("GPUFLEET_URL") and env.get("GPUFLEET_TOKEN")):
        data = _read_file(default_config_path(env))
        file_url, file_token = data.get("url"), data.get("token")
        file_ca = data.get("ca_bundle")
    resolved_url = url or env.get("GPUFLEET_URL") or str(file_url or "") or DEFAULT_URL
    resolved_token = token or env.get("GPUFLEET_TOKEN") or str(file_token or "") or None
    ca = env.get("GPUFLEET_CA_BUNDLE") or str(file_ca or "") or None
    return ClientConfig(url=resolved_url.rstrip("/"), token=resolved_token, ca_bundle=ca)


def cleartext_warning(url: str) -> str | None:
    """A warning when ``url`` is plain http to a host that is not loopback (a token sent
    there crosses a network in clear), else None."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme.lower() != "http":
        return None
    host = (parts.hostname or "").lower()
    if host in ("localhost", "") or host.endswith(".localhost"):
        return None
    import ipaddress

    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (
        f"{url} is plain http to another host: the API token crosses the network in clear;"
        " use an https URL (gpufleet server --tls-cert/--tls-key, or a TLS proxy)"
    )


def require_token(cfg: ClientConfig) -> str:
    """The token, or a ConfigError that tells the user how to get one."""
    if not cfg.token:
        raise ConfigError(
            "no API token: run `gpufleet up` (it writes the client config) "
            "or set GPUFLEET_TOKEN (or pass --token)"
        )
    return cfg.token


def write_client_config(path: Path, url: str, token: str) -> None:
    """Write ``{url, token}`` as YAML to ``path`` with mode 0600 (atomically, via a temp file)."""
    import yaml

    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        yaml.safe_dump({"url": url, "token": token}, fh, default_flow_style=False)
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply when the temp file already existed
    os.replace(tmp, path)
