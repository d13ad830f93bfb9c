"""Client configuration (which server, which token): lives in the SDK,
:mod:`gpufleet.client.config`, so that ``gpufleet.client`` needs nothing of the CLI."""

from gpufleet.client.config import (
    CLIENT_CONFIG_NAME,
    DEFAULT_URL,
    ClientConfig,
    ConfigError,
    client_config_path,
    default_config_path,
    require_token,
    resolve_client_config,
    write_client_config,
)

__all__ = [
    "CLIENT_CONFIG_NAME",
    "DEFAULT_URL",
    "ClientConfig",
    "ConfigError",
    "client_config_path",
    "default_config_path",
    "require_token",
    "resolve_client_config",
    "write_client_config",
]
